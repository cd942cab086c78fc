/* Top-k routing of one token by one warp (numerics.md "Routing"), shared by
 * route_kernel (route.cu) and the fused route + sort kernel
 * (route_align.cu); route.cu's header describes the method. Also the host
 * check both launchers run first. */
#ifndef MOE_EXT_CUDA_ROUTE_TOKEN_CUH
#define MOE_EXT_CUDA_ROUTE_TOKEN_CUH

#include "common.cuh"

#include <math.h>

namespace {

/* Larger (value, index) under "higher value, then lower index"; NaN values
 * (taken experts) lose to everything. */
__device__ __forceinline__ bool route_better(float v, int i, float bv, int bi)
{
    if (isnan(v))
        return false;
    if (isnan(bv))
        return true;
    return v > bv || (v == bv && i < bi);
}

__device__ __forceinline__ void warp_argmax(float &v, int &i)
{
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, off);
        int oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (route_better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

__device__ __forceinline__ float warp_max(float v)
{
    for (int off = 16; off > 0; off >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

__device__ __forceinline__ float warp_sum(float v)
{
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* Token t's working rows in shared memory (4 x E floats). */
struct route_rows {
    float *score;  /* [E] s = softmax(logits) or sigmoid(logits) */
    float *choice; /* [E] s + bias, -inf outside the kept groups, NaN once taken */
    float *group;  /* [E] per-group score, then slot j's weight */
    int *aux;      /* [E] per-group keep flag, then slot j's expert */
    __device__ route_rows(float *rows, int E)
        : score(rows), choice(rows + E), group(rows + 2 * E), aux(reinterpret_cast<int *>(rows + 3 * E))
    {
    }
};

/* Steps 1-2 by one warp: scores, then choice with the groups masked. */
__device__ __forceinline__ void route_scores(const mx_routing_problem &p, int64_t t, const route_rows &r, int lane)
{
    const int E = static_cast<int>(p.num_experts);
    float *score = r.score, *choice = r.choice, *group = r.group;
    int *aux = r.aux;

    /* 1. scores */
    const int64_t base = t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) {
        float v = mx_load_float(p.router_logits, p.logits_dtype, base + e);
        score[e] = v;
        mx = fmaxf(mx, v);
    }
    if (p.scoring == MX_SCORING_SOFTMAX) {
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < E; e += 32) {
            float ex = expf(score[e] - mx);
            score[e] = ex;
            sum += ex;
        }
        sum = warp_sum(sum);
        for (int e = lane; e < E; e += 32)
            score[e] = score[e] / sum;
    } else {
        for (int e = lane; e < E; e += 32)
            score[e] = 1.0f / (1.0f + expf(-score[e]));
    }
    for (int e = lane; e < E; e += 32) {
        float c = score[e];
        if (p.correction_bias)
            c += mx_load_float(p.correction_bias, p.bias_dtype, e);
        choice[e] = isnan(c) ? -INFINITY : c; /* NaN is reserved for "taken" */
    }
    __syncwarp();

    /* 2. grouped top-k: keep the topk_group best groups, mask the rest */
    if (p.num_expert_group > 0) {
        const int G = p.num_expert_group;
        const int gs = E / G;
        for (int g = lane; g < G; g += 32) {
            const float *c = choice + g * gs;
            float m1 = -INFINITY, m2 = -INFINITY;
            for (int i = 0; i < gs; ++i) {
                float v = c[i];
                if (v > m1) {
                    m2 = m1;
                    m1 = v;
                } else if (v > m2) {
                    m2 = v;
                }
            }
            /* with a bias: sum of the two largest s + b; else the max */
            group[g] = (p.correction_bias && gs > 1) ? m1 + m2 : m1;
        }
        __syncwarp();
        for (int g = lane; g < G; g += 32) {
            const float v = group[g];
            int rank = 0;
            for (int h = 0; h < G; ++h)
                rank += route_better(group[h], h, v, g);
            aux[g] = rank < p.topk_group;
        }
        __syncwarp();
        for (int e = lane; e < E; e += 32)
            if (!aux[e / gs])
                choice[e] = -INFINITY;
        __syncwarp();
    }
}

/* Step 3 by one warp: k rounds of arg-max over the untaken experts; slot j
 * gets the j-th best (value, then lower index). */
__device__ __forceinline__ void route_select_warp(const mx_routing_problem &p, const route_rows &r, int lane)
{
    const int E = static_cast<int>(p.num_experts);
    for (int j = 0; j < p.top_k; ++j) {
        float bv = NAN;
        int bi = E;
        for (int e = lane; e < E; e += 32)
            if (route_better(r.choice[e], e, bv, bi)) {
                bv = r.choice[e];
                bi = e;
            }
        warp_argmax(bv, bi);
        __syncwarp();
        if (lane == 0) {
            r.choice[bi] = NAN;
            r.group[j] = r.score[bi];
            r.aux[j] = bi;
        }
        __syncwarp();
    }
}

/* Step 3 by the `threads` threads of a token's group (i = 0..threads-1),
 * with no rounds: expert e's slot is its rank, the number of experts better
 * than it (the same order as route_select_warp, so the same slots). The
 * caller synchronizes the group before (choice complete) and after. */
__device__ __forceinline__ void route_select_ranks(const mx_routing_problem &p, const route_rows &r, int i,
                                                   int threads)
{
    const int E = static_cast<int>(p.num_experts);
    for (int e = i; e < E; e += threads) {
        const float v = r.choice[e];
        int rank = 0;
        for (int h = 0; h < E; ++h)
            rank += route_better(r.choice[h], h, v, e);
        if (rank < p.top_k) {
            r.group[rank] = r.score[e];
            r.aux[rank] = e;
        }
    }
}

/* Step 4 by one warp: renormalize over the slots (float32, slot order),
 * scale, write topk_weights[t, :] and topk_ids[t, :] (and the ids to
 * ids_copy[t * k + j] when given). */
__device__ __forceinline__ void route_write(const mx_routing_problem &p, int64_t t, const route_rows &r, int lane,
                                            int32_t *ids_copy)
{
    const int k = p.top_k;
    float wsum = 0.0f;
    if (lane == 0)
        for (int j = 0; j < k; ++j)
            wsum += r.group[j];
    wsum = __shfl_sync(0xffffffffu, wsum, 0);
    for (int j = lane; j < k; j += 32) {
        float w = r.group[j];
        if (p.renormalize)
            w = w / wsum;
        p.topk_weights[t * k + j] = w * p.routed_scaling_factor;
        p.topk_ids[t * k + j] = r.aux[j];
        if (ids_copy)
            ids_copy[t * k + j] = r.aux[j];
    }
    __syncwarp(); /* the rows are free for the warp's next token */
}

/* Routes token t with the calling warp; rows: the warp's 4 * E floats of
 * shared memory. Writes topk_weights[t, :] and topk_ids[t, :] (ids_copy as
 * for route_write). */
__device__ __forceinline__ void route_token(const mx_routing_problem &p, int64_t t, float *rows, int lane,
                                            int32_t *ids_copy)
{
    const route_rows r(rows, static_cast<int>(p.num_experts));
    route_scores(p, t, r, lane);
    route_select_warp(p, r, lane);
    route_write(p, t, r, lane, ids_copy);
}

/* 0 => p is routable (M >= 1); else st holds the error. */
inline int route_check(const mx_routing_problem *p, mx_status *st)
{
    auto float_dtype = [](mx_dtype dt) { return dt == MX_F32 || dt == MX_F16 || dt == MX_BF16; };
    if (p->num_tokens < 0 || p->num_experts < 1 || p->top_k < 1 || p->top_k > p->num_experts)
        *st = mx_status_fail(MX_ERR_VALUE, "route: need M >= 0 and 1 <= top_k <= E (M=%lld, E=%lld, k=%d)",
                             (long long)p->num_tokens, (long long)p->num_experts, p->top_k);
    else if (p->num_expert_group < 0 ||
             (p->num_expert_group > 0 &&
              (p->num_experts % p->num_expert_group != 0 || p->topk_group < 1 ||
               p->topk_group > p->num_expert_group)))
        *st = mx_status_fail(MX_ERR_VALUE,
                             "route: num_expert_group=%d must divide E=%lld and 1 <= topk_group=%d <= groups",
                             p->num_expert_group, (long long)p->num_experts, p->topk_group);
    else if (!float_dtype(p->logits_dtype))
        *st = mx_status_fail(MX_ERR_TYPE, "route: router_logits dtype %s is not float32/float16/bfloat16",
                             mx_dtype_name(p->logits_dtype));
    else if (p->correction_bias && !float_dtype(p->bias_dtype))
        *st = mx_status_fail(MX_ERR_TYPE, "route: correction_bias dtype %s is not float32/float16/bfloat16",
                             mx_dtype_name(p->bias_dtype));
    else if (!p->router_logits || !p->topk_weights || !p->topk_ids)
        *st = mx_status_fail(MX_ERR_VALUE, "route: router_logits, topk_weights and topk_ids must be given");
    else
        return 0;
    return 1;
}

/* Shared-memory bytes of one routing warp (its four rows of E floats). */
inline size_t route_warp_bytes(int64_t experts) { return 4 * sizeof(float) * static_cast<size_t>(experts); }

/* Threads of a token group for route_select_ranks: E rounded up to whole
 * warps, or 0 (one warp per token) past 1024. */
inline int route_group_threads(int64_t experts)
{
    const int64_t threads = (experts + 31) / 32 * 32;
    return threads <= 1024 ? static_cast<int>(threads) : 0;
}

/* Token t routed by a group of `threads` threads (i = 0..threads-1 within
 * it; live: t is a token). Synchronizes the whole block twice, so every
 * thread of the block calls it. */
__device__ __forceinline__ void route_token_by_group(const mx_routing_problem &p, int64_t t, float *rows, int i,
                                                     int threads, bool live, int32_t *ids_copy)
{
    const route_rows r(rows, static_cast<int>(p.num_experts));
    if (live && i < 32)
        route_scores(p, t, r, i);
    __syncthreads();
    if (live)
        route_select_ranks(p, r, i, threads);
    __syncthreads();
    if (live && i < 32)
        route_write(p, t, r, i, ids_copy);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_ROUTE_TOKEN_CUH */
