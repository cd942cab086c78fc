/* The 16-bit phases of the one-launch decode forward (decode_fused.cu):
 * one or two tokens, the dot products on the CUDA cores (phases 1, 2, 4, 5
 * of decode_fused.cu's header). */
#ifndef MOE_EXT_CUDA_DECODE_FUSED_16BIT_CUH
#define MOE_EXT_CUDA_DECODE_FUSED_16BIT_CUH

#include "decode_fused.cuh"

namespace {

/* acc + the dot product of 16 bytes of T (8 elements) from w and a */
template <typename T> __device__ __forceinline__ float dot8(uint4 w, uint4 a, float acc)
{
    const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = mx_unpack2<T>(wv[i]), q = mx_unpack2<T>(av[i]);
        acc = fmaf(p.y, q.y, fmaf(p.x, q.x, acc));
    }
    return acc;
}

/* How a warp's lanes share rows: all 32 lanes on one row (a warp step 512
 * contiguous bytes of a row-major row), or, on packed weights (abi.h),
 * groups of 8 (16) lanes on 4 (2) consecutive rows, so that a warp step
 * reads 512 (2 x 256) contiguous bytes of the 64-row block (a 128-byte
 * slice of each row). The phases give groups only whole rounds of every
 * warp (GEMM1 4-row groups; GEMM2 4-row, then 2-row groups) and the rest
 * to whole warps, since a last round of 4-item warps left most warps idle
 * (Mixtral M = 1 +16%, H100). GEMM2's 2-row rounds with GEMM1's bias
 * loaded early: qwen3moe bf16 M = 1 32.2 -> 31.8 us, gpt-oss M = 1 / 2
 * -1.0 / -0.5%; 2-row rounds in GEMM1 too were flat to 3% slower (H200,
 * 2026-11-28, logs/2026-11-28-nvidia-h200-ab-fused-lane-groups.txt). The
 * lane counts are constants where the phases use them (gemm2_rounds is a
 * template on it): with the count a loop variable the forwards ran 5-22%
 * slower. */
struct row_lanes {
    int lanes, group, first, step; /* lanes a row, this lane's group, its first byte, bytes a step */
    __device__ __forceinline__ explicit row_lanes(int lanes_a_row)
    {
        const int lane = threadIdx.x & 31;
        lanes = lanes_a_row;
        group = lane / lanes;
        first = lane % lanes * 16;
        step = lanes * 16;
    }
    __device__ __forceinline__ int groups() const { return 32 / lanes; }
    __device__ __forceinline__ bool leader() const { return first == 0; }
    /* the sum over the group's lanes (the lanes = 32 order of warp_sum) */
    __device__ __forceinline__ float sum(float v) const
    {
        for (int off = lanes / 2; off > 0; off >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, off);
        return v;
    }
};

/* Lane sums of two weight rows (w0, w1: kbytes each, global) against rows
 * a0, a1 (shared memory): 16 bytes a lane per step (bytes first, first +
 * step, ...), kUnroll steps of both rows loaded before any is used. */
template <typename T>
__device__ __forceinline__ void dot_rows(const weight_row w0, const weight_row w1, const uint8_t *a0, const uint8_t *a1,
                                         int kbytes, int first, int step, float &acc0, float &acc1)
{
    for (int base = first; base < kbytes; base += step * kUnroll) {
        uint4 r0[kUnroll], r1[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int off = base + u * step;
            if (off < kbytes) {
                r0[u] = ld_stream16(w0.at(off));
                r1[u] = ld_stream16(w1.at(off));
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int off = base + u * step;
            if (off >= kbytes)
                break;
            acc0 = dot8<T>(r0[u], *reinterpret_cast<const uint4 *>(a0 + off), acc0);
            acc1 = dot8<T>(r1[u], *reinterpret_cast<const uint4 *>(a1 + off), acc1);
        }
    }
}

/* Phase 1: the x rows, one per token (two elements a thread and step), by
 * threads [first, kThreads); the caller synchronizes after. */
template <typename T>
__device__ __forceinline__ void fused_stage_x(const fused_args &a, const fused_head &hd, uint8_t *ops, int first)
{
    const T *x = static_cast<const T *>(a.x);
    const int64_t half = a.H / 2;
    if (static_cast<int>(threadIdx.x) < first)
        return;
    for (int64_t i = threadIdx.x - first; i < a.M * half; i += kThreads - first) {
        const int t = static_cast<int>(i / half);
        const int64_t c = (i - t * half) * 2;
        float v0 = mx_to_float(x[t * a.H + c]), v1 = mx_to_float(x[t * a.H + c + 1]);
        if (a.weight_on_input) {
            const float w = mx_to_float(mx_from_float<T>(hd.weights[t * a.top_k]));
            v0 *= w;
            v1 *= w;
        }
        *reinterpret_cast<uint32_t *>(ops + (t * a.H + c) * sizeof(T)) = mx_pack2<T>(v0, v1);
    }
}

/* GEMM1 unit u: slot index v (slowest), act column c, weight rows r0 / r1
 * (gate / up, or two columns of a non-gated w13). */
struct gemm1_unit {
    int v, e, c, r0, r1;
    __device__ __forceinline__ gemm1_unit(const fused_args &a, const fused_head &hd, int u, int cols)
    {
        v = u / cols;
        c = u - v * cols;
        e = hd.slot_e[hd.valid[v]];
        if (a.kind == MX_GEMM_GATE_UP) {
            r0 = c;
            r1 = static_cast<int>(a.I) + c;
        } else {
            r0 = 2 * c;
            r1 = 2 * c + 1 < a.n1 ? 2 * c + 1 : r0;
        }
    }
};

/* GEMM1 unit u's two rows, then (the group's leader) its activation into act. */
template <typename T>
__device__ __forceinline__ void gemm1_item(const fused_args &a, const fused_head &hd, const uint8_t *ops,
                                           const row_lanes &rl, int u, int cols)
{
    const int hbytes = static_cast<int>(a.H * sizeof(T));
    const gemm1_unit n(a, hd, u, cols);
    const uint8_t *xr = ops + static_cast<int64_t>(hd.valid[n.v] / a.top_k) * hbytes;
    /* the bias loaded before the rows, so that its latency is not added to the unit's (gpt-oss bf16
     * M = 1 / 2 -0.5 / -0.4%, H200, logs/2026-11-28-nvidia-h200-ab-fused-lane-groups.txt) */
    const T *bias = static_cast<const T *>(a.b13);
    T b0{}, b1{};
    if (bias && rl.leader()) {
        b0 = bias[n.e * a.n1 + n.r0];
        b1 = bias[n.e * a.n1 + n.r1];
    }
    float acc0 = 0.0f, acc1 = 0.0f;
    dot_rows<T>(weight_row_of(a.w13, a.w_packed, n.e, a.n1, n.r0, hbytes),
                weight_row_of(a.w13, a.w_packed, n.e, a.n1, n.r1, hbytes), xr, xr, hbytes, rl.first, rl.step, acc0,
                acc1);
    acc0 = rl.sum(acc0);
    acc1 = rl.sum(acc1);
    if (!rl.leader())
        return;
    if (bias) {
        acc0 += mx_to_float(b0);
        acc1 += mx_to_float(b1);
    }
    T *dst = static_cast<T *>(a.act) + n.v * a.I;
    if (a.kind == MX_GEMM_UP) {
        dst[n.r0] = mx_from_float<T>(mx_act_plain(a.activation, acc0));
        if (n.r1 != n.r0)
            dst[n.r1] = mx_from_float<T>(mx_act_plain(a.activation, acc1));
    } else {
        dst[n.c] = mx_from_float<T>(mx_act_gated(a.activation, acc0, acc1, a.alpha, a.limit));
    }
}

/* Phase 2: GEMM1 and the activation; act [nvalid, I] in T to the workspace.
 * Packed weights: first whole rounds of every warp taking 4 consecutive
 * units by lane groups (row_lanes); the rest a warp each. Warps are
 * numbered CTA fastest, so that the units left over after whole rounds
 * spread over the CTAs: no CTA holds more than one more than another. */
template <typename T>
__device__ __forceinline__ void fused_gemm1(const fused_args &a, const fused_head &hd, const uint8_t *ops)
{
    const int gw = (threadIdx.x >> 5) * gridDim.x + blockIdx.x, nw = gridDim.x * kWarps;
    const int cols = static_cast<int>(a.kind == MX_GEMM_UP ? (a.I + 1) / 2 : a.I), units = hd.nvalid * cols;
    int first = 0; /* the first unit not yet taken by lane groups */
    if (a.w_packed) {
        const row_lanes grouped(8);
        const int quads = units / 4 / nw * nw;
        for (int q = gw; q < quads; q += nw)
            gemm1_item<T>(a, hd, ops, grouped, 4 * q + grouped.group, cols);
        first = 4 * quads;
    }
    const row_lanes whole(32);
    for (int u = first + gw; u < units; u += nw)
        gemm1_item<T>(a, hd, ops, whole, u, cols);
}

/* GEMM2 rows of this CTA: [h0, h1) */
__device__ __forceinline__ void cta_rows(const fused_args &a, int64_t &h0, int64_t &h1)
{
    h0 = a.H * blockIdx.x / gridDim.x;
    h1 = a.H * (blockIdx.x + 1) / gridDim.x;
}

/* Phase 4: act rows into shared memory (written by other CTAs: L2 loads). */
template <typename T>
__device__ __forceinline__ void fused_stage_act(const fused_args &a, const fused_head &hd, uint8_t *ops)
{
    const uint4 *act = static_cast<const uint4 *>(a.act);
    const int64_t n16 = hd.nvalid * a.I * static_cast<int64_t>(sizeof(T)) / 16;
    for (int64_t i = threadIdx.x; i < n16; i += kThreads)
        reinterpret_cast<uint4 *>(ops)[i] = __ldcg(act + i);
    __syncthreads();
}

/* GEMM2 items i0, i1 (item: slot v = i / nrows, row h0 + i % nrows) of
 * this CTA's rows [h0, h0 + nrows) into ys. */
template <typename T>
__device__ __forceinline__ void gemm2_items(const fused_args &a, const fused_head &hd, const uint8_t *ops, float *ys,
                                            const row_lanes &rl, int64_t h0, int nrows, int i0, int i1)
{
    const int ibytes = static_cast<int>(a.I * sizeof(T));
    const int v0 = i0 / nrows, v1 = i1 / nrows;
    const int64_t g0 = h0 + (i0 - v0 * nrows), g1 = h0 + (i1 - v1 * nrows);
    const int e0 = hd.slot_e[hd.valid[v0]], e1 = hd.slot_e[hd.valid[v1]];
    float acc0 = 0.0f, acc1 = 0.0f;
    dot_rows<T>(weight_row_of(a.w2, a.w_packed, e0, a.H, g0, ibytes),
                weight_row_of(a.w2, a.w_packed, e1, a.H, g1, ibytes), ops + v0 * ibytes, ops + v1 * ibytes, ibytes,
                rl.first, rl.step, acc0, acc1);
    acc0 = rl.sum(acc0);
    acc1 = rl.sum(acc1);
    if (rl.leader()) {
        ys[v0 * a.rows_max + (g0 - h0)] = acc0;
        ys[v1 * a.rows_max + (g1 - h0)] = acc1;
    }
}

/* GEMM2 items [first, ...) of this CTA in whole rounds of every warp by
 * groups of LANES lanes a row (row_lanes): a warp takes 32 / LANES
 * consecutive items and as many kWarps * 32 / LANES further on; returns
 * the first item left. */
template <typename T, int LANES>
__device__ __forceinline__ int gemm2_rounds(const fused_args &a, const fused_head &hd, const uint8_t *ops, float *ys,
                                            int64_t h0, int nrows, int first, int items)
{
    const int warp = threadIdx.x >> 5;
    const row_lanes rl(LANES);
    constexpr int kRows = 32 / LANES, kRound = 2 * kRows * kWarps;
    const int end = first + (items - first) / kRound * kRound;
    for (int q = first + kRows * warp; q < end; q += kRound)
        gemm2_items<T>(a, hd, ops, ys, rl, h0, nrows, q + rl.group, q + rl.group + kRows * kWarps);
    return end;
}

/* Phase 5: GEMM2 of the CTA's rows, then the top-k sum into out. A warp
 * takes items i and i + kWarps together; on packed weights, first whole
 * rounds of 8 (4) items a warp by lane groups (row_lanes), 4 (2)
 * consecutive items and as many kWarps * 4 (2) further on. */
template <typename T>
__device__ __forceinline__ void fused_gemm2(const fused_args &a, const fused_head &hd, const uint8_t *ops, float *ys)
{
    int64_t h0, h1;
    cta_rows(a, h0, h1);
    const int nrows = static_cast<int>(h1 - h0), items = hd.nvalid * nrows;
    const int warp = threadIdx.x >> 5;
    int first = 0; /* the first item not yet taken by lane groups */
    if (a.w_packed) {
        first = gemm2_rounds<T, 8>(a, hd, ops, ys, h0, nrows, first, items);
        first = gemm2_rounds<T, 16>(a, hd, ops, ys, h0, nrows, first, items);
    }
    const row_lanes whole(32);
    for (int i0 = first + warp; i0 < items; i0 += 2 * kWarps)
        gemm2_items<T>(a, hd, ops, ys, whole, h0, nrows, i0, i0 + kWarps < items ? i0 + kWarps : i0);
    __syncthreads();
    const T *bias = static_cast<const T *>(a.b2);
    T *out = static_cast<T *>(a.out);
    for (int64_t i = threadIdx.x; i < a.M * nrows; i += kThreads) {
        const int t = static_cast<int>(i / nrows);
        const int64_t h = h0 + (i - t * nrows);
        float sum = 0.0f;
        for (int j = 0; j < a.top_k; ++j) {
            const int p = t * a.top_k + j, e = hd.slot_e[p];
            if (e < 0)
                continue;
            float y = ys[hd.vq[p] * a.rows_max + (h - h0)];
            if (bias)
                y += mx_to_float(bias[e * a.H + h]);
            sum += __fmul_rn(y, a.weight_on_input ? 1.0f : hd.weights[p]);
        }
        out[t * a.H + h] = mx_from_float<T>(sum);
    }
}

} /* namespace */

#endif /* MOE_EXT_CUDA_DECODE_FUSED_16BIT_CUH */
