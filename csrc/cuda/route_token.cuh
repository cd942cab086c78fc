/* Top-k routing of one token by one warp (numerics.md "Routing"), shared by
 * route_kernel (route.cu) and the fused route + sort kernel
 * (route_align.cu); route.cu's header describes the method. Also the host
 * check both launchers run first.
 *
 * Up to kRouteRegExperts experts a lane keeps its experts' scores and choices
 * in registers (route_token_regs): the k arg-max rounds are two warp
 * reductions over 32-bit keys (route_key), and shared memory holds only what
 * lanes exchange (the group step's choices, the chosen slots). Beyond, every
 * row lives in shared memory (route_scores, route_select_warp). Both give the
 * same bits (benchmarks/route_probe.cu fingerprints them). */
#ifndef MOE_EXT_CUDA_ROUTE_TOKEN_CUH
#define MOE_EXT_CUDA_ROUTE_TOKEN_CUH

#include "common.cuh"

#include <math.h>

#include <type_traits>

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

/* route_better's order as unsigned keys: NaN lowest (0), -0 as +0 (they
 * compare equal, so the index decides), then the floats' order. */
__device__ __forceinline__ uint32_t route_key(float v)
{
    if (isnan(v))
        return 0u;
    const uint32_t b = __float_as_uint(v + 0.0f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* The index of the warp's best (v, i) under route_better, to every lane:
 * the largest key, then the lowest index holding it, each one warp
 * reduction (redux.sync; a butterfly of shuffles and route_better compares
 * was ~70 dependent instructions per call, and the k rounds of a token's
 * top k issue one call each). */
__device__ __forceinline__ int warp_argmax(float v, int i)
{
    const uint32_t key = route_key(v);
    const uint32_t best = __reduce_max_sync(0xffffffffu, key);
    return static_cast<int>(__reduce_min_sync(0xffffffffu, key == best ? static_cast<uint32_t>(i) : 0xffffffffu));
}

__device__ __forceinline__ float warp_max(float v)
{
    for (int off = 16; off > 0; off >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/* warp_max of values that are never NaN, as one redux over route_key's
 * order (+0 for a zero maximum of either sign: softmax subtracts it, and
 * x - 0 and x - (-0) have the same exp). */
__device__ __forceinline__ float warp_max_finite_order(float v)
{
    const uint32_t key = __reduce_max_sync(0xffffffffu, route_key(v));
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
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

/* Step 2 by one warp, on choice in shared memory: keep the topk_group best
 * groups (a group's score: with a bias the sum of its two largest choices,
 * else its largest) and set the others' choices to -inf. */
__device__ __forceinline__ void route_mask_groups(const mx_routing_problem &p, const route_rows &r, int lane)
{
    const int E = static_cast<int>(p.num_experts);
    const int G = p.num_expert_group;
    const int gs = E / G;
    float *choice = r.choice, *group = r.group;
    int *aux = r.aux;
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

/* Steps 1-2 by one warp: scores, then choice with the groups masked. */
__device__ __forceinline__ void route_scores(const mx_routing_problem &p, int64_t t, const route_rows &r, int lane)
{
    const int E = static_cast<int>(p.num_experts);
    float *score = r.score, *choice = r.choice;

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

    if (p.num_expert_group > 0)
        route_mask_groups(p, r, lane);
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
        bi = warp_argmax(bv, bi);
        __syncwarp();
        if (lane == 0) {
            r.choice[bi] = NAN;
            r.group[j] = r.score[bi];
            r.aux[j] = bi;
        }
        __syncwarp();
    }
}

/* The sum of the k slot weights in r.group, in slot order (float32), to
 * every lane. */
__device__ __forceinline__ float route_slot_sum(const route_rows &r, int k, int lane)
{
    float wsum = 0.0f;
    if (lane == 0)
        for (int j = 0; j < k; ++j)
            wsum += r.group[j];
    return __shfl_sync(0xffffffffu, wsum, 0);
}

/* Step 4 by one warp: renormalize over the slots by wsum (route_slot_sum's
 * value), scale, write topk_weights[t, :] and topk_ids[t, :] (and the ids
 * to ids_copy[t * k + j] when given). */
__device__ __forceinline__ void route_write(const mx_routing_problem &p, int64_t t, const route_rows &r, int lane,
                                            int32_t *ids_copy, float wsum)
{
    const int k = p.top_k;
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

/* Experts a lane can keep in registers: up to 8 per lane. */
constexpr int kRouteRegExperts = 256;

/* Lane's logits of token t, experts lane + 32 i (0 past E): one dtype
 * switch, then EPL loads issued together. */
template <int EPL>
__device__ __forceinline__ void route_load_logits(const mx_routing_problem &p, int64_t t, int lane, float (&v)[EPL])
{
    const int E = static_cast<int>(p.num_experts);
    auto load = [&](const auto *row) {
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            v[i] = lane + 32 * i < E ? mx_to_float(row[t * E + lane + 32 * i]) : 0.0f;
    };
    switch (p.logits_dtype) {
    case MX_F16: load(static_cast<const __half *>(p.router_logits)); break;
    case MX_BF16: load(static_cast<const __nv_bfloat16 *>(p.router_logits)); break;
    default: load(static_cast<const float *>(p.router_logits)); break;
    }
}

/* Steps 1-3 by one warp with lane's experts e = lane + 32 i (i < EPL,
 * E <= 32 EPL) in registers; then the slots in r.group / r.aux as
 * route_select_warp leaves them, and their sum (route_slot_sum's) as the
 * result. The same arithmetic in the same order as route_scores and
 * route_select_warp. Each arg-max round works on route_key's keys (taken:
 * 0): the lane's largest key, the warp's (a redux), the lowest index
 * holding it (a redux); the owner's score is shuffled to every lane, which
 * add it to the slot sum. */
template <int EPL>
__device__ __forceinline__ float route_token_regs(const mx_routing_problem &p, int64_t t, const route_rows &r, int lane)
{
    const int E = static_cast<int>(p.num_experts);
    float score[EPL], choice[EPL];
    route_load_logits<EPL>(p, t, lane, score);
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < EPL; ++i)
        if (lane + 32 * i < E)
            mx = fmaxf(mx, score[i]);
    if (p.scoring == MX_SCORING_SOFTMAX) {
        mx = warp_max_finite_order(mx);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            if (lane + 32 * i < E) {
                score[i] = expf(score[i] - mx);
                sum += score[i];
            }
        sum = warp_sum(sum);
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            score[i] = score[i] / sum;
    } else {
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            score[i] = 1.0f / (1.0f + expf(-score[i]));
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int e = lane + 32 * i;
        float c = score[i];
        if (e < E && p.correction_bias)
            c += mx_load_float(p.correction_bias, p.bias_dtype, e);
        choice[i] = e >= E ? NAN : isnan(c) ? -INFINITY : c; /* NaN: taken, or no expert */
    }
    if (p.num_expert_group > 0) {
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            if (lane + 32 * i < E)
                r.choice[lane + 32 * i] = choice[i];
        __syncwarp();
        route_mask_groups(p, r, lane);
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            if (lane + 32 * i < E)
                choice[i] = r.choice[lane + 32 * i];
    }
    uint32_t key[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i)
        key[i] = route_key(choice[i]);
    float wsum = 0.0f;
    for (int j = 0; j < p.top_k; ++j) {
        uint32_t mine = key[0];
#pragma unroll
        for (int i = 1; i < EPL; ++i)
            mine = max(mine, key[i]);
        const uint32_t best = __reduce_max_sync(0xffffffffu, mine);
        uint32_t at = 0xffffffffu;
#pragma unroll
        for (int i = EPL - 1; i >= 0; --i)
            if (key[i] == best)
                at = static_cast<uint32_t>(lane + 32 * i);
        const int bi = static_cast<int>(__reduce_min_sync(0xffffffffu, at));
        float w = 0.0f;
#pragma unroll
        for (int i = 0; i < EPL; ++i)
            if (lane + 32 * i == bi) {
                key[i] = 0u;
                w = score[i];
            }
        w = __shfl_sync(0xffffffffu, w, bi & 31);
        wsum += w;
        if (lane == 0) {
            r.group[j] = w;
            r.aux[j] = bi;
        }
    }
    __syncwarp();
    return wsum;
}

/* Routes token t with the calling warp; rows: the warp's 4 * E floats of
 * shared memory. Writes topk_weights[t, :] and topk_ids[t, :] (ids_copy as
 * for route_write). EPL: route_experts_per_lane(E), a template argument so
 * that each kernel holds one straight path (a routing launch runs cold: its
 * code is fetched from L2 or DRAM after the GEMMs). */
template <int EPL>
__device__ __forceinline__ void route_token(const mx_routing_problem &p, int64_t t, float *rows, int lane,
                                            int32_t *ids_copy)
{
    const route_rows r(rows, static_cast<int>(p.num_experts));
    float wsum;
    if constexpr (EPL > 0) {
        wsum = route_token_regs<EPL>(p, t, r, lane);
    } else {
        route_scores(p, t, r, lane);
        route_select_warp(p, r, lane);
        wsum = route_slot_sum(r, p.top_k, lane);
    }
    route_write(p, t, r, lane, ids_copy, wsum);
}

/* Experts per lane of route_token's register path for E experts (1, 2, 4
 * or 8), or 0 for the shared-memory path past kRouteRegExperts. */
inline int route_experts_per_lane(int64_t experts)
{
    return experts <= 32 ? 1 : experts <= 64 ? 2 : experts <= 128 ? 4 : experts <= kRouteRegExperts ? 8 : 0;
}

/* pick(std::integral_constant<int, EPL>()) for EPL =
 * route_experts_per_lane(experts): the launchers' choice of kernel<EPL>. */
template <typename Pick> auto route_pick_experts_per_lane(int64_t experts, Pick pick)
{
    switch (route_experts_per_lane(experts)) {
    case 1:
        return pick(std::integral_constant<int, 1>());
    case 2:
        return pick(std::integral_constant<int, 2>());
    case 4:
        return pick(std::integral_constant<int, 4>());
    case 8:
        return pick(std::integral_constant<int, 8>());
    default:
        return pick(std::integral_constant<int, 0>());
    }
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

} /* namespace */

#endif /* MOE_EXT_CUDA_ROUTE_TOKEN_CUH */
