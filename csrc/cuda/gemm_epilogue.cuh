/* The grouped-GEMM epilogue shared by the tensor-core and SIMT kernels.
 *
 * Input: one CTA tile of float32 accumulators C [BM][ldc] in shared memory,
 * column c of C being the CTA's weight row c (for MX_GEMM_GATE_UP: columns
 * [0, BN/2) the gate rows and [BN/2, BN) the up rows of the same BN/2 output
 * columns; for MX_GEMM_GATE_UP_INTERLEAVED: columns 2i / 2i+1 the gate / up
 * rows of output column i), and the tile's pair indices (-1 = padding).
 *
 * GEMM1 kinds add w13_bias, apply the activation in float32, round to the
 * activation dtype and store act[s, col]; MX_GEMM_DOWN adds w2_bias (split
 * 0 only), multiplies by the routing weight and stores y[split][pair, col]
 * in float32 (the weight distributes over the split-K partial sums).
 * Threads walk the tile row by row, four consecutive columns each (one
 * 16- or 8-byte store when the row stride allows), so a warp stores 128
 * consecutive columns. Padding rows and columns past out_cols are skipped;
 * the values of columns past out_cols are computed from zero-filled tile
 * columns and dropped. */
#ifndef MOE_EXT_CUDA_GEMM_EPILOGUE_CUH
#define MOE_EXT_CUDA_GEMM_EPILOGUE_CUH

#include "common.cuh"
#include "experts.cuh"

namespace {

/* Four consecutive output values: one 16-byte (float) or 8-byte (16-bit)
 * store; the caller guarantees the alignment. */
template <typename T> __device__ __forceinline__ void mx_store4(T *dst, const float (&v)[4])
{
    *reinterpret_cast<uint2 *>(dst) = make_uint2(mx_pack2<T>(v[0], v[1]), mx_pack2<T>(v[2], v[3]));
}
template <> __device__ __forceinline__ void mx_store4<float>(float *dst, const float (&v)[4])
{
    *reinterpret_cast<float4 *>(dst) = make_float4(v[0], v[1], v[2], v[3]);
}

template <typename T, int KIND, int BM, int BN, int THREADS>
__device__ __forceinline__ void mx_gemm_epilogue(const float *C, int ldc, const int32_t *tile_pairs, int64_t row0,
                                                 int64_t nt, int expert, int split, const mx_gemm_args &g)
{
    constexpr bool kPaired = KIND == MX_GEMM_GATE_UP || KIND == MX_GEMM_GATE_UP_INTERLEAVED;
    constexpr int OC = kPaired ? BN / 2 : BN; /* output columns of the tile */
    constexpr int V = 4;                      /* consecutive columns per thread and step */
    static_assert(OC % V == 0, "whole column quads per tile");
    /* with split-K (GEMM2 only) the bias goes into slice 0 alone */
    const T *bias = g.bias && split == 0 ? static_cast<const T *>(g.bias) + static_cast<int64_t>(expert) * g.n_rows
                                         : nullptr;
    const int64_t col0 = nt * OC;
    /* quad stores need 4-element-aligned rows (act rows always are: ld_act % 8 == 0) */
    const bool vec_rows = g.ldo % V == 0 && (KIND != MX_GEMM_DOWN || g.out_split_stride % V == 0);
    for (int idx = threadIdx.x; idx < BM * (OC / V); idx += THREADS) {
        const int r = idx / (OC / V), c = (idx % (OC / V)) * V;
        const int32_t pair = tile_pairs[r];
        const int64_t col = col0 + c;
        if (pair < 0 || col >= g.out_cols)
            continue;
        const int valid = g.out_cols - col < V ? static_cast<int>(g.out_cols - col) : V;
        const float *crow = C + r * ldc;
        float v[V];
        if (KIND == MX_GEMM_DOWN) {
            const float4 h = *reinterpret_cast<const float4 *>(crow + c);
            const float w = g.scale_by_weight ? g.topk_weights[pair] : 1.0f;
            v[0] = h.x, v[1] = h.y, v[2] = h.z, v[3] = h.w;
#pragma unroll
            for (int q = 0; q < V; ++q)
                v[q] = (v[q] + (bias && q < valid ? mx_to_float(bias[col + q]) : 0.0f)) * w;
        } else if (KIND == MX_GEMM_GATE_UP) {
            const float4 ga = *reinterpret_cast<const float4 *>(crow + c);
            const float4 up = *reinterpret_cast<const float4 *>(crow + OC + c);
            const float gv[V] = {ga.x, ga.y, ga.z, ga.w}, uv[V] = {up.x, up.y, up.z, up.w};
#pragma unroll
            for (int q = 0; q < V; ++q) {
                float gate = gv[q], u = uv[q];
                if (bias && q < valid) {
                    gate += mx_to_float(bias[col + q]);
                    u += mx_to_float(bias[g.out_cols + col + q]);
                }
                v[q] = mx_act_gated(g.activation, gate, u, g.swiglu_alpha, g.swiglu_limit);
            }
        } else if (KIND == MX_GEMM_GATE_UP_INTERLEAVED) {
            const float4 p0 = *reinterpret_cast<const float4 *>(crow + 2 * c);
            const float4 p1 = *reinterpret_cast<const float4 *>(crow + 2 * c + 4);
            const float gv[V] = {p0.x, p0.z, p1.x, p1.z}, uv[V] = {p0.y, p0.w, p1.y, p1.w};
#pragma unroll
            for (int q = 0; q < V; ++q) {
                float gate = gv[q], u = uv[q];
                if (bias && q < valid) {
                    gate += mx_to_float(bias[2 * (col + q)]);
                    u += mx_to_float(bias[2 * (col + q) + 1]);
                }
                v[q] = mx_act_gated(g.activation, gate, u, g.swiglu_alpha, g.swiglu_limit);
            }
        } else {
            const float4 h = *reinterpret_cast<const float4 *>(crow + c);
            const float hv[V] = {h.x, h.y, h.z, h.w};
#pragma unroll
            for (int q = 0; q < V; ++q)
                v[q] = mx_act_plain(g.activation, hv[q] + (bias && q < valid ? mx_to_float(bias[col + q]) : 0.0f));
        }
        if (KIND == MX_GEMM_DOWN) {
            float *dst = static_cast<float *>(g.out) + split * g.out_split_stride + static_cast<int64_t>(pair) * g.ldo + col;
            if (vec_rows && valid == V) {
                mx_store4<float>(dst, v);
            } else {
#pragma unroll
                for (int q = 0; q < V; ++q)
                    if (q < valid)
                        dst[q] = v[q];
            }
        } else {
            T *dst = static_cast<T *>(g.out) + (row0 + r) * g.ldo + col;
            if (vec_rows && valid == V) {
                mx_store4<T>(dst, v);
            } else {
#pragma unroll
                for (int q = 0; q < V; ++q)
                    if (q < valid)
                        dst[q] = mx_from_float<T>(v[q]);
            }
        }
    }
}

} /* namespace */

#endif /* MOE_EXT_CUDA_GEMM_EPILOGUE_CUH */
