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

/* Routes token t with the calling warp; rows: the warp's 4 * E floats of
 * shared memory (score, choice, group, aux). Writes topk_weights[t, :] and
 * topk_ids[t, :]. */
__device__ __forceinline__ void route_token(const mx_routing_problem &p, int64_t t, float *rows, int lane)
{
    const int E = static_cast<int>(p.num_experts);
    const int k = p.top_k;
    float *score = rows;
    float *choice = score + E;
    float *group = choice + E;
    int *aux = reinterpret_cast<int *>(group + E);

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

    /* 3. k rounds of arg-max over the untaken experts */
    float wsum = 0.0f;
    for (int j = 0; j < k; ++j) {
        float bv = NAN;
        int bi = E;
        for (int e = lane; e < E; e += 32)
            if (route_better(choice[e], e, bv, bi)) {
                bv = choice[e];
                bi = e;
            }
        warp_argmax(bv, bi);
        __syncwarp();
        if (lane == 0) {
            choice[bi] = NAN;
            group[j] = score[bi];
            aux[j] = bi;
            wsum += score[bi]; /* slot order, float32 */
        }
        __syncwarp();
    }

    /* 4. renormalize, scale, write */
    wsum = __shfl_sync(0xffffffffu, wsum, 0);
    for (int j = lane; j < k; j += 32) {
        float w = group[j];
        if (p.renormalize)
            w = w / wsum;
        p.topk_weights[t * k + j] = w * p.routed_scaling_factor;
        p.topk_ids[t * k + j] = aux[j];
    }
    __syncwarp(); /* the rows are free for the warp's next token */
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
