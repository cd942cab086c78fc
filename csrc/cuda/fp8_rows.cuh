/* Row pieces of the FP8 activation quantizers (numerics.md "FP8"; the
 * formulas in fp8.cuh): 4-element loads and packed stores, the encodings of
 * four values under a per-tensor inverse scale or a group scale, and the
 * row filter. Shared by fp8_quant.cu's row quantizers and the fused route +
 * sort kernel (route_align.cu), which quantizes x at decode, so both give
 * the same bits. */
#ifndef MOE_EXT_CUDA_FP8_ROWS_CUH
#define MOE_EXT_CUDA_FP8_ROWS_CUH

#include <type_traits>

#include "common.cuh"
#include "fp8.cuh"

namespace {

__device__ __forceinline__ bool row_valid(const mx_fp8_row_filter &f, int64_t row)
{
    if (f.mode == MX_FP8_ROWS_ROUTED) {
        for (int j = 0; j < f.top_k; ++j)
            if (mx_local_expert(f.topk_ids, f.expert_map, row * f.top_k + j, f.global_experts, f.local_experts) >= 0)
                return true;
        return false;
    }
    if (f.mode == MX_FP8_ROWS_SORTED)
        return row < static_cast<int64_t>(*f.num_tiles) * f.block_m && f.sorted_ids[row] >= 0;
    return true;
}

/* x[0..4) to float32: one 8-byte (16-bit T) or 16-byte (float) load; x is
 * 4-element aligned. */
template <typename T> __device__ __forceinline__ void load4(const T *x, float (&v)[4])
{
    using Raw = std::conditional_t<sizeof(T) == 4, float4, uint2>;
    const Raw raw = *reinterpret_cast<const Raw *>(x);
    const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        v[i] = mx_to_float(e[i]);
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

/* fp8(clamp(x / s)) for a group scale s: mx_fp8_div with r =
 * mx_fp8_div_recip(s) while s is finite, else __fdiv_rn (an infinite or NaN
 * amax, which mx_fp8_div's preconditions leave out) */
__device__ __forceinline__ uint8_t encode_divided(float x, float s, float r)
{
    return mx_fp8_encode(isfinite(s) ? mx_fp8_div(x, s, r) : __fdiv_rn(x, s));
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

} /* namespace */

#endif /* MOE_EXT_CUDA_FP8_ROWS_CUH */
