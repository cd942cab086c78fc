/* The moe_align step as its own launch (moe_align.cuh describes the method
 * and its outputs).
 *
 * Up to kSplitPairs pairs one block sorts them all (moe_align_kernel). One
 * block reads the ids at a few loads in flight per thread, so past that the
 * pairs are cut into chunks of kChunkPairs, one block each, in three
 * launches (H200, shares of the forward in us, one block / split, since
 * the padding rows are filled a warp per expert: 4096 pairs 7.9 / 7.2
 * (qwen3moe, gpt-oss) and 9.0 / 8.6 (DeepSeek-V3), 2048 pairs 5.7 / 6.8,
 * logs/2026-11-26-nvidia-h200-ab-sort-split-point.txt):
 * moe_align_count_kernel (each chunk's per-expert counts into
 * block_counts [chunks, E_local] of the workspace), moe_align_scan_kernel
 * (one block: expert totals, the segments as moe_align_block's phase 2,
 * then block_counts becomes each chunk's first row per expert, then the
 * padding rows a warp per expert), and
 * moe_align_scatter_kernel (each chunk scatters from its own cursors).
 * Within an expert's segment the pairs come chunk by chunk. The counters of
 * the split path live in shared memory (E_local ints per block). */
#include "experts.cuh"
#include "moe_align.cuh"

namespace {

constexpr int64_t kSplitPairs = 2048;
constexpr int64_t kChunkPairs = 1024;
constexpr int kMaxChunks = 128;
constexpr int kChunkThreads = 256;

__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int32_t *__restrict__ topk_ids, const int32_t *__restrict__ expert_map,
                     int64_t pairs, int64_t global_experts, int64_t local_experts, int block_m,
                     int use_shared, int32_t *counts_ws, int32_t *cursor_ws, int32_t *__restrict__ sorted_ids,
                     int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles,
                     int32_t *__restrict__ pair_rows)
{
    extern __shared__ int32_t align_smem[];
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    moe_align_block(topk_ids, expert_map, pairs, global_experts, local_experts, block_m, use_shared, align_smem,
                    counts_ws, cursor_ws, sorted_ids, tile_expert, num_tiles, pair_rows);
}

__global__ void __launch_bounds__(kChunkThreads)
    moe_align_count_kernel(const int32_t *__restrict__ topk_ids, const int32_t *__restrict__ expert_map,
                           int64_t pairs, int64_t chunk, int64_t global_experts, int64_t local_experts,
                           int32_t *__restrict__ block_counts)
{
    extern __shared__ int32_t chunk_counts[];
    const int E = static_cast<int>(local_experts);
    for (int e = threadIdx.x; e < E; e += kChunkThreads)
        chunk_counts[e] = 0;
    __syncthreads();
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    const int64_t begin = blockIdx.x * chunk, end = begin + chunk < pairs ? begin + chunk : pairs;
    for (int64_t p = begin + threadIdx.x; p < end; p += kChunkThreads) {
        const int e = mx_local_expert(topk_ids, expert_map, p, global_experts, local_experts);
        if (e >= 0)
            atomicAdd(&chunk_counts[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kChunkThreads)
        block_counts[blockIdx.x * local_experts + e] = chunk_counts[e];
}

__global__ void __launch_bounds__(kAlignThreads)
    moe_align_scan_kernel(int chunks, int64_t local_experts, int block_m, int32_t *__restrict__ block_counts,
                          int32_t *__restrict__ sorted_ids, int32_t *__restrict__ tile_expert,
                          int32_t *__restrict__ num_tiles)
{
    extern __shared__ int32_t align_smem[];
    const int E = static_cast<int>(local_experts);
    int32_t *counts = align_smem, *start = align_smem + E;
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    for (int e = threadIdx.x; e < E; e += kAlignThreads) {
        int total = 0;
        for (int b = 0; b < chunks; ++b)
            total += block_counts[b * local_experts + e];
        counts[e] = total;
    }
    __syncthreads();
    moe_align_segments(counts, E, block_m, start, tile_expert, num_tiles);
    for (int e = threadIdx.x; e < E; e += kAlignThreads) {
        int row = start[e];
        for (int b = 0; b < chunks; ++b) {
            const int c = block_counts[b * local_experts + e];
            block_counts[b * local_experts + e] = row;
            row += c;
        }
        counts[e] = row; /* the end of the expert's count rows */
    }
    __syncthreads();
    moe_align_fill_padding(counts, E, block_m, sorted_ids);
}

__global__ void __launch_bounds__(kChunkThreads)
    moe_align_scatter_kernel(const int32_t *__restrict__ topk_ids, const int32_t *__restrict__ expert_map,
                             int64_t pairs, int64_t chunk, int64_t global_experts, int64_t local_experts,
                             const int32_t *__restrict__ block_rows, int32_t *__restrict__ sorted_ids,
                             int32_t *__restrict__ pair_rows)
{
    extern __shared__ int32_t chunk_cursor[];
    const int E = static_cast<int>(local_experts);
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    for (int e = threadIdx.x; e < E; e += kChunkThreads)
        chunk_cursor[e] = block_rows[blockIdx.x * local_experts + e];
    __syncthreads();
    const int64_t begin = blockIdx.x * chunk, end = begin + chunk < pairs ? begin + chunk : pairs;
    for (int64_t p = begin + threadIdx.x; p < end; p += kChunkThreads)
        moe_align_place(mx_local_expert(topk_ids, expert_map, p, global_experts, local_experts), chunk_cursor, p,
                        sorted_ids, pair_rows);
}

/* Chunks of the split path for `pairs` pairs, or 0 for the one-block sort. */
int split_chunks(int64_t pairs, int64_t local_experts)
{
    if (pairs <= kSplitPairs || moe_align_counter_bytes(local_experts) == 0)
        return 0;
    const int64_t chunks = mx_ceil_div(pairs, kChunkPairs);
    return static_cast<int>(chunks < kMaxChunks ? chunks : kMaxChunks);
}

} /* namespace */

extern "C" size_t mx_moe_align_workspace_bytes(int64_t pairs, int64_t local_experts)
{
    const int chunks = split_chunks(pairs, local_experts);
    return sizeof(int32_t) * static_cast<size_t>(local_experts) * (chunks > 2 ? chunks : 2);
}

extern "C" mx_status mx_cuda_moe_align(const int32_t *topk_ids, const int32_t *expert_map, int64_t pairs,
                                       int64_t global_experts, int64_t local_experts, int block_m,
                                       int32_t *align_ws, int32_t *sorted_ids, int32_t *tile_expert,
                                       int32_t *num_tiles, int32_t *pair_rows, cudaStream_t stream)
{
    const size_t shared = moe_align_counter_bytes(local_experts);
    const int chunks = split_chunks(pairs, local_experts);
    if (!chunks)
        return mx_check_call(mx_launch_after(moe_align_kernel, dim3(1), dim3(kAlignThreads), shared, stream, topk_ids,
                                             expert_map, pairs, global_experts, local_experts, block_m, shared > 0,
                                             align_ws, align_ws + local_experts, sorted_ids, tile_expert, num_tiles,
                                             pair_rows),
                             "moe_align_kernel");
    const int64_t chunk = mx_ceil_div(pairs, chunks);
    mx_status st = mx_check_call(mx_launch_after(moe_align_count_kernel, dim3(chunks), dim3(kChunkThreads), shared / 2,
                                                 stream, topk_ids, expert_map, pairs, chunk, global_experts,
                                                 local_experts, align_ws),
                                 "moe_align_count_kernel");
    if (st.code == MX_OK)
        st = mx_check_call(mx_launch_after(moe_align_scan_kernel, dim3(1), dim3(kAlignThreads), shared, stream, chunks,
                                           local_experts, block_m, align_ws, sorted_ids, tile_expert, num_tiles),
                           "moe_align_scan_kernel");
    if (st.code == MX_OK)
        st = mx_check_call(mx_launch_after(moe_align_scatter_kernel, dim3(chunks), dim3(kChunkThreads), shared / 2,
                                           stream, topk_ids, expert_map, pairs, chunk, global_experts, local_experts,
                                           align_ws, sorted_ids, pair_rows),
                           "moe_align_scatter_kernel");
    return st;
}
