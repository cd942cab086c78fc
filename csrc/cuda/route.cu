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
#include "route_token.cuh"

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxSharedBytes = 48 * 1024; /* no opt-in needed below this */

__global__ void __launch_bounds__(kWarpsPerBlock * 32) route_kernel(const mx_routing_problem p, int warps)
{
    extern __shared__ float route_smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp;
    if (warp >= warps || t >= p.num_tokens)
        return; /* whole warps leave; nothing below synchronizes the block */
    route_token(p, t, route_smem + static_cast<size_t>(warp) * 4 * p.num_experts, lane);
}

} /* namespace */

extern "C" mx_status mx_cuda_route(const mx_routing_problem *p, void *stream)
{
    if (p->num_tokens == 0)
        return mx_status_ok();
    mx_status st;
    if (route_check(p, &st))
        return st;
    const size_t per_warp = route_warp_bytes(p->num_experts);
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
