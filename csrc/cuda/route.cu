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
 * One warp computes the scores, lanes striding over experts (e = lane +
 * 32 i). Up to 32 experts the same warp selects the top k in k arg-max
 * rounds (kWarpsPerBlock tokens per block); beyond, a block of E threads
 * (rounded to warps) per token ranks every expert in one pass: expert e's
 * slot is the number of experts ahead of it (route_token.cuh; on an H200 a
 * token of E = 128, k = 8 took ~7 us in rounds, ~4 us more than E = 8, k = 2).
 * Either way ties go to the lower index and the slots are the same. All math
 * is float32 with expf/erff-accurate functions, so ids match a float64
 * reference except at near-ties.
 *
 * Launcher guarantees: M >= 1, 1 <= k <= E, E % num_expert_group == 0 when
 * grouped, enough shared memory for the block (else MX_ERR_NOT_IMPLEMENTED). */
#include "route_token.cuh"

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxSharedBytes = 48 * 1024; /* no opt-in needed below this */

/* group_threads > 0: one token per block of that many threads
 * (route_token_by_group); else `warps` tokens per block, one per warp. */
__global__ void __launch_bounds__(1024) route_kernel(const mx_routing_problem p, int warps, int group_threads)
{
    extern __shared__ float route_smem[];
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    if (group_threads) {
        route_token_by_group(p, blockIdx.x, route_smem, threadIdx.x, group_threads, true, nullptr);
        return;
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp;
    if (warp >= warps || t >= p.num_tokens)
        return; /* whole warps leave; nothing below synchronizes the block */
    route_token(p, t, route_smem + static_cast<size_t>(warp) * 4 * p.num_experts, lane, nullptr);
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
    /* more than one warp of experts: a block per token ranks them in one pass */
    const int group = p->num_experts > 32 ? route_group_threads(p->num_experts) : 0;
    if (group)
        return mx_check_call(mx_launch_after(route_kernel, dim3(static_cast<unsigned>(p->num_tokens)), dim3(group),
                                             per_warp, s, *p, 1, group),
                             "route_kernel");
    int warps = static_cast<int>(kMaxSharedBytes / per_warp);
    if (warps > kWarpsPerBlock)
        warps = kWarpsPerBlock;
    const int64_t blocks = mx_ceil_div(p->num_tokens, warps);
    return mx_check_call(mx_launch_after(route_kernel, dim3(static_cast<unsigned>(blocks)), dim3(warps * 32),
                                         per_warp * warps, s, *p, warps, 0),
                         "route_kernel");
}
