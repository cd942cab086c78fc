/* The FP8 phases of the one-launch decode forward (decode_fused.cu): one
 * token, gated weights in whole 128-wide blocks; x and act quantized in
 * shared memory with the pipeline quantizers' formulas (fp8.cuh), the dot
 * products on tensor cores. */
#ifndef MOE_EXT_CUDA_DECODE_FUSED_FP8_CUH
#define MOE_EXT_CUDA_DECODE_FUSED_FP8_CUH

#include "decode_fused.cuh"
#include "fp8.cuh"

namespace {

/* c += a (16 x 32 e4m3, row) * b (32 x 8 e4m3, col), float32 (sm_89+; the
 * host takes this path on compute capability 9.0 only, where ptxas lowers
 * it to fp8 -> f16 unpacks and f16 MMAs: Hopper runs FP8 natively only
 * through wgmma) */
__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

/* A warp's partial sums of 16 weight rows (lane group g: rows w_lo = row g,
 * w_hi = row g + 8) against one token's fp8 row x (shared memory; read by
 * the lanes of group 0, the B operand's column 0) over k blocks [kb0, kb1)
 * of 128 bytes. Lane (g, t) loads bytes [16 t, 16 t + 16) of each 64-byte
 * step of its two rows and the same bytes of x: k permuted the same way in
 * A and B, so each load is 16 contiguous bytes and one step is two
 * m16n8k32 MMAs. Each k block's products are added in float32 (times
 * sw_lo / sw_hi [kb] * sx[kb] with block scales). Returns row g's sum in
 * lo and row g + 8's in hi, valid in lanes with t == 0. */
template <int Q>
__device__ __forceinline__ void mma_rows(const weight_row w_lo, const weight_row w_hi, const uint8_t *x, int kb0, int kb1,
                                         const float *sw_lo, const float *sw_hi, const float *sx, float &lo, float &hi)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    lo = hi = 0.0f;
    for (int kb = kb0; kb < kb1; kb += kMmaBlocks) {
        uint4 p[kMmaBlocks][2], q[kMmaBlocks][2];
#pragma unroll
        for (int b = 0; b < kMmaBlocks; ++b)
            if (kb + b < kb1) {
                const int off = (kb + b) * kFp8Block + 16 * t;
                p[b][0] = ld_stream16(w_lo.at(off));
                p[b][1] = ld_stream16(w_lo.at(off + 64));
                q[b][0] = ld_stream16(w_hi.at(off));
                q[b][1] = ld_stream16(w_hi.at(off + 64));
            }
#pragma unroll
        for (int b = 0; b < kMmaBlocks; ++b) {
            if (kb + b >= kb1)
                break;
            const int off = (kb + b) * kFp8Block + 16 * t;
            uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0;
            if (g == 0) {
                x0 = *reinterpret_cast<const uint4 *>(x + off);
                x1 = *reinterpret_cast<const uint4 *>(x + off + 64);
            }
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_e4m3(c, p[b][0].x, q[b][0].x, p[b][0].y, q[b][0].y, x0.x, x0.y);
            mma_e4m3(c, p[b][0].z, q[b][0].z, p[b][0].w, q[b][0].w, x0.z, x0.w);
            mma_e4m3(c, p[b][1].x, q[b][1].x, p[b][1].y, q[b][1].y, x1.x, x1.y);
            mma_e4m3(c, p[b][1].z, q[b][1].z, p[b][1].w, q[b][1].w, x1.z, x1.w);
            if constexpr (Q == Q_BLOCK) {
                lo = fmaf(c[0], sw_lo[kb + b] * sx[kb + b], lo);
                hi = fmaf(c[2], sw_hi[kb + b] * sx[kb + b], hi);
            } else {
                lo += c[0];
                hi += c[2];
            }
        }
    }
}

/* Quantizes rows [nrows][cols] of values val(row, c) into ops (row stride
 * ld bytes) with per-(row, 128 columns) scales into sc (row stride blocks):
 * a warp per (row, group) of warps [first_warp, kWarps), the group
 * quantizer's formulas. */
template <typename Val>
__device__ __forceinline__ void quant_groups(int nrows, int64_t cols, int64_t blocks, uint8_t *ops, int64_t ld,
                                             float *sc, int first_warp, Val val)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp < first_warp)
        return;
    for (int64_t u = warp - first_warp; u < nrows * blocks; u += kWarps - first_warp) {
        const int row = static_cast<int>(u / blocks);
        const int64_t c0 = (u % blocks) * kFp8Block + lane * 4;
        float v[4], amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = c0 + i < cols ? val(row, c0 + i) : 0.0f;
            amax = mx_amax_step(amax, v[i]);
        }
        amax = mx_warp_max(amax);
        const float sg = mx_fp8_group_scale(amax), r = mx_fp8_div_recip(sg);
        if (c0 < cols)
            *reinterpret_cast<uint32_t *>(ops + row * ld + c0) =
                mx_fp8_encode2_divided(v[0], v[1], sg, r) |
                static_cast<uint32_t>(mx_fp8_encode2_divided(v[2], v[3], sg, r)) << 16;
        if (lane == 0)
            sc[row * blocks + u % blocks] = sg;
    }
}

/* Per-tensor quantization of rows [nrows][cols] with inv = 1 / s. */
template <typename Val>
__device__ __forceinline__ void quant_tensor(int nrows, int64_t cols, uint8_t *ops, int64_t ld, float inv, Val val)
{
    for (int64_t i = threadIdx.x; i < nrows * (cols / 4); i += kThreads) {
        const int row = static_cast<int>(i / (cols / 4));
        const int64_t c = (i % (cols / 4)) * 4;
        uint32_t q = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k)
            q |= static_cast<uint32_t>(mx_fp8_encode(__fmul_rn(val(row, c + k), inv))) << (8 * k);
        *reinterpret_cast<uint32_t *>(ops + row * ld + c) = q;
    }
}

/* Phase 1 (FP8): the token's x row quantized as the x quantizers do it (a
 * token without a local slot has no GEMM1 units, so the pipeline's row
 * filter changes nothing at one token). Block scales: by the warps from
 * thread `first` on, beside routing (fused_route's barrier ends the
 * phase). */
template <typename T>
__device__ __forceinline__ void fused_stage_x_fp8_block(const fused_args &a, uint8_t *ops, float *xsc, int first)
{
    const T *x = static_cast<const T *>(a.x);
    quant_groups(1, a.H, a.H / kFp8Block, ops, a.H, xsc, first / 32,
                 [&](int, int64_t c) { return mx_to_float(x[c]); });
}

/* Phase 1 (FP8 per tensor), after routing: x's amax over the CTA, then the
 * row quantized with its scale. */
template <typename T>
__device__ __forceinline__ void fused_stage_x_fp8_tensor(const fused_args &a, fused_head &hd, uint8_t *ops)
{
    const T *x = static_cast<const T *>(a.x);
    auto xv = [&](int, int64_t c) { return mx_to_float(x[c]); };
    float amax = 0.0f;
#pragma unroll 4
    for (int64_t c = threadIdx.x; c < a.H; c += kThreads) /* the loads issued together */
        amax = mx_amax_step(amax, xv(0, c));
    amax = mx_warp_max(amax);
    if ((threadIdx.x & 31) == 0)
        mx_atomic_amax(&hd.amax_bits, amax);
    __syncthreads();
    const float sx = mx_fp8_tensor_scale(__uint_as_float(hd.amax_bits));
    quant_tensor(1, a.H, ops, a.H, __fdiv_rn(1.0f, sx), xv);
    __syncthreads();
    if (threadIdx.x == 0) {
        hd.x_scale = sx;
        hd.amax_bits = 0u; /* now GEMM1's act amax */
    }
    __syncthreads();
}

/* Phase 2 (FP8): GEMM1 of the gated kind. A unit is 8 act columns of one
 * slot (gate rows c..c+7 as MMA rows 0-7, up rows I+c.. as rows 8-15); a
 * CTA takes two units a round, eight warps each splitting K, and 16
 * threads sum the eight partials in order and apply the activation. */
template <typename T, int Q>
__device__ __forceinline__ void fused_gemm1_fp8(const fused_args &a, fused_head &hd, const uint8_t *ops,
                                                const float *xsc, float *red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, half = warp >> 3, slice = warp & 7;
    const int I = static_cast<int>(a.I), groups = I / 8, units = hd.nvalid * groups;
    const int kblocks = static_cast<int>(a.H / kFp8Block), n1b = 2 * I / kFp8Block;
    const T *bias = static_cast<const T *>(a.b13);
    T *act = static_cast<T *>(a.act);
    float amax = 0.0f;
    for (int base = 2 * blockIdx.x; base < units; base += 2 * gridDim.x) {
        const int u = base + half;
        if (u < units) {
            const int v = u / groups, c = (u - v * groups) * 8, e = hd.slot_e[hd.valid[v]], g = lane >> 2;
            const float *sw_lo = nullptr, *sw_hi = nullptr;
            if constexpr (Q == Q_BLOCK) {
                sw_lo = a.w13_scale + (e * n1b + c / kFp8Block) * kblocks;
                sw_hi = a.w13_scale + (e * n1b + (I + c) / kFp8Block) * kblocks;
            }
            float lo, hi;
            mma_rows<Q>(weight_row_of(a.w13, a.w_packed, e, a.n1, c + g, a.H),
                        weight_row_of(a.w13, a.w_packed, e, a.n1, I + c + g, a.H), ops, slice * kblocks / 8,
                        (slice + 1) * kblocks / 8, sw_lo, sw_hi, xsc, lo, hi);
            if ((lane & 3) == 0) {
                red[(half * 8 + slice) * 16 + g] = lo;
                red[(half * 8 + slice) * 16 + 8 + g] = hi;
            }
        }
        __syncthreads();
        if (threadIdx.x < 16 && base + threadIdx.x / 8 < units) {
            const int h = threadIdx.x / 8, j = threadIdx.x & 7, u = base + h;
            const int v = u / groups, col = (u - v * groups) * 8 + j, e = hd.slot_e[hd.valid[v]];
            float gate = 0.0f, up = 0.0f;
            for (int sl = 0; sl < 8; ++sl) {
                gate += red[(h * 8 + sl) * 16 + j];
                up += red[(h * 8 + sl) * 16 + 8 + j];
            }
            if constexpr (Q == Q_TENSOR) {
                const float sc = hd.x_scale * a.w13_scale[e];
                gate *= sc;
                up *= sc;
            }
            if (bias) {
                gate += mx_to_float(bias[e * a.n1 + col]);
                up += mx_to_float(bias[e * a.n1 + I + col]);
            }
            const T q = mx_from_float<T>(mx_act_gated(a.activation, gate, up, a.alpha, a.limit));
            act[v * a.I + col] = q;
            amax = mx_amax_step(amax, mx_to_float(q));
        }
        __syncthreads();
    }
    if constexpr (Q == Q_TENSOR) {
        amax = mx_warp_max(amax);
        if (lane == 0)
            mx_atomic_amax(&hd.amax_bits, amax);
        __syncthreads();
        if (threadIdx.x == 0)
            a.amax_parts[blockIdx.x] = __uint_as_float(hd.amax_bits);
    }
}

/* Phase 4 (FP8): act rows quantized into shared memory as the act
 * quantizers do it (per tensor: the scale from every CTA's amax). */
template <typename T, int Q>
__device__ __forceinline__ void fused_stage_act_fp8(const fused_args &a, fused_head &hd, uint8_t *ops, float *asc)
{
    const T *act = static_cast<const T *>(a.act);
    auto av = [&](int v, int64_t c) { return mx_to_float(__ldcg(act + v * a.I + c)); };
    if constexpr (Q == Q_BLOCK) {
        quant_groups(hd.nvalid, a.I, a.I / kFp8Block, ops, a.I, asc, 0, av);
    } else {
        /* every CTA's partial, a thread each (one L2 round trip), into hd.amax_bits, which holds this
         * CTA's own partial already */
        float amax = 0.0f;
        for (unsigned b = threadIdx.x; b < gridDim.x; b += kThreads)
            amax = mx_max_nan(amax, __ldcg(a.amax_parts + b));
        amax = mx_warp_max(amax);
        if ((threadIdx.x & 31) == 0)
            mx_atomic_amax(&hd.amax_bits, amax);
        __syncthreads();
        if (threadIdx.x == 0)
            hd.act_scale = mx_fp8_tensor_scale(__uint_as_float(hd.amax_bits));
        __syncthreads();
        quant_tensor(hd.nvalid, a.I, ops, a.I, __fdiv_rn(1.0f, hd.act_scale), av);
    }
    __syncthreads();
}

/* Phase 5 (FP8): GEMM2 by 16-row groups of H, a group per CTA a round: the
 * slots' warps split K (16 / slots warps a slot), then 16 threads sum each
 * slot's partials, add the bias and sum the slots in slot order. */
template <typename T, int Q>
__device__ __forceinline__ void fused_gemm2_fp8(const fused_args &a, const fused_head &hd, const uint8_t *ops,
                                                const float *asc, float *red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const int nv = hd.nvalid, per = nv > 0 ? kWarps / nv : 0; /* warps a slot */
    const int v = per > 0 ? warp / per : 0, slice = per > 0 ? warp % per : 0;
    const int kblocks = static_cast<int>(a.I / kFp8Block), hb = static_cast<int>(a.H / kFp8Block);
    const T *bias = static_cast<const T *>(a.b2);
    T *out = static_cast<T *>(a.out);
    for (int rg = blockIdx.x; rg < a.H / 16; rg += gridDim.x) {
        const int64_t row0 = static_cast<int64_t>(rg) * 16;
        if (v < nv) {
            const int e = hd.slot_e[hd.valid[v]];
            const float *sw = nullptr, *sa = nullptr;
            if constexpr (Q == Q_BLOCK) {
                sw = a.w2_scale + (e * hb + row0 / kFp8Block) * kblocks;
                sa = asc + v * kblocks;
            }
            float lo, hi;
            mma_rows<Q>(weight_row_of(a.w2, a.w_packed, e, a.H, row0 + g, a.I),
                        weight_row_of(a.w2, a.w_packed, e, a.H, row0 + g + 8, a.I), ops + v * a.I, slice * kblocks / per,
                        (slice + 1) * kblocks / per, sw, sw, sa, lo, hi);
            if ((lane & 3) == 0) {
                red[(v * per + slice) * 16 + g] = lo;
                red[(v * per + slice) * 16 + 8 + g] = hi;
            }
        }
        __syncthreads();
        if (threadIdx.x < 16) {
            const int64_t h = row0 + threadIdx.x;
            float sum = 0.0f;
            for (int q = 0; q < nv; ++q) {
                const int p = hd.valid[q], e = hd.slot_e[p];
                float y = 0.0f;
                for (int sl = 0; sl < per; ++sl)
                    y += red[(q * per + sl) * 16 + threadIdx.x];
                if constexpr (Q == Q_TENSOR)
                    y *= hd.act_scale * a.w2_scale[e];
                if (bias)
                    y += mx_to_float(bias[e * a.H + h]);
                sum += __fmul_rn(y, hd.weights[p]);
            }
            out[h] = mx_from_float<T>(sum);
        }
        __syncthreads();
    }
}

} /* namespace */

#endif /* MOE_EXT_CUDA_DECODE_FUSED_FP8_CUH */
