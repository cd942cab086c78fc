/* The moe_align step as its own launch (one block; moe_align.cuh describes
 * the method and its outputs). */
#include "experts.cuh"
#include "moe_align.cuh"

namespace {

__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int32_t *__restrict__ topk_ids, const int32_t *__restrict__ expert_map,
                     int64_t pairs, int64_t global_experts, int64_t local_experts, int block_m,
                     int use_shared, int32_t *counts_ws, int32_t *cursor_ws, int32_t *__restrict__ sorted_ids,
                     int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles)
{
    extern __shared__ int32_t align_smem[];
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    moe_align_block(topk_ids, expert_map, pairs, global_experts, local_experts, block_m, use_shared, align_smem,
                    counts_ws, cursor_ws, sorted_ids, tile_expert, num_tiles);
}

} /* namespace */

extern "C" mx_status mx_cuda_moe_align(const int32_t *topk_ids, const int32_t *expert_map, int64_t pairs,
                                       int64_t global_experts, int64_t local_experts, int block_m,
                                       int32_t *counts, int32_t *cursor, int32_t *sorted_ids,
                                       int32_t *tile_expert, int32_t *num_tiles, cudaStream_t stream)
{
    const size_t shared = moe_align_counter_bytes(local_experts);
    return mx_check_call(mx_launch_after(moe_align_kernel, dim3(1), dim3(kAlignThreads), shared, stream, topk_ids,
                                         expert_map, pairs, global_experts, local_experts, block_m, shared > 0, counts,
                                         cursor, sorted_ids, tile_expert, num_tiles),
                         "moe_align_kernel");
}
