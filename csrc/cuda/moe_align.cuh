/* Sorting (token, slot) pairs by local expert: the "moe_align" step, as a
 * block-wide device function (moe_align.cu launches it alone, route_align.cu
 * after routing in the same block).
 *
 * Input: topk_ids int32 [M, k] (global ids), expert_map int32 [E_global] or
 * NULL. A pair p = t * k + j is routed to local expert e = expert_map[id]
 * (or id); ids outside [0, E_global) and map entries outside [0, E_local)
 * contribute nothing and are never used as an index.
 *
 * Output (all in the caller's workspace):
 *   sorted_ids  int32 [rows_max]: expert e's pairs occupy rows
 *               [start_e, start_e + count_e), then -1 up to the next multiple
 *               of block_m; experts in increasing order, without gaps.
 *               Within a segment the order follows integer atomics; it does
 *               not change any result bit (GEMM rows are independent).
 *   tile_expert int32 [tiles_max]: the expert of each block_m-row tile.
 *   num_tiles   int32 [2]: [0] tiles in use. Rows and tiles past it are
 *               untouched; the GEMM grids are sized from the worst case and
 *               read it. [1] zeroed: the counter the persistent Hopper GEMMs
 *               deal their work units from (sm90_units.cuh), so that every
 *               forward, graph replays included, starts it at zero.
 *   pair_rows   int32 [M k] or NULL: pair p's row in sorted_ids, -1 for a
 *               pair without a local expert (the FP8 x quantizer writes
 *               GEMM1's A rows there: fp8.cuh mx_fp8_row_filter.dest_rows).
 *
 * One block of 1024 threads does everything in three phases separated by
 * __syncthreads (count, prefix sum over the padded counts, scatter), then
 * fills the padding rows a warp per expert, so no memset and no second
 * launch is needed. moe_align_warp runs the same three
 * phases in one warp, for the few pairs of decode (route_align.cu), where
 * the block's barriers cost more than the work. Counters live in shared memory when
 * 2 * E_local ints fit in 48 KB, else in the workspace (counts, cursor); the
 * kernel zeroes them itself. The single block reads topk_ids twice: a few
 * microseconds up to ~10^5 pairs. */
#ifndef MOE_EXT_CUDA_MOE_ALIGN_CUH
#define MOE_EXT_CUDA_MOE_ALIGN_CUH

#include "common.cuh"

namespace {

constexpr int kAlignThreads = 1024;
constexpr int kAlignSharedBytes = 48 * 1024;

/* Shared-memory bytes of moe_align's counters (2 * E_local ints), or 0
 * when they do not fit and live in the workspace. */
inline size_t moe_align_counter_bytes(int64_t local_experts)
{
    const size_t bytes = 2 * sizeof(int32_t) * static_cast<size_t>(local_experts);
    return bytes <= kAlignSharedBytes ? bytes : 0;
}

/* Inclusive prefix sum over the warp (lane = threadIdx.x & 31). */
__device__ __forceinline__ int warp_inclusive_scan(int v)
{
    const int lane = threadIdx.x & 31;
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off)
            v += o;
    }
    return v;
}

/* Inclusive prefix sum over the block; all threads get their own value. */
__device__ __forceinline__ int block_inclusive_scan(int v, int *warp_totals)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_inclusive_scan(v);
    if (lane == 31)
        warp_totals[warp] = v;
    __syncthreads();
    if (warp == 0) /* kAlignThreads / 32 == 32 warps */
        warp_totals[lane] = warp_inclusive_scan(warp_totals[lane]);
    __syncthreads();
    return v + (warp > 0 ? warp_totals[warp - 1] : 0);
}

/* The scatter of pair p, of local expert e (-1: none): the next row of
 * e's segment (cursor[e], a shared or global counter) gets p, and
 * pair_rows[p], when given, that row (or -1). */
__device__ __forceinline__ void moe_align_place(int e, int32_t *cursor, int64_t p, int32_t *__restrict__ sorted_ids,
                                                int32_t *__restrict__ pair_rows)
{
    const int32_t row = e >= 0 ? atomicAdd(&cursor[e], 1) : -1;
    if (e >= 0)
        sorted_ids[row] = static_cast<int32_t>(p);
    if (pair_rows)
        pair_rows[p] = row;
}

/* Expert e's segment of `tiles` tiles from first_tile: its first row goes
 * to start[e], its tiles into the tile table. */
__device__ __forceinline__ void moe_align_segment_head(int e, int tiles, int first_tile, int block_m, int32_t *start,
                                                       int32_t *__restrict__ tile_expert)
{
    start[e] = first_tile * block_m;
    for (int i = 0; i < tiles; ++i)
        tile_expert[first_tile + i] = e;
}

/* -1 into the padding rows of every expert's segment, a warp per expert so
 * that each store writes up to 32 consecutive rows: expert e's count rows
 * end at seg_end[e] and its padding runs to the next multiple of block_m
 * (none for an empty expert, whose segment starts and ends on one). Every
 * thread of the block calls it after seg_end is complete. */
__device__ __forceinline__ void moe_align_fill_padding(const int32_t *seg_end, int E, int block_m,
                                                       int32_t *__restrict__ sorted_ids)
{
    const int lane = threadIdx.x & 31;
    for (int e = threadIdx.x >> 5; e < E; e += kAlignThreads / 32) {
        const int end = seg_end[e];
        const int padded = (end + block_m - 1) / block_m * block_m;
        for (int r = end + lane; r < padded; r += 32)
            sorted_ids[r] = -1;
    }
}

/* Phase 2 of the sort by the whole block of kAlignThreads threads: from
 * counts[E] (complete), expert e's segment starts at start[e] (a multiple of
 * block_m, experts in order without gaps); writes the tile table and
 * num_tiles[0, 1] (the padding rows: moe_align_fill_padding). Every thread calls
 * it; start may alias nothing else, and is complete when it returns. */
__device__ __forceinline__ void moe_align_segments(const int32_t *counts, int E, int block_m, int32_t *start,
                                                   int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles)
{
    __shared__ int warp_totals[32];
    __shared__ int carry;
    const int tid = threadIdx.x;
    if (tid == 0)
        carry = 0;
    __syncthreads();
    for (int base = 0; base < E; base += kAlignThreads) {
        const int e = base + tid;
        const int count = e < E ? counts[e] : 0;
        const int tiles = (count + block_m - 1) / block_m;
        const int incl = block_inclusive_scan(tiles, warp_totals);
        if (e < E)
            moe_align_segment_head(e, tiles, carry + incl - tiles, block_m, start, tile_expert);
        __syncthreads(); /* everyone has read carry and warp_totals */
        if (tid == kAlignThreads - 1)
            carry += incl;
        __syncthreads();
    }
    if (tid == 0) {
        num_tiles[0] = carry;
        num_tiles[1] = 0;
    }
}

/* The whole sort by one block of kAlignThreads threads. align_smem: 2 * E
 * ints of shared memory when use_shared. topk_ids may be global or shared
 * memory (route_align.cu passes its copy, written earlier in the kernel). */
__device__ __forceinline__ void moe_align_block(const int32_t *topk_ids, const int32_t *__restrict__ expert_map,
                                                int64_t pairs, int64_t global_experts, int64_t local_experts,
                                                int block_m, int use_shared, int32_t *align_smem, int32_t *counts_ws,
                                                int32_t *cursor_ws, int32_t *__restrict__ sorted_ids,
                                                int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles,
                                                int32_t *__restrict__ pair_rows)
{
    const int tid = threadIdx.x;
    const int E = static_cast<int>(local_experts);
    int32_t *counts = use_shared ? align_smem : counts_ws;
    int32_t *cursor = use_shared ? align_smem + E : cursor_ws;

    for (int e = tid; e < E; e += kAlignThreads)
        counts[e] = 0;
    __syncthreads();

    /* phase 1: histogram */
    for (int64_t p = tid; p < pairs; p += kAlignThreads) {
        int e = mx_local_expert(topk_ids, expert_map, p, global_experts, local_experts);
        if (e >= 0)
            atomicAdd(&counts[e], 1);
    }
    __syncthreads();

    /* phase 2: tiles per expert -> tile offsets; cursors, tile table */
    moe_align_segments(counts, E, block_m, cursor, tile_expert, num_tiles);

    /* phase 3: scatter */
    for (int64_t p = tid; p < pairs; p += kAlignThreads)
        moe_align_place(mx_local_expert(topk_ids, expert_map, p, global_experts, local_experts), cursor, p,
                        sorted_ids, pair_rows);
    __syncthreads(); /* each cursor now ends its expert's count rows */
    moe_align_fill_padding(cursor, E, block_m, sorted_ids);
}

/* moe_align_block's sort by one warp (lane = threadIdx.x & 31), with the
 * same outputs; the counters are in shared memory (2 * E ints at
 * align_smem). Experts go 32 at a time through a warp prefix sum; every
 * row in use is set to -1 by the whole warp before the scatter (a lane
 * writing its expert's padding rows one by one was up to block_m - 1
 * dependent stores per 32 experts). */
__device__ __forceinline__ void moe_align_warp(const int32_t *topk_ids, const int32_t *__restrict__ expert_map,
                                               int64_t pairs, int64_t global_experts, int64_t local_experts,
                                               int block_m, int32_t *align_smem, int32_t *__restrict__ sorted_ids,
                                               int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles,
                                               int32_t *__restrict__ pair_rows)
{
    const int lane = threadIdx.x & 31;
    const int E = static_cast<int>(local_experts);
    int32_t *counts = align_smem, *cursor = align_smem + E;
    for (int e = lane; e < E; e += 32)
        counts[e] = 0;
    __syncwarp();
    for (int64_t p = lane; p < pairs; p += 32) {
        const int e = mx_local_expert(topk_ids, expert_map, p, global_experts, local_experts);
        if (e >= 0)
            atomicAdd(&counts[e], 1);
    }
    __syncwarp();
    int carry = 0;
    for (int base = 0; base < E; base += 32) {
        const int e = base + lane;
        const int count = e < E ? counts[e] : 0;
        const int tiles = (count + block_m - 1) / block_m;
        const int incl = warp_inclusive_scan(tiles);
        if (e < E)
            moe_align_segment_head(e, tiles, carry + incl - tiles, block_m, cursor, tile_expert);
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
        num_tiles[0] = carry;
        num_tiles[1] = 0;
    }
    for (int r = lane; r < carry * block_m; r += 32)
        sorted_ids[r] = -1;
    __syncwarp(); /* the fill is ordered before the scatter's stores to the same rows */
    for (int64_t p = lane; p < pairs; p += 32)
        moe_align_place(mx_local_expert(topk_ids, expert_map, p, global_experts, local_experts), cursor, p,
                        sorted_ids, pair_rows);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_MOE_ALIGN_CUH */
