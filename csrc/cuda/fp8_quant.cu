/* FP8 quantizers (numerics.md "FP8"; formulas and NaN rule in fp8.cuh):
 * mx_cuda_fp8_quant (abi.h) and the row quantizers of the FP8 pipelines.
 *
 * Operands: x in float32 / float16 / bfloat16 (converted to float32
 * exactly), q float8_e4m3fn bytes, scales float32; all row-major.
 *
 * mx_cuda_fp8_quant, by mode (no workspace; nothing read back to the host):
 *   PER_TENSOR       x [batch, n] (n = rows * cols), scale [batch]. Unless
 *                    scale_given: scale[] is zeroed (cudaMemsetAsync) and
 *                    used as scratch for the amax bits (atomicMax: the max is
 *                    order-independent, so deterministic); the quantize pass
 *                    derives the scale from those bits; a last launch
 *                    overwrites them with the scale. Grid: (chunks of a
 *                    slice, slices), 256 threads, grid-stride.
 *   PER_BLOCK        x [batch, rows, cols], one CTA per block_rows x
 *                    block_cols block (grid-stride over blocks): amax pass
 *                    and quantize pass over the block (the second from L1 /
 *                    L2), scale [batch, ceil(rows/br), ceil(cols/bc)].
 *   PER_TOKEN_GROUP  x [batch * rows, cols], one warp per (row, group of
 *                    block_cols columns): warp-max, then quantize; scale
 *                    [batch * rows, ceil(cols/bc)].
 * Pipeline row quantizers (declared in fp8.cuh): the same per-tensor and
 * per-group formulas over rows of a strided matrix with a row filter, q rows
 * padded with zeros to ldq; the per-tensor amax in block partials (no reset
 * needed, deterministic) or in an atomic amax written by GEMM1's epilogue.
 * The row quantizers wait for the kernel before them at their top and are
 * launched dependent where the GPU allows (common.cuh mx_launch_after). */
#include <string.h>

#include <type_traits>

#include "common.cuh"
#include "fp8.cuh"

namespace {

constexpr int kQuantThreads = 256;
constexpr int kAmaxParts = 1024; /* blocks (and partial maxima) of the pipeline amax pass */

/* max over the block of v (kQuantThreads threads, or `warps` warps up to
 * 32), returned to every thread; callable repeatedly in one kernel. */
__device__ __forceinline__ float block_max(float v, int warps = kQuantThreads / 32)
{
    __shared__ float warp_max[32];
    v = mx_warp_max(v);
    if ((threadIdx.x & 31) == 0)
        warp_max[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = warp_max[0];
#pragma unroll
    for (int w = 1; w < warps; ++w)
        m = mx_max_nan(m, warp_max[w]);
    __syncthreads(); /* everyone has read warp_max before the next call writes it */
    return m;
}

/* The rows a filtered kernel walks, [0, live_rows): with SORTED rows the
 * tiles' rows, num_tiles x block_m (the launch covers the worst case, mostly
 * padding past them); else all. */
__device__ __forceinline__ int64_t live_rows(const mx_fp8_row_filter &f, int64_t rows)
{
    if (f.mode != MX_FP8_ROWS_SORTED)
        return rows;
    const int64_t tiled = static_cast<int64_t>(*f.num_tiles) * f.block_m;
    return tiled < rows ? tiled : rows;
}

/* Whether row (under live_rows) is quantized. */
__device__ __forceinline__ bool row_valid(const mx_fp8_row_filter &f, int64_t row)
{
    if (f.mode == MX_FP8_ROWS_ROUTED) {
        for (int j = 0; j < f.top_k; ++j)
            if (mx_local_expert(f.topk_ids, f.expert_map, row * f.top_k + j, f.global_experts, f.local_experts) >= 0)
                return true;
        return false;
    }
    return f.mode != MX_FP8_ROWS_SORTED || f.sorted_ids[row] >= 0;
}

/* fn(d) for each q row d that row's values go to: row itself, or with
 * kToSorted the rows f.dest_rows gives it (one per local pair). */
template <bool kToSorted, typename Fn>
__device__ __forceinline__ void for_each_q_row(const mx_fp8_row_filter &f, int64_t row, Fn fn)
{
    if constexpr (kToSorted) {
        for (int j = 0; j < f.top_k; ++j) {
            const int32_t d = f.dest_rows[row * f.top_k + j];
            if (d >= 0)
                fn(static_cast<int64_t>(d));
        }
    } else {
        fn(row);
    }
}

/* A quad (4 consecutive elements) of T as loaded: 8 bytes (16-bit T) or 16 (float). */
template <typename T> using quad_bits = std::conditional_t<sizeof(T) == 4, float4, uint2>;

template <typename T> __device__ __forceinline__ void unpack4(quad_bits<T> raw, float (&v)[4])
{
    const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        v[i] = mx_to_float(e[i]);
}

/* x[0..4) to float32 in one load; x is 4-element aligned. */
template <typename T> __device__ __forceinline__ void load4(const T *x, float (&v)[4])
{
    unpack4<T>(*reinterpret_cast<const quad_bits<T> *>(x), v);
}

/* four fp8 bytes (the first in the low byte) in one 4-byte store (q 4-byte aligned) */
__device__ __forceinline__ void store4(uint8_t *q, uint32_t bytes) { *reinterpret_cast<uint32_t *>(q) = bytes; }

/* fp8(clamp(a..d)), packed as store4 takes them */
__device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d)
{
    return mx_fp8_encode2(a, b) | static_cast<uint32_t>(mx_fp8_encode2(c, d)) << 16;
}

/* fp8(clamp(v * inv)) of four values, packed as store4 takes them */
__device__ __forceinline__ uint32_t encode4_scaled(const float (&v)[4], float inv)
{
    return encode4(__fmul_rn(v[0], inv), __fmul_rn(v[1], inv), __fmul_rn(v[2], inv), __fmul_rn(v[3], inv));
}

/* the same for four values, packed as store4 takes them; one branch on s */
__device__ __forceinline__ uint32_t encode4_divided(const float (&v)[4], float s)
{
    if (isfinite(s)) {
        const float r = mx_fp8_div_recip(s);
        return encode4(mx_fp8_div(v[0], s, r), mx_fp8_div(v[1], s, r), mx_fp8_div(v[2], s, r), mx_fp8_div(v[3], s, r));
    }
    return encode4(__fdiv_rn(v[0], s), __fdiv_rn(v[1], s), __fdiv_rn(v[2], s), __fdiv_rn(v[3], s));
}

/* ---- mx_cuda_fp8_quant: PER_TENSOR ------------------------------------------ */

template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    tensor_amax_kernel(const T *__restrict__ x, int64_t batch, int64_t n, uint32_t *__restrict__ amax_bits)
{
    for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
        const T *xb = x + b * n;
        float m = 0.0f;
        for (int64_t i = blockIdx.x * static_cast<int64_t>(kQuantThreads) + threadIdx.x; i < n;
             i += static_cast<int64_t>(gridDim.x) * kQuantThreads)
            m = mx_amax_step(m, mx_to_float(xb[i]));
        m = block_max(m);
        if (threadIdx.x == 0 && !(m <= 0.0f)) /* > 0 or NaN */
            mx_atomic_amax(amax_bits + b, m);
    }
}

/* scale[b] is the scale itself (scale_given) or the amax bits */
template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    tensor_quant_kernel(const T *__restrict__ x, int64_t batch, int64_t n, const float *__restrict__ scale,
                        int scale_given, uint8_t *__restrict__ q)
{
    for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
        const float s = scale_given ? scale[b] : mx_fp8_tensor_scale(scale[b]);
        const float inv = __fdiv_rn(1.0f, s);
        for (int64_t i = blockIdx.x * static_cast<int64_t>(kQuantThreads) + threadIdx.x; i < n;
             i += static_cast<int64_t>(gridDim.x) * kQuantThreads)
            q[b * n + i] = mx_fp8_encode(__fmul_rn(mx_to_float(x[b * n + i]), inv));
    }
}

__global__ void __launch_bounds__(kQuantThreads) tensor_scale_kernel(float *scale, int64_t batch)
{
    const int64_t b = blockIdx.x * static_cast<int64_t>(kQuantThreads) + threadIdx.x;
    if (b < batch)
        scale[b] = mx_fp8_tensor_scale(scale[b]); /* scale[b] holds the amax (its bits were the atomic's) */
}

/* ---- mx_cuda_fp8_quant: PER_BLOCK ------------------------------------------- */

template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    block_quant_kernel(const T *__restrict__ x, int64_t batch, int64_t rows, int64_t cols, int br, int bc,
                       int ue8m0, uint8_t *__restrict__ q, float *__restrict__ scale)
{
    const int64_t nbr = (rows + br - 1) / br, nbc = (cols + bc - 1) / bc;
    for (int64_t blk = blockIdx.x; blk < batch * nbr * nbc; blk += gridDim.x) {
        const int64_t b = blk / (nbr * nbc), bi = blk / nbc % nbr, bj = blk % nbc;
        const int64_t r0 = bi * br, c0 = bj * bc;
        const int h = static_cast<int>(rows - r0 < br ? rows - r0 : br);
        const int w = static_cast<int>(cols - c0 < bc ? cols - c0 : bc);
        const T *xb = x + (b * rows + r0) * cols + c0;
        uint8_t *qb = q + (b * rows + r0) * cols + c0;
        float m = 0.0f;
        for (int r = 0; r < h; ++r)
            for (int c = threadIdx.x; c < w; c += kQuantThreads)
                m = mx_amax_step(m, mx_to_float(xb[r * cols + c]));
        const float sf = mx_fp8_block_scale(block_max(m), ue8m0);
        const float inv = __fdiv_rn(1.0f, sf);
        for (int r = 0; r < h; ++r)
            for (int c = threadIdx.x; c < w; c += kQuantThreads)
                qb[r * cols + c] = mx_fp8_encode(__fmul_rn(mx_to_float(xb[r * cols + c]), inv));
        if (threadIdx.x == 0)
            scale[blk] = sf;
    }
}

/* ---- per token group (mx_cuda_fp8_quant and the pipelines) ------------------- */

/* grid: x = groups of 8 column groups (one per warp), y = rows (stride) */
template <typename T, bool kToSorted>
__global__ void __launch_bounds__(kQuantThreads)
    group_quant_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, int64_t ldx, int group,
                       const mx_fp8_row_filter f, uint8_t *__restrict__ q, int64_t ldq, float *__restrict__ scales,
                       int64_t scale_ld)
{
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    const int lane = threadIdx.x & 31;
    const int64_t groups = (cols + group - 1) / group;
    const int64_t gi = static_cast<int64_t>(blockIdx.x) * (kQuantThreads / 32) + (threadIdx.x >> 5);
    if (gi >= groups)
        return;
    const int64_t c0 = gi * group, c1 = cols - c0 < group ? cols : c0 + group;
    const int64_t live = live_rows(f, rows);
    for (int64_t row = blockIdx.y; row < live; row += gridDim.y) {
        if (!row_valid(f, row))
            continue;
        const T *xr = x + row * ldx;
        float m = 0.0f;
        for (int64_t c = c0 + lane; c < c1; c += 32)
            m = mx_amax_step(m, mx_to_float(xr[c]));
        const float s = mx_fp8_group_scale(mx_warp_max(m));
        const float r = mx_fp8_div_recip(s);
        for_each_q_row<kToSorted>(f, row, [&](int64_t d) {
            uint8_t *qr = q + d * ldq;
            for (int64_t c = c0 + lane; c < c1; c += 32)
                qr[c] = mx_fp8_encode_divided(mx_to_float(xr[c]), s, r);
            if (gi == groups - 1)
                for (int64_t c = cols + lane; c < ldq; c += 32)
                    qr[c] = 0;
        });
        if (lane == 0)
            scales[row * scale_ld + gi] = s;
    }
}

constexpr int kGroupsPerWarp = 4;
constexpr int kTensorQuads = 8; /* rows_quant_tensor_kernel: quads per lane loaded before any is stored */

/* rows_quant_tensor_kernel's chunks per row of ldq columns, 32 x
 * kTensorQuads quads each. Where the grid has a warp for each chunk of each
 * row in use (decode) a warp takes one chunk, so that a long row (act: I
 * columns) spreads over several warps: one warp walking a row of 14336 took
 * ~10 us (Mixtral's act at decode). The launcher sizes the grid so for up
 * to kTensorQuantUnits (row, chunk) units, else a warp per row as before:
 * prefill quantizers ran 3-9% slower with a warp per chunk (each block
 * reduces the amax partials first; twice the blocks, twice that), 7-9%
 * dividing a unit index per unit, 35-45% striding over rows with a fixed
 * chunk (H200, 2026-11-26, logs/2026-11-26-nvidia-h200-ab-tensor-quant-chunks.txt). */
constexpr int64_t kTensorQuantUnits = 16384;
/* Without partials to reduce (act: its amax is GEMM1's atomic) a warp per
 * chunk pays up to twice as many units. The quantizer's share of Mixtral
 * fp8_tensor forwards, per row against per chunk: M = 256 (21504 units)
 * 24.7 -> 16.4 us, M = 512 (28672) 27.0 -> 22.4; past that per chunk lost:
 * M = 1024 (43008) 35 -> 40, DeepSeek-V3 M = 1024 (40896) 24.7 -> 28.6
 * (H200, 2026-11-26, logs/2026-11-26-nvidia-h200-ab-decode-ring-act-quant.txt). */
constexpr int64_t kTensorQuantUnitsAtomic = 32768;
/* x of at most kOneBlockQuads quads of q (rows x ldq / 4; 4-element
 * aligned rows) and kOneBlockRows rows is quantized per tensor by one block
 * in one launch (rows_quant_tensor_one_block_kernel): each thread holds up
 * to kOneBlockSlots quads of x in registers from one round of loads. Its
 * first form (256 threads walking the amax one load at a time, then a warp
 * per row quantizing after a second read; up to 8192 elements) against the
 * two launches, forwards at M = 1 (fp8_tensor, H200, 2026-11-26,
 * logs/2026-11-26-nvidia-h200-ab-x-quant-one-block.txt): qwen3moe (2048
 * elements) 29.0 -> 27.4 us, Mixtral (4096) 108.0 -> 106.3, DeepSeek-V3
 * (7168) 108.6 -> 106.3; at 16384 (qwen3moe M = 8) 88.7 -> 94.6. This
 * form against the first, two rounds (logs/2026-11-26-nvidia-h200-bench-
 * ab-x-quant-registers.txt): Mixtral M = 1 103.2 -> 101.7 us, DeepSeek-V3
 * 104.7 -> 103.4, qwen3moe M = 1 / 8 -0.5%, Mixtral M = 8 (32768
 * elements, now one block of 1024 threads) -0.4%. */
constexpr int kOneBlockSlots = 8;
constexpr int kOneBlockMaxThreads = 1024;
constexpr int64_t kOneBlockQuads = int64_t(kOneBlockSlots) * kOneBlockMaxThreads;
constexpr int64_t kOneBlockRows = 1024;
__host__ __device__ inline int64_t tensor_quant_chunks(int64_t ldq)
{
    return ldq > 0 ? (ldq / 4 + 32 * kTensorQuads - 1) / (32 * kTensorQuads) : 1;
}

/* group_quant_kernel for groups of 128 columns over 4-element aligned rows
 * (x, q, cols, ldx, ldq): a warp takes a unit of kGroupsPerWarp groups of
 * one row (lane i: columns 4i..4i+3 of each, one load and one store), all
 * loads before the reductions; units grid-stride over (row, chunk of
 * groups). The same bits as group_quant_kernel. */
template <typename T, bool kToSorted>
__global__ void __launch_bounds__(kQuantThreads)
    group_quant_vec4_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                            const mx_fp8_row_filter f, uint8_t *__restrict__ q, int64_t ldq,
                            float *__restrict__ scales, int64_t scale_ld)
{
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    const int lane = threadIdx.x & 31;
    const int64_t groups = (cols + 127) / 128, chunks = (groups + kGroupsPerWarp - 1) / kGroupsPerWarp;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * (kQuantThreads / 32);
    const int64_t units = live_rows(f, rows) * chunks;
    for (int64_t u = static_cast<int64_t>(blockIdx.x) * (kQuantThreads / 32) + (threadIdx.x >> 5); u < units;
         u += warps) {
        const int64_t row = u / chunks, g0 = (u - row * chunks) * kGroupsPerWarp;
        if (!row_valid(f, row))
            continue;
        const T *xr = x + row * ldx;
        float v[kGroupsPerWarp][4], m[kGroupsPerWarp];
#pragma unroll
        for (int i = 0; i < kGroupsPerWarp; ++i) {
            const int64_t c = (g0 + i) * 128 + 4 * lane;
            m[i] = 0.0f;
            if (c < cols) {
                load4(xr + c, v[i]);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    m[i] = mx_amax_step(m[i], v[i][e]);
            }
        }
        uint32_t packed[kGroupsPerWarp]; /* stored below to each q row of the row, one after the other */
#pragma unroll
        for (int i = 0; i < kGroupsPerWarp; ++i) {
            const int64_t c = (g0 + i) * 128 + 4 * lane;
            if (g0 + i >= groups)
                break;
            const float s = mx_fp8_group_scale(mx_warp_max(m[i]));
            if (c < cols)
                packed[i] = encode4_divided(v[i], s);
            if (lane == 0)
                scales[row * scale_ld + g0 + i] = s;
        }
        for_each_q_row<kToSorted>(f, row, [&](int64_t d) {
#pragma unroll
            for (int i = 0; i < kGroupsPerWarp; ++i) {
                const int64_t c = (g0 + i) * 128 + 4 * lane;
                if (g0 + i >= groups)
                    break;
                if (c < cols)
                    store4(q + d * ldq + c, packed[i]);
            }
        });
        if (g0 + kGroupsPerWarp >= groups)
            for_each_q_row<kToSorted>(f, row, [&](int64_t d) {
                for (int64_t pad = cols + 4 * lane; pad < ldq; pad += 128)
                    *reinterpret_cast<uint32_t *>(q + d * ldq + pad) = 0u;
            });
    }
}

/* ---- pipeline per tensor ------------------------------------------------------ */

/* kVec4 (here and in rows_quant_tensor_kernel): 4-element aligned rows (x,
 * q, cols, ldx, ldq); each thread takes 4 consecutive columns at a time. */
template <typename T, bool kVec4>
__global__ void __launch_bounds__(kQuantThreads)
    rows_amax_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, int64_t ldx, const mx_fp8_row_filter f,
                     float *__restrict__ partials, uint32_t *reset)
{
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    constexpr int kStep = kVec4 ? 4 : 1;
    float m = 0.0f;
    const int64_t live = live_rows(f, rows);
    for (int64_t row = blockIdx.x; row < live; row += gridDim.x) {
        if (!row_valid(f, row))
            continue;
        for (int64_t c = kStep * threadIdx.x; c < cols; c += kStep * kQuantThreads) {
            if constexpr (kVec4) {
                float v[4];
                load4(x + row * ldx + c, v);
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    m = mx_amax_step(m, v[i]);
            } else {
                m = mx_amax_step(m, mx_to_float(x[row * ldx + c]));
            }
        }
    }
    m = block_max(m);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = m;
        if (reset && blockIdx.x == 0)
            *reset = 0u;
    }
}

template <typename T, bool kVec4, bool kToSorted>
__global__ void __launch_bounds__(kQuantThreads)
    rows_quant_tensor_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                             const mx_fp8_row_filter f, const float *__restrict__ partials, int parts,
                             const uint32_t *__restrict__ amax_bits, uint8_t *__restrict__ q, int64_t ldq,
                             float *__restrict__ scale)
{
    mx_griddep_enter(f.early_dependents);
    /* the tensor's amax: the partial maxima spread over the whole block (at
     * most kAmaxParts / kQuantThreads loads a thread, all issued together),
     * or the atomic amax */
    float m = 0.0f;
    if (partials) {
        for (int i = threadIdx.x; i < parts; i += kQuantThreads)
            m = mx_max_nan(m, partials[i]);
        m = block_max(m);
    } else {
        m = __uint_as_float(*amax_bits);
    }
    const float s = mx_fp8_tensor_scale(m);
    const float inv = __fdiv_rn(1.0f, s);
    if (threadIdx.x == 0 && blockIdx.x == 0)
        *scale = s;
    if constexpr (kVec4) {
        /* a warp per (row, chunk of 32 x kTensorQuads quads) when every such
         * unit gets its own warp, else a warp per row, walking its chunks
         * (rows striding over the grid's warps); lane l: quads l + 32 i of
         * the chunk */
        const int lane = threadIdx.x & 31;
        const int64_t quads = ldq / 4, chunks = tensor_quant_chunks(ldq);
        const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kQuantThreads / 32) + (threadIdx.x >> 5);
        const int64_t warps = static_cast<int64_t>(gridDim.x) * (kQuantThreads / 32), live = live_rows(f, rows);
        auto chunk = [&](int64_t row, int64_t q0) {
            const T *xr = x + row * ldx;
            float v[kTensorQuads][4];
#pragma unroll
            for (int i = 0; i < kTensorQuads; ++i)
                if (4 * (q0 + 32 * i) < cols)
                    load4(xr + 4 * (q0 + 32 * i), v[i]);
            uint32_t packed[kTensorQuads]; /* stored below to each q row of the row, one after the other */
#pragma unroll
            for (int i = 0; i < kTensorQuads; ++i)
                packed[i] = 4 * (q0 + 32 * i) < cols ? encode4_scaled(v[i], inv) : 0u;
            for_each_q_row<kToSorted>(f, row, [&](int64_t d) {
#pragma unroll
                for (int i = 0; i < kTensorQuads; ++i) {
                    const int64_t c = 4 * (q0 + 32 * i);
                    if (c >= ldq)
                        break;
                    store4(q + d * ldq + c, packed[i]);
                }
            });
        };
        if (live * chunks <= warps) {
            const int64_t row = warp / chunks;
            if (row < live && row_valid(f, row))
                chunk(row, (warp - row * chunks) * (32 * kTensorQuads) + lane);
        } else {
            for (int64_t row = warp; row < live; row += warps) {
                if (!row_valid(f, row))
                    continue;
                for (int64_t q0 = lane; q0 < quads; q0 += 32 * kTensorQuads)
                    chunk(row, q0);
            }
        }
    } else { /* grid: x = rows (stride) */
        const int64_t live = live_rows(f, rows);
        for (int64_t row = blockIdx.x; row < live; row += gridDim.x) {
            if (!row_valid(f, row))
                continue;
            for_each_q_row<kToSorted>(f, row, [&](int64_t d) {
                for (int64_t c = threadIdx.x; c < ldq; c += kQuantThreads)
                    q[d * ldq + c] = c < cols ? mx_fp8_encode(__fmul_rn(mx_to_float(x[row * ldx + c]), inv))
                                              : static_cast<uint8_t>(0);
            });
        }
    }
}

/* rows_amax_kernel + rows_quant_tensor_kernel in one block (decode): the
 * thread's quads g = threadIdx.x + blockDim.x * i of x, flat over rows of
 * ldq / 4 quads (columns past cols: zeros), and the rows' filter flags are
 * all loaded before any is used, so the block waits on one round of
 * memory; then the amax of the valid rows, the scale (and the reset of
 * act's amax), and the quads quantized from registers. The same bits as the
 * two launches. */
template <typename T>
__global__ void __launch_bounds__(kOneBlockMaxThreads)
    rows_quant_tensor_one_block_kernel(const T *__restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                                       const mx_fp8_row_filter f, uint32_t *reset, uint8_t *__restrict__ q,
                                       int64_t ldq, float *__restrict__ scale)
{
    __shared__ unsigned char keep[kOneBlockRows];
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    const unsigned per_row = static_cast<unsigned>(ldq / 4), total = static_cast<unsigned>(rows) * per_row;
    /* slot i: its row << 16 | its quad in the row (rows and quads a row < 2^16), and x's bits */
    unsigned at[kOneBlockSlots];
    quad_bits<T> bits[kOneBlockSlots];
#pragma unroll
    for (int i = 0; i < kOneBlockSlots; ++i) {
        const unsigned g = threadIdx.x + blockDim.x * i, r = g / per_row, c = 4 * (g - r * per_row);
        at[i] = r << 16 | (c / 4);
        if (g < total && c < cols)
            bits[i] = *reinterpret_cast<const quad_bits<T> *>(x + r * ldx + c);
    }
    const int64_t live = live_rows(f, rows);
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
        keep[r] = r < live && row_valid(f, r);
    __syncthreads();
    auto used = [&](int i) { return threadIdx.x + blockDim.x * i < total && keep[at[i] >> 16]; };
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < kOneBlockSlots; ++i) {
        if (used(i) && 4 * (at[i] & 0xffffu) < cols) {
            float v[4];
            unpack4<T>(bits[i], v);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                m = mx_amax_step(m, v[e]);
        }
    }
    const float s = mx_fp8_tensor_scale(block_max(m, static_cast<int>(blockDim.x / 32)));
    const float inv = __fdiv_rn(1.0f, s);
    if (threadIdx.x == 0) {
        *scale = s;
        if (reset)
            *reset = 0u;
    }
#pragma unroll
    for (int i = 0; i < kOneBlockSlots; ++i) {
        if (used(i)) {
            const unsigned c = 4 * (at[i] & 0xffffu);
            float v[4];
            unpack4<T>(bits[i], v);
            store4(q + (at[i] >> 16) * ldq + c, c < cols ? encode4_scaled(v, inv) : 0u);
        }
    }
}

/* ---- dispatch ------------------------------------------------------------------- */

int64_t grid_cap(int64_t want, int64_t cap) { return want < 1 ? 1 : (want < cap ? want : cap); }

mx_fp8_row_filter all_rows()
{
    mx_fp8_row_filter f;
    memset(&f, 0, sizeof f);
    f.mode = MX_FP8_ROWS_ALL;
    return f;
}

template <typename T> mx_status quant_abi(const mx_fp8_quant_problem *p, cudaStream_t stream)
{
    const T *x = static_cast<const T *>(p->x);
    switch (p->mode) {
    case MX_FP8_PER_TENSOR: {
        const int64_t n = p->rows * p->cols;
        const unsigned slices = static_cast<unsigned>(grid_cap(p->batch, 65535));
        /* ~16 elements per thread, at most ~8K blocks in all */
        const unsigned chunks = static_cast<unsigned>(
            grid_cap(mx_ceil_div(n, 16 * kQuantThreads), grid_cap(8192 / static_cast<int64_t>(slices), 8192)));
        const dim3 grid(chunks, slices);
        if (!p->scale_given) {
            mx_status st = mx_check_call(cudaMemsetAsync(p->scale, 0, sizeof(float) * p->batch, stream),
                                         "fp8_quant: cudaMemsetAsync(scale)");
            if (st.code != MX_OK)
                return st;
            if (n > 0) {
                tensor_amax_kernel<T><<<grid, kQuantThreads, 0, stream>>>(x, p->batch, n,
                                                                          reinterpret_cast<uint32_t *>(p->scale));
                st = mx_check_launch("tensor_amax_kernel");
                if (st.code != MX_OK)
                    return st;
            }
        }
        if (n > 0) {
            tensor_quant_kernel<T><<<grid, kQuantThreads, 0, stream>>>(x, p->batch, n, p->scale, p->scale_given, p->q);
            mx_status st = mx_check_launch("tensor_quant_kernel");
            if (st.code != MX_OK)
                return st;
        }
        if (p->scale_given)
            return mx_status_ok();
        tensor_scale_kernel<<<static_cast<unsigned>(mx_ceil_div(p->batch, kQuantThreads)), kQuantThreads, 0, stream>>>(
            p->scale, p->batch);
        return mx_check_launch("tensor_scale_kernel");
    }
    case MX_FP8_PER_BLOCK: {
        const int64_t blocks = p->batch * mx_ceil_div(p->rows, p->block_rows) * mx_ceil_div(p->cols, p->block_cols);
        block_quant_kernel<T><<<static_cast<unsigned>(grid_cap(blocks, 1 << 20)), kQuantThreads, 0, stream>>>(
            x, p->batch, p->rows, p->cols, p->block_rows, p->block_cols, p->use_ue8m0, p->q, p->scale);
        return mx_check_launch("block_quant_kernel");
    }
    case MX_FP8_PER_TOKEN_GROUP: {
        const mx_fp8_row_filter all = all_rows();
        return mx_cuda_fp8_rows_quant_group(x, p->dtype, p->batch * p->rows, p->cols, p->cols, p->block_cols, &all,
                                            p->q, p->cols, p->scale, mx_ceil_div(p->cols, p->block_cols), stream);
    }
    }
    return mx_status_fail(MX_ERR_VALUE, "fp8_quant (CUDA): unknown mode %d", (int)p->mode);
}

} /* namespace */

extern "C" mx_status mx_cuda_fp8_quant(const mx_fp8_quant_problem *p, void *stream_ptr)
{
    if (p->mode != MX_FP8_PER_TENSOR && p->mode != MX_FP8_PER_BLOCK && p->mode != MX_FP8_PER_TOKEN_GROUP)
        return mx_status_fail(MX_ERR_VALUE, "fp8_quant (CUDA): unknown mode %d", (int)p->mode);
    if (p->dtype != MX_F32 && p->dtype != MX_F16 && p->dtype != MX_BF16)
        return mx_status_fail(MX_ERR_TYPE, "fp8_quant (CUDA): x dtype %s; supported: float32, float16, bfloat16",
                              mx_dtype_name(p->dtype));
    if (p->batch < 0 || p->rows < 0 || p->cols < 0)
        return mx_status_fail(MX_ERR_VALUE, "fp8_quant (CUDA): negative size (batch=%lld rows=%lld cols=%lld)",
                              (long long)p->batch, (long long)p->rows, (long long)p->cols);
    if ((p->mode == MX_FP8_PER_BLOCK && (p->block_rows < 1 || p->block_cols < 1)) ||
        (p->mode == MX_FP8_PER_TOKEN_GROUP && p->block_cols < 1))
        return mx_status_fail(MX_ERR_VALUE, "fp8_quant (CUDA): block sizes must be >= 1 (block_rows=%d block_cols=%d)",
                              p->block_rows, p->block_cols);
    const int64_t elements = p->batch * p->rows * p->cols;
    /* PER_TENSOR writes a scale per slice even when the slices are empty */
    const bool writes_scale = p->mode == MX_FP8_PER_TENSOR ? p->batch > 0 && !p->scale_given : elements > 0;
    if ((elements > 0 && (!p->x || !p->q)) || ((writes_scale || (elements > 0 && p->scale_given)) && !p->scale))
        return mx_status_fail(MX_ERR_VALUE, "fp8_quant (CUDA): x, q or scale is NULL");
    if (elements == 0 && !writes_scale)
        return mx_status_ok();
    if (p->mode == MX_FP8_PER_BLOCK &&
        p->batch * mx_ceil_div(p->rows, p->block_rows) * mx_ceil_div(p->cols, p->block_cols) > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "fp8_quant (CUDA): too many blocks");
    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    switch (p->dtype) {
    case MX_F16: return quant_abi<__half>(p, stream);
    case MX_BF16: return quant_abi<__nv_bfloat16>(p, stream);
    default: return quant_abi<float>(p, stream);
    }
}

/* ---- pipeline entry points (fp8.cuh) ------------------------------------------- */

namespace {

template <typename Fn> mx_status by_dtype(mx_dtype dt, Fn fn)
{
    switch (dt) {
    case MX_BF16: return fn(static_cast<const __nv_bfloat16 *>(nullptr));
    case MX_F16: return fn(static_cast<const __half *>(nullptr));
    case MX_F32: return fn(static_cast<const float *>(nullptr));
    default: break;
    }
    return mx_status_fail(MX_ERR_TYPE, "fp8 row quantizer: dtype %s", mx_dtype_name(dt));
}

/* rows of x (ldx) and q (ldq) allow the kernels' 4-column loads and stores */
template <typename T> bool rows_vec4(const void *x, int64_t cols, int64_t ldx, const uint8_t *q, int64_t ldq)
{
    return cols % 4 == 0 && ldx % 4 == 0 && ldq % 4 == 0 && reinterpret_cast<uintptr_t>(x) % (4 * sizeof(T)) == 0 &&
           reinterpret_cast<uintptr_t>(q) % 4 == 0;
}

} /* namespace */

extern "C" int mx_fp8_amax_parts(int64_t rows) { return static_cast<int>(grid_cap(rows, kAmaxParts)); }

extern "C" mx_status mx_cuda_fp8_rows_amax(const void *x, mx_dtype dt, int64_t rows, int64_t cols, int64_t ldx,
                                           const mx_fp8_row_filter *filter, float *partials, uint32_t *reset,
                                           cudaStream_t stream)
{
    const unsigned blocks = static_cast<unsigned>(mx_fp8_amax_parts(rows));
    return by_dtype(dt, [&](auto tag) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        const auto kernel = rows_vec4<T>(x, cols, ldx, nullptr, 0) ? rows_amax_kernel<T, true> : rows_amax_kernel<T, false>;
        return mx_check_call(mx_launch_after(kernel, dim3(blocks), dim3(kQuantThreads), 0, stream,
                                             static_cast<const T *>(x), rows, cols, ldx, *filter, partials, reset),
                             "rows_amax_kernel");
    });
}

extern "C" mx_status mx_cuda_fp8_rows_quant_tensor(const void *x, mx_dtype dt, int64_t rows, int64_t cols,
                                                   int64_t ldx, const mx_fp8_row_filter *filter,
                                                   const float *partials, const uint32_t *amax_bits, uint8_t *q,
                                                   int64_t ldq, float *scale, cudaStream_t stream)
{
    const int parts = mx_fp8_amax_parts(rows);
    return by_dtype(dt, [&](auto tag) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        const bool sorted = filter->dest_rows != nullptr;
        dim3 grid(static_cast<unsigned>(grid_cap(rows, 4096)));
        auto kernel = sorted ? rows_quant_tensor_kernel<T, false, true> : rows_quant_tensor_kernel<T, false, false>;
        if (rows_vec4<T>(x, cols, ldx, q, ldq)) {
            /* a warp per chunk of a row up to kTensorQuantUnits (or
             * kTensorQuantUnitsAtomic), else per row, up to 8K blocks */
            const int64_t units = rows * tensor_quant_chunks(ldq);
            const int64_t limit = partials ? kTensorQuantUnits : kTensorQuantUnitsAtomic;
            grid = dim3(static_cast<unsigned>(
                grid_cap(mx_ceil_div(units <= limit ? units : rows, kQuantThreads / 32), 8192)));
            kernel = sorted ? rows_quant_tensor_kernel<T, true, true> : rows_quant_tensor_kernel<T, true, false>;
        }
        return mx_check_call(mx_launch_after(kernel, grid, dim3(kQuantThreads), 0, stream, static_cast<const T *>(x),
                                             rows, cols, ldx, *filter, partials, parts, amax_bits, q, ldq, scale),
                             "rows_quant_tensor_kernel");
    });
}

extern "C" mx_status mx_cuda_fp8_rows_quant_group(const void *x, mx_dtype dt, int64_t rows, int64_t cols,
                                                  int64_t ldx, int group, const mx_fp8_row_filter *filter,
                                                  uint8_t *q, int64_t ldq, float *scales, int64_t scale_ld,
                                                  cudaStream_t stream)
{
    const int64_t col_blocks = mx_ceil_div(mx_ceil_div(cols, group), kQuantThreads / 32);
    if (col_blocks > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "group_quant_kernel: %lld columns in groups of %d exceed the grid",
                              (long long)cols, group);
    const bool sorted = filter->dest_rows != nullptr;
    return by_dtype(dt, [&](auto tag) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        if (group == 128 && rows_vec4<T>(x, cols, ldx, q, ldq)) {
            const int64_t units = rows * mx_ceil_div(mx_ceil_div(cols, 128), kGroupsPerWarp);
            const unsigned blocks = static_cast<unsigned>(grid_cap(mx_ceil_div(units, kQuantThreads / 32), 16384));
            const auto kernel = sorted ? group_quant_vec4_kernel<T, true> : group_quant_vec4_kernel<T, false>;
            return mx_check_call(mx_launch_after(kernel, dim3(blocks), dim3(kQuantThreads), 0, stream,
                                                 static_cast<const T *>(x), rows, cols, ldx, *filter, q, ldq, scales,
                                                 scale_ld),
                                 "group_quant_vec4_kernel");
        }
        const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(grid_cap(rows, 65535)));
        const auto kernel = sorted ? group_quant_kernel<T, true> : group_quant_kernel<T, false>;
        return mx_check_call(mx_launch_after(kernel, grid, dim3(kQuantThreads), 0, stream, static_cast<const T *>(x),
                                             rows, cols, ldx, group, *filter, q, ldq, scales, scale_ld),
                             "group_quant_kernel");
    });
}

extern "C" mx_status mx_cuda_fp8_quant_a(const void *x, mx_dtype dt, int64_t rows, int64_t cols, int64_t ldx,
                                         const mx_fp8_row_filter *filter, mx_quant quant, float *partials,
                                         uint32_t *reset, uint8_t *q, int64_t ldq, float *scales, int64_t scale_ld,
                                         cudaStream_t stream)
{
    if (quant == MX_QUANT_FP8_BLOCK)
        return mx_cuda_fp8_rows_quant_group(x, dt, rows, cols, ldx, kFp8Block, filter, q, ldq, scales, scale_ld,
                                            stream);
    return by_dtype(dt, [&](auto tag) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
        const int64_t quads = rows * (ldq / 4);
        /* the one-block form writes q by row only (no dest_rows) */
        if (quads <= kOneBlockQuads && rows <= kOneBlockRows && !filter->dest_rows &&
            rows_vec4<T>(x, cols, ldx, q, ldq)) {
            /* kOneBlockSlots quads a thread, whole warps, at least 256 threads */
            const int64_t threads = mx_ceil_div(mx_ceil_div(quads, kOneBlockSlots), 32) * 32;
            const unsigned block = static_cast<unsigned>(threads < kQuantThreads ? kQuantThreads : threads);
            return mx_check_call(mx_launch_after(rows_quant_tensor_one_block_kernel<T>, dim3(1), dim3(block), 0,
                                                 stream, static_cast<const T *>(x), rows, cols, ldx, *filter, reset, q,
                                                 ldq, scales),
                                 "rows_quant_tensor_one_block_kernel");
        }
        const mx_status st = mx_cuda_fp8_rows_amax(x, dt, rows, cols, ldx, filter, partials, reset, stream);
        if (st.code != MX_OK)
            return st;
        return mx_cuda_fp8_rows_quant_tensor(x, dt, rows, cols, ldx, filter, partials, nullptr, q, ldq, scales,
                                             stream);
    });
}
