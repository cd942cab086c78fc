/* Top-k routing on the GPU (numerics.md "Routing").
 *
 * Operands: router_logits [M, E] row-major in float32/float16/bfloat16;
 * correction_bias [E] (optional, same dtype set); outputs topk_weights
 * float32 [M, k] and topk_ids int32 [M, k], slot j holding the j-th best
 * expert.
 *
 * Tiling: each token owns four float32 rows of E entries in shared memory:
 *   score[E]   s = softmax(logits) or sigmoid(logits)            (weights)
 *   choice[E]  s + bias, -inf outside the kept groups, NaN once taken (choice)
 *   group[E]   per-group score, then the chosen weights [k]
 *   aux[E]     per-group keep flag, then the chosen ids [k]
 * One warp routes one token (kWarpsPerBlock tokens per block), lanes
 * striding over experts (e = lane + 32 i): scores, then the top k in k
 * arg-max rounds, ties to the lower index. Up to 256 experts the rows stay in
 * registers and only the group step and the chosen slots touch shared memory
 * (route_token.cuh). All math is float32 with expf-accurate functions, so
 * ids match a float64 reference except at near-ties.
 *
 * Launcher guarantees: M >= 1, 1 <= k <= E, E % num_expert_group == 0 when
 * grouped, enough shared memory for a warp (else MX_ERR_NOT_IMPLEMENTED). */
#include "route_token.cuh"

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxSharedBytes = 48 * 1024; /* no opt-in needed below this */

/* `warps` tokens per block, one per warp; EPL: route_experts_per_lane(E). */
template <int EPL>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) route_kernel(const mx_routing_problem p, int warps)
{
    extern __shared__ float route_smem[];
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp;
    if (warp >= warps || t >= p.num_tokens)
        return; /* whole warps leave; nothing below synchronizes the block */
    route_token<EPL>(p, t, route_smem + static_cast<size_t>(warp) * 4 * p.num_experts, lane, nullptr);
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
    if (per_warp > kMaxSharedBytes)
        return mx_status_fail(MX_ERR_NOT_IMPLEMENTED, "route: E=%lld experts exceed the shared-memory limit (%d)",
                              (long long)p->num_experts, kMaxSharedBytes / (4 * (int)sizeof(float)));
    if (p->num_tokens > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "route: M=%lld is too large", (long long)p->num_tokens);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    int warps = static_cast<int>(kMaxSharedBytes / per_warp);
    if (warps > kWarpsPerBlock)
        warps = kWarpsPerBlock;
    const int64_t blocks = mx_ceil_div(p->num_tokens, warps);
    const auto kernel =
        route_pick_experts_per_lane(p->num_experts, [](auto epl) { return &route_kernel<decltype(epl)::value>; });
    return mx_check_call(mx_launch_after(kernel, dim3(static_cast<unsigned>(blocks)), dim3(warps * 32),
                                         per_warp * warps, s, *p, warps),
                         "route_kernel");
}
