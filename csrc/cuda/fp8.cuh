/* FP8 (float8_e4m3fn) pieces shared by the CUDA engine's FP8 files:
 * the quantization formulas of numerics.md "FP8" as device functions, the
 * row filter of the pipeline quantizers, the arguments of the FP8 grouped
 * GEMM, and the internal launchers (fp8_quant.cu, grouped_gemm_fp8.cu).
 *
 * Formulas (float32, in the order written; divisions correctly rounded via
 * __fdiv_rn so that a fast-math build cannot change a bit):
 *   per tensor       s = max(amax / 448, 1 / (448 * 512)); q = fp8(clamp(x * (1 / s)))
 *   per block        sf = max(amax, 1e-4) / 448 (ue8m0: 2^ceil(log2 sf)); q = fp8(x * (1 / sf))
 *   per token group  s = max(amax, 1e-10) / 448; q = fp8(clamp(x / s))
 * fp8() rounds to nearest even and saturates to +-448 (cvt ... satfinite),
 * infinities included, which is what clamp() first gives; NaN encodes as
 * 0x7f. The group quantizer's division is __fdiv_rn's (mx_fp8_div). amax and
 * the max() of the formulas propagate NaN, as the CPU engine does
 * (csrc/cpu/fp8.h): a NaN in the data gives a NaN scale (and all-NaN q)
 * rather than a silently finite one; an infinite amax stays infinite. */
#ifndef MOE_EXT_CUDA_FP8_CUH
#define MOE_EXT_CUDA_FP8_CUH

#include <cuda_fp8.h>

#include "common.cuh"
#include "experts.cuh"

namespace {

constexpr float kFp8Max = 448.0f;
constexpr int kFp8Block = MX_FP8_BLOCK; /* 128: K slice of a block scale, activation group */

/* fp8(clamp(v)): the saturating conversion gives what clamping first would
 * (every value past +-448, infinities included, rounds to +-448; NaN stays
 * NaN), so no clamp is spelled out. */
__device__ __forceinline__ uint8_t mx_fp8_encode(float v)
{
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

/* fp8(clamp(v0)) | fp8(clamp(v1)) << 8, one conversion for both */
__device__ __forceinline__ uint16_t mx_fp8_encode2(float v0, float v1)
{
    return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(v0, v1), __NV_SATFINITE, __NV_E4M3));
}

/* The group quantizer's x / s with the bits of __fdiv_rn, in three
 * instructions per value: the reciprocal r = mx_fp8_div_recip(s) once per
 * scale (the refined MUFU reciprocal of __fdiv_rn's fast path), then
 * q0 = x r and one exact-remainder correction. It is that fast path without
 * its per-value range check (FCHK), which the group scales make moot: s is
 * normal (>= 1e-10 / 448, finite: callers take __fdiv_rn otherwise) and
 * |x| <= 448 s. Quotients under 2^-126 could differ in their last
 * subnormal bit, and those encode to a signed zero either way; the
 * remainder is taken as s q0 - x so that x = -0 keeps its sign. */
__device__ __forceinline__ float mx_fp8_div_recip(float s)
{
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
    return __fmaf_rn(r, __fmaf_rn(r, -s, 1.0f), r);
}

__device__ __forceinline__ float mx_fp8_div(float x, float s, float r)
{
    const float q0 = __fmul_rn(x, r);
    return __fmaf_rn(-r, __fmaf_rn(q0, s, -x), q0);
}

/* fp8(clamp(x / s)) for a group scale s: mx_fp8_div with r =
 * mx_fp8_div_recip(s) while s is finite, else __fdiv_rn (an infinite or NaN
 * amax, which mx_fp8_div's preconditions leave out) */
__device__ __forceinline__ uint8_t mx_fp8_encode_divided(float x, float s, float r)
{
    return mx_fp8_encode(isfinite(s) ? mx_fp8_div(x, s, r) : __fdiv_rn(x, s));
}

/* the same for a pair, one conversion for both (mx_fp8_encode2's layout) */
__device__ __forceinline__ uint16_t mx_fp8_encode2_divided(float x0, float x1, float s, float r)
{
    return isfinite(s) ? mx_fp8_encode2(mx_fp8_div(x0, s, r), mx_fp8_div(x1, s, r))
                       : mx_fp8_encode2(__fdiv_rn(x0, s), __fdiv_rn(x1, s));
}

/* max(a, b) that returns NaN when either is NaN (fmaxf would drop it);
 * equal to fmaxf otherwise. On sm_80 and later one max.NaN instruction (a
 * NaN comes out as the canonical NaN; callers pass amaxes and scales, never
 * -0, so the two agree on zeros too). */
__device__ __forceinline__ float mx_max_nan(float a, float b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a != a ? a : (b != b ? b : (a > b ? a : b));
#endif
}

__device__ __forceinline__ float mx_fp8_tensor_scale(float amax)
{
    return mx_max_nan(__fdiv_rn(amax, kFp8Max), static_cast<float>(1.0 / (448.0 * 512.0)));
}

__device__ __forceinline__ float mx_fp8_block_scale(float amax, int ue8m0)
{
    float sf = __fdiv_rn(mx_max_nan(amax, 1e-4f), kFp8Max);
    if (ue8m0 && isfinite(sf)) {
        /* sf = m * 2^e with m in [0.5, 1): ceil(log2 sf) is e, or e - 1 when
         * sf is a power of two (m == 0.5); exact, unlike log2f */
        int e;
        const float m = frexpf(sf, &e);
        sf = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
    }
    return sf;
}

__device__ __forceinline__ float mx_fp8_group_scale(float amax)
{
    return __fdiv_rn(mx_max_nan(amax, 1e-10f), kFp8Max);
}

/* running amax: max(m, |v|), NaN-propagating */
__device__ __forceinline__ float mx_amax_step(float m, float v) { return mx_max_nan(m, fabsf(v)); }

__device__ __forceinline__ float mx_warp_max(float v)
{
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        v = mx_max_nan(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/* amax of non-negative floats as their bits: unsigned order is float order
 * there, and every positive NaN compares above infinity, so atomicMax on the
 * bits is the NaN-propagating float maximum (order-independent, hence
 * deterministic). v: an amax (>= +0 or a positive NaN). */
__device__ __forceinline__ void mx_atomic_amax(uint32_t *amax_bits, float v)
{
    atomicMax(reinterpret_cast<unsigned int *>(amax_bits), __float_as_uint(v));
}

} /* namespace */

/* Which rows of a matrix a pipeline quantizer looks at. */
typedef enum mx_fp8_rows {
    MX_FP8_ROWS_ALL = 0,    /* every row */
    MX_FP8_ROWS_ROUTED = 1, /* row t = token t, kept when one of its slots has a local expert */
    MX_FP8_ROWS_SORTED = 2, /* row s = sorted position, kept when s < num_tiles * block_m and sorted_ids[s] >= 0 */
} mx_fp8_rows;

typedef struct mx_fp8_row_filter {
    mx_fp8_rows mode;
    const int32_t *topk_ids;   /* ROUTED: [rows, top_k] */
    const int32_t *expert_map; /* ROUTED: [global_experts] or NULL */
    int top_k;
    int64_t global_experts, local_experts;
    const int32_t *sorted_ids; /* SORTED: [rows] */
    const int32_t *num_tiles;  /* SORTED: [1] (device) */
    int block_m;
    /* ROUTED, or NULL: the q rows of row t are q's rows dest_rows[t * top_k + j]
     * that are >= 0 (the sorted rows of its local pairs: GEMM1's A in sorted
     * order, moe_align's pair_rows), not row t; scales stay by row t */
    const int32_t *dest_rows;
    /* rows_quant_tensor_kernel only: let the kernel after it launch before
     * this one waits for the kernel ahead (common.cuh, the act quantizer's
     * exception) */
    int early_dependents;
} mx_fp8_row_filter;

/* Arguments of an FP8 grouped GEMM launch (grouped_gemm_fp8.cuh). Rows are
 * sorted positions s as in mx_gemm_args; with sorted_ids == NULL (LINEAR)
 * row s is row s of a and of out, for s < rows. */
typedef struct mx_fp8_gemm_args {
    const uint8_t *a;           /* fp8 [*, lda]: GEMM1 rows by token (pair / top_k; by s with a_sorted),
                                   GEMM2 by s, LINEAR by row;
                                   16-byte aligned, zero from column k to the next multiple of 16 */
    int64_t lda;                /* multiple of 16 */
    int a_sorted;               /* GEMM1 on the persistent Hopper configs: a by sorted row s (the quantizer
                                   wrote each token's row to its pairs' rows), else by token */
    const float *a_scale;       /* TENSOR: [1]; BLOCK: [*, a_scale_ld], row as for a */
    int64_t a_scale_ld;         /* BLOCK: ceil(k / 128) */
    const uint8_t *w;           /* fp8 [E_local, n_rows, k] row-major, or packed */
    int w_packed;               /* w in the packed layout (abi.h weights_packed): Hopper kernels only */
    const float *w_scale;       /* TENSOR: [E_local]; BLOCK: [E_local, ceil(n_rows / 128), ceil(k / 128)] */
    const void *bias;           /* [E_local, n_rows] in out_dtype, or NULL */
    int64_t n_rows, k, out_cols;
    const int32_t *sorted_ids;  /* [rows_max] pair or -1; NULL for LINEAR */
    const int32_t *tile_expert; /* [tiles] */
    const int32_t *num_tiles;   /* [1] (device) */
    int64_t rows;               /* LINEAR: rows of a and out */
    int64_t pairs;              /* GEMM kinds: the (token, slot) pairs of the tile table, 0 if unknown (a
                                   launch-shape hint of the Hopper decode kernel) */
    const float *topk_weights;  /* [M, top_k] (GEMM2 epilogue) */
    int top_k;
    int activation;             /* mx_activation */
    float swiglu_alpha, swiglu_limit;
    int scale_by_weight;        /* GEMM2: multiply by topk_weights[pair] */
    mx_dtype out_dtype;         /* act dtype: GEMM1 / LINEAR output and bias dtype */
    void *out;                  /* GEMM1: act [rows_max, ldo]; GEMM2: y f32 [splits][M k, ldo] (by sorted row:
                                   [rows_max, ldo]); LINEAR: [rows, ldo] */
    int64_t ldo;
    int vec_out;                /* 1: out rows and base allow 4-element vector stores */
    int y_by_sorted_row;        /* GEMM2: y [rows_max, ldo] by sorted row (mx_gemm_args) */
    uint32_t *amax;             /* GEMM1 with TENSOR: atomicMax of |act| float bits (reset earlier in the stream) */
    uint8_t *act_q;             /* GEMM1 with BLOCK on a Hopper decode config: act quantized in the epilogue
                                   (fp8 [rows_max, act_q_ld], group scales act_q_scale [rows_max,
                                   act_q_scale_ld]) instead of stored to out; required there, else unused */
    int64_t act_q_ld;
    float *act_q_scale;
    int64_t act_q_scale_ld;
    int m_tile_base;            /* set by the launcher */
    int k_splits;               /* GEMM2 split-K (grid z) */
    int64_t k_split_len;        /* multiple of 128, >= k when k_splits == 1 */
    int64_t out_split_stride;   /* elements between y slices */
    int32_t *split_count;       /* persistent Hopper GEMM2: as in mx_gemm_args */
    int split_exact;
    int32_t *units_taken;       /* persistent Hopper GEMMs: as in mx_gemm_args */
} mx_fp8_gemm_args;

#ifdef __cplusplus
extern "C" {
#endif

/* fp8_quant.cu: quantizers of the FP8 pipelines. x [rows, ldx] in dt (F32 /
 * F16 / BF16), q [rows, ldq] float8_e4m3fn with columns [cols, ldq) zeroed;
 * rows the filter rejects are neither read nor written.
 * Per tensor, in two launches: mx_cuda_fp8_rows_amax writes the amax of each
 * of its mx_fp8_amax_parts(rows) blocks to partials (and zeroes *reset, when
 * given, for a later atomic amax), mx_cuda_fp8_rows_quant_tensor takes the
 * amax from partials (or, with partials == NULL, from *amax_bits), writes
 * the scale to *scale and quantizes. Per group: one launch, scales [rows,
 * scale_ld], group columns per scale. */
int mx_fp8_amax_parts(int64_t rows);
mx_status mx_cuda_fp8_rows_amax(const void *x, mx_dtype dt, int64_t rows, int64_t cols, int64_t ldx,
                                const mx_fp8_row_filter *filter, float *partials, uint32_t *reset,
                                cudaStream_t stream);
mx_status mx_cuda_fp8_rows_quant_tensor(const void *x, mx_dtype dt, int64_t rows, int64_t cols, int64_t ldx,
                                        const mx_fp8_row_filter *filter, const float *partials,
                                        const uint32_t *amax_bits, uint8_t *q, int64_t ldq, float *scale,
                                        cudaStream_t stream);
mx_status mx_cuda_fp8_rows_quant_group(const void *x, mx_dtype dt, int64_t rows, int64_t cols, int64_t ldx,
                                       int group, const mx_fp8_row_filter *filter, uint8_t *q, int64_t ldq,
                                       float *scales, int64_t scale_ld, cudaStream_t stream);

/* fp8_quant.cu: an FP8 GEMM's A operand from x, as the GEMM's quant wants
 * it: FP8_BLOCK per row and 128 columns (scales [rows, scale_ld]); FP8_TENSOR
 * per tensor through the two launches above (partials; *reset, when given,
 * zeroed for a later atomic amax; the scale into scales[0]). */
mx_status mx_cuda_fp8_quant_a(const void *x, mx_dtype dt, int64_t rows, int64_t cols, int64_t ldx,
                              const mx_fp8_row_filter *filter, mx_quant quant, float *partials, uint32_t *reset,
                              uint8_t *q, int64_t ldq, float *scales, int64_t scale_ld, cudaStream_t stream);

/* grouped_gemm_fp8.cu: the expert kinds (GATE_UP .. DOWN). tile_config is
 * an mx_fp8_tile_config (gemm_configs_fp8.cuh); aligned_w: w rows and base
 * allow 16-byte loads (else only MX_FP8_TILE_MID is compiled). */
mx_status mx_cuda_grouped_gemm_fp8(const mx_fp8_gemm_args *g, mx_gemm_kind kind, mx_quant quant,
                                   int tile_config, int aligned_w, int64_t m_tiles, cudaStream_t stream);

/* grouped_gemm_fp8_sm90.cu: the expert kinds on Hopper's FP8 wgmma (call
 * only where mx_cuda_sm90_gemm_available()); tile_config one of the SM90
 * configs (gemm_configs_fp8.cuh), tile tables with its block_m, split-K
 * (GEMM2) only with the 16- / 32-token decode configs, act dtype bfloat16 /
 * float16; LINEAR (no tile table, g->rows rows, m_tiles = ceil(rows /
 * block_m)) only with the decode configs. TMA preconditions: k and lda
 * multiples of 16, a and w 16-byte aligned; block scales with GATE_UP need
 * out_cols % 64 == 0. GEMM1 kinds of the persistent configs read g->a by
 * sorted row (m_tiles * 128 rows of lda bytes: experts_fp8.cu quantizes x
 * into them), those of the decode configs by token. */
mx_status mx_cuda_grouped_gemm_fp8_sm90(const mx_fp8_gemm_args *g, mx_gemm_kind kind, mx_quant quant,
                                        int tile_config, int64_t local_experts, int64_t m_tiles,
                                        cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXT_CUDA_FP8_CUH */
