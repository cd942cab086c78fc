/* The first stage of the expert pipelines: routing (when the engine routes,
 * mx_experts_problem.routing) and the sort of the (token, slot) pairs by
 * expert (moe_align.cuh).
 *
 * At decode both are tiny and each launch costs more than its work, so up
 * to kFusedMaxTokens tokens they run as one kernel of one block of one warp
 * per token: warp t routes token t (route_token.cuh), the block
 * synchronizes once, and warp 0 sorts (moe_align_warp, reading the ids just
 * written). Past 128 experts, where route_token_split.cuh gives the same
 * bits and kFusedMaxWarps / (E / 32) tokens fit, E / 32 warps route each
 * token (route_align_split_kernel). Larger M: the two launches (route_kernel
 * over many blocks, then moe_align_kernel).
 *
 * Shared memory of the fused kernel: M x 4 x E floats of routing rows, then
 * moe_align's 2 x E_local counters, then a copy of the M x k ids, which the
 * sort reads instead of global memory. Over 48 KB it opts in once per device
 * (E = 256, M = 16: 65 KB); past kFusedMaxSmem the two launches run. */
#include "experts.cuh"
#include "moe_align.cuh"
#include "route_token.cuh"
#include "route_token_split.cuh"

namespace {

constexpr int kFusedMaxWarps = 32; /* the fused kernels' block */
/* A warp per token up to 16 tokens: at 32 the two launches were faster where
 * the one warp's sort has many pairs (qwen3moe, E = 128, k = 8, M = 32: 256
 * pairs, -0.6 / -1.1 / -0.8% bf16 / fp8_tensor / fp8_block forwards) and
 * the same at Mixtral and gpt-oss; at 16 the same either way (H200,
 * 2026-11-27, logs/2026-11-27-nvidia-h200-ab-route-align-16-tokens.txt). */
constexpr int kFusedMaxTokens = 16;
constexpr size_t kFusedMaxSmem = 160 * 1024;
constexpr int kSplitRouting = -1; /* route_align_body's EPL for route_token_split: E / 32 warps a token */

/* The fused kernel's body: EPL = route_experts_per_lane(E) (a warp per
 * token), or kSplitRouting (E / 32 warps per token); then warp 0 sorts. */
template <int EPL>
__device__ __forceinline__ void route_align_body(const mx_routing_problem &r, const int32_t *__restrict__ expert_map,
                                                 int64_t local_experts, int block_m, int32_t *__restrict__ sorted_ids,
                                                 int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles,
                                                 int32_t *__restrict__ pair_rows)
{
    extern __shared__ float route_align_smem[];
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    const size_t rows = 4 * static_cast<size_t>(r.num_experts);
    int32_t *counters = reinterpret_cast<int32_t *>(route_align_smem + r.num_tokens * rows);
    int32_t *ids = counters + 2 * local_experts; /* the sort reads the ids from here */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if constexpr (EPL == kSplitRouting) {
        const int W = static_cast<int>(r.num_experts / 32);
        route_token_split(r, warp / W, route_align_smem + (warp / W) * rows, warp % W, lane, ids);
    } else {
        route_token<EPL>(r, warp, route_align_smem + warp * rows, lane, ids);
    }
    __syncthreads(); /* the ids in shared memory are complete */
    if (warp == 0)
        moe_align_warp(ids, expert_map, r.num_tokens * r.top_k, r.num_experts, local_experts, block_m, counters,
                       sorted_ids, tile_expert, num_tiles, pair_rows);
}

template <int EPL>
__global__ void __launch_bounds__(32 * kFusedMaxWarps, 1)
    route_align_kernel(const mx_routing_problem r, const int32_t *__restrict__ expert_map, int64_t local_experts,
                       int block_m, int32_t *__restrict__ sorted_ids, int32_t *__restrict__ tile_expert,
                       int32_t *__restrict__ num_tiles, int32_t *__restrict__ pair_rows)
{
    route_align_body<EPL>(r, expert_map, local_experts, block_m, sorted_ids, tile_expert, num_tiles, pair_rows);
}

__global__ void __launch_bounds__(32 * kFusedMaxWarps, 1)
    route_align_split_kernel(const mx_routing_problem r, const int32_t *__restrict__ expert_map,
                             int64_t local_experts, int block_m, int32_t *__restrict__ sorted_ids,
                             int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles,
                             int32_t *__restrict__ pair_rows)
{
    route_align_body<kSplitRouting>(r, expert_map, local_experts, block_m, sorted_ids, tile_expert, num_tiles,
                                    pair_rows);
}

/* Launches one fused kernel (its shared-memory opt-in kept per kernel). */
template <auto Kernel>
mx_status launch_fused(const mx_experts_problem *p, int block_m, unsigned threads, size_t smem, int32_t *sorted_ids,
                       int32_t *tile_expert, int32_t *num_tiles, int32_t *pair_rows, cudaStream_t stream)
{
    static std::atomic<unsigned long long> configured{0};
    if (smem > 48 * 1024) {
        const mx_status st = mx_opt_in_smem(Kernel, kFusedMaxSmem, configured, "route_align_kernel");
        if (st.code != MX_OK)
            return st;
    }
    return mx_check_call(mx_launch_after(Kernel, dim3(1), dim3(threads), smem, stream, *p->routing, p->expert_map,
                                         p->num_local_experts, block_m, sorted_ids, tile_expert, num_tiles, pair_rows),
                         "route_align_kernel");
}

} /* namespace */

extern "C" mx_status mx_cuda_route_and_align(const mx_experts_problem *p, int block_m, int32_t *align_ws,
                                             int32_t *sorted_ids, int32_t *tile_expert, int32_t *num_tiles,
                                             int32_t *pair_rows, cudaStream_t stream)
{
    const int64_t pairs = p->num_tokens * p->top_k;
    const mx_routing_problem *r = p->routing;
    if (r) {
        mx_status st;
        if (route_check(r, &st))
            return st;
        if (r->num_tokens != p->num_tokens || r->top_k != p->top_k || r->num_experts != p->global_num_experts ||
            r->topk_ids != p->topk_ids || r->topk_weights != p->topk_weights)
            return mx_status_fail(MX_ERR_VALUE, "route_and_align: the routing problem does not match the experts' "
                                  "(M, top_k, E, outputs)");
        const size_t smem = route_warp_bytes(r->num_experts) * static_cast<size_t>(r->num_tokens) +
                            sizeof(int32_t) * static_cast<size_t>(2 * p->num_local_experts + pairs);
        if (smem <= kFusedMaxSmem) {
            /* more than 4 experts per lane: E / 32 warps per token where the arithmetic allows */
            const int64_t warps_per_token = r->num_experts / 32;
            if (r->num_experts > 128 && route_split_usable(r) && warps_per_token * r->num_tokens <= kFusedMaxWarps)
                return launch_fused<route_align_split_kernel>(p, block_m,
                                                              static_cast<unsigned>(32 * warps_per_token * r->num_tokens),
                                                              smem, sorted_ids, tile_expert, num_tiles, pair_rows,
                                                              stream);
            if (r->num_tokens <= kFusedMaxTokens)
                return route_pick_experts_per_lane(r->num_experts, [&](auto epl) {
                    return launch_fused<route_align_kernel<decltype(epl)::value>>(
                        p, block_m, static_cast<unsigned>(32 * r->num_tokens), smem, sorted_ids, tile_expert,
                        num_tiles, pair_rows, stream);
                });
        }
        st = mx_cuda_route(r, stream);
        if (st.code != MX_OK)
            return st;
    }
    return mx_cuda_moe_align(p->topk_ids, p->expert_map, pairs, p->global_num_experts, p->num_local_experts, block_m,
                             align_ws, sorted_ids, tile_expert, num_tiles, pair_rows, stream);
}
