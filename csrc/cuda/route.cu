/* Top-k routing on the GPU (numerics.md "Routing").
 *
 * Operands: router_logits [M, E] row-major in float32/float16/bfloat16;
 * correction_bias [E] (optional, same dtype set); outputs topk_weights
 * float32 [M, k] and topk_ids int32 [M, k], slot j holding the j-th best
 * expert.
 *
 * Tiling: one warp per token, kWarpsPerBlock tokens per block. Each warp
 * owns four float32 rows of E entries in shared memory:
 *   score[E]   s = softmax(logits) or sigmoid(logits)            (weights)
 *   choice[E]  s + bias, -inf outside the kept groups, NaN once taken (choice)
 *   group[E]   per-group score, then the chosen weights [k]
 *   aux[E]     per-group keep flag, then the chosen ids [k]
 * Lanes stride over experts (e = lane + 32 i); selections are warp-wide
 * arg-max reductions in which ties go to the lower index. All math is float32
 * with expf/erff-accurate functions, so ids match a float64 reference except
 * at near-ties.
 *
 * Launcher guarantees: M >= 1, 1 <= k <= E, E % num_expert_group == 0 when
 * grouped, enough shared memory for the block (else MX_ERR_NOT_IMPLEMENTED). */
#include "common.cuh"

#include <math.h>

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxSharedBytes = 48 * 1024; /* no opt-in needed below this */

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

__global__ void __launch_bounds__(kWarpsPerBlock * 32) route_kernel(const mx_routing_problem p, int warps)
{
    extern __shared__ float route_smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp;
    if (warp >= warps || t >= p.num_tokens)
        return; /* whole warps leave; nothing below synchronizes the block */

    const int E = static_cast<int>(p.num_experts);
    const int k = p.top_k;
    float *score = route_smem + static_cast<size_t>(warp) * 4 * E;
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
}

int float_dtype(mx_dtype dt) { return dt == MX_F32 || dt == MX_F16 || dt == MX_BF16; }

} /* namespace */

extern "C" mx_status mx_cuda_route(const mx_routing_problem *p, void *stream)
{
    if (p->num_tokens == 0)
        return mx_status_ok();
    if (p->num_tokens < 0 || p->num_experts < 1 || p->top_k < 1 || p->top_k > p->num_experts)
        return mx_status_fail(MX_ERR_VALUE, "route: need M >= 0 and 1 <= top_k <= E (M=%lld, E=%lld, k=%d)",
                              (long long)p->num_tokens, (long long)p->num_experts, p->top_k);
    if (p->num_expert_group < 0 ||
        (p->num_expert_group > 0 &&
         (p->num_experts % p->num_expert_group != 0 || p->topk_group < 1 ||
          p->topk_group > p->num_expert_group)))
        return mx_status_fail(MX_ERR_VALUE,
                              "route: num_expert_group=%d must divide E=%lld and 1 <= topk_group=%d <= groups",
                              p->num_expert_group, (long long)p->num_experts, p->topk_group);
    if (!float_dtype(p->logits_dtype))
        return mx_status_fail(MX_ERR_TYPE, "route: router_logits dtype %s is not float32/float16/bfloat16",
                              mx_dtype_name(p->logits_dtype));
    if (p->correction_bias && !float_dtype(p->bias_dtype))
        return mx_status_fail(MX_ERR_TYPE, "route: correction_bias dtype %s is not float32/float16/bfloat16",
                              mx_dtype_name(p->bias_dtype));
    if (!p->router_logits || !p->topk_weights || !p->topk_ids)
        return mx_status_fail(MX_ERR_VALUE, "route: router_logits, topk_weights and topk_ids must be given");

    const size_t per_warp = 4 * sizeof(float) * static_cast<size_t>(p->num_experts);
    int warps = static_cast<int>(kMaxSharedBytes / per_warp);
    if (warps < 1)
        return mx_status_fail(MX_ERR_NOT_IMPLEMENTED, "route: E=%lld experts exceed the shared-memory limit (%d)",
                              (long long)p->num_experts, kMaxSharedBytes / (4 * (int)sizeof(float)));
    if (warps > kWarpsPerBlock)
        warps = kWarpsPerBlock;
    const int64_t blocks = mx_ceil_div(p->num_tokens, warps);
    if (blocks > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "route: M=%lld is too large", (long long)p->num_tokens);
    route_kernel<<<static_cast<unsigned>(blocks), warps * 32, per_warp * warps,
                   static_cast<cudaStream_t>(stream)>>>(*p, warps);
    return mx_check_launch("route_kernel");
}
