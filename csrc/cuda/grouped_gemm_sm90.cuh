/* Entry points of the Hopper (sm_90a) grouped GEMMs: the persistent kernel
 * (grouped_gemm_sm90_impl.cuh) and the decode kernel
 * (grouped_gemm_sm90_decode.cuh), which describe themselves. experts.cu and
 * experts_fp8.cu call these in place of the mma.sync GEMMs when the plan
 * picked an SM90 config (gemm_configs.cuh mx_select_sm90_config,
 * gemm_configs_fp8.cuh mx_fp8_select_sm90_config) and the operands allow
 * TMA; fp8_linear.cu for moe_ext.Linear. */
#ifndef MOE_EXT_CUDA_GROUPED_GEMM_SM90_CUH
#define MOE_EXT_CUDA_GROUPED_GEMM_SM90_CUH

#include "experts.cuh"

/* FP8 scale operands of the Hopper kernels (numerics.md "FP8"); all NULL /
 * 0 for 16-bit operands. */
typedef struct mx_sm90_scales {
    const float *a_scale; /* TENSOR [1]; BLOCK [*, a_ld]: row = token (GEMM1) or sorted row s (DOWN) */
    int64_t a_ld;         /* BLOCK: ceil(k / 128) */
    const float *w_scale; /* TENSOR [E_local]; BLOCK [E_local, w_rows, w_ld] (128x128 blocks) */
    int64_t w_rows;       /* BLOCK: ceil(n_rows / 128) */
    int64_t w_ld;         /* BLOCK: ceil(k / 128) */
    uint32_t *amax;       /* GEMM1 with TENSOR: atomic amax of the stored act values (float bits) */
    uint8_t *act_q;       /* block-scale GEMM1 of the decode kernel's small tiles and of the persistent
                             kernel's gated 128x256 tiles: act quantized in the epilogue, fp8 [rows,
                             act_q_ld] by sorted row s, with its group scales (per row and 128 columns) at
                             act_q_scale [rows, act_q_scale_ld]; out is not written */
    int64_t act_q_ld;
    float *act_q_scale;
    int64_t act_q_scale_ld;
} mx_sm90_scales;

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when the current device runs the sm_90a kernels: compute capability 9.0,
 * sm_90a code in this build, and cuTensorMapEncodeTiled in the driver.
 * Cached per device; no synchronization. */
int mx_cuda_sm90_gemm_available(void);

/* One grouped GEMM (mx_gemm_args as for mx_cuda_grouped_gemm_bf16, tile
 * tables built with block_m = 128; k_splits > 1 only for GEMM2, as the
 * most k slices, with split_count: grouped_gemm_sm90_impl.cuh); tile_config is
 * MX_TILE_SM90 or MX_TILE_SM90_PAIR (gemm_configs.cuh). Preconditions (TMA):
 * g->k, g->n_rows, g->lda multiples of 8; g->a, g->w 16-byte aligned.
 * GEMM1 kinds read the rows of g->a by token (sorted_ids[s] / top_k) in
 * the kernel. local_experts: the leading dimension of g->w. */
mx_status mx_cuda_grouped_gemm_bf16_sm90(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config,
                                         int64_t local_experts, int64_t m_tiles, cudaStream_t stream);
mx_status mx_cuda_grouped_gemm_fp16_sm90(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config,
                                         int64_t local_experts, int64_t m_tiles, cudaStream_t stream);

/* grouped_gemm_sm90_decode.cu: the decode kernel (few rows per expert,
 * operands swapped) for the decode tile configs (mx_tile_is_sm90_decode),
 * tile tables with that config's block_m. quant MX_QUANT_NONE: 16-bit
 * operands in act_dtype (bf16 / fp16), sc may be NULL; FP8 quants: e4m3
 * operands, act dtype bf16 / fp16 for outputs and biases, sc the scales.
 * Split-K (GEMM2 only) from g->k_splits / k_split_len (whole 128-byte k
 * blocks, exact count). TMA preconditions as for the kernels above (16-byte
 * rows and bases; block scales with GATE_UP need out_cols % 64 == 0). GEMM1
 * kinds read g->a by token (row sorted_ids[s] / top_k); no gather scratch. */
mx_status mx_cuda_grouped_gemm_sm90_decode(const mx_gemm_args *g, const mx_sm90_scales *sc, mx_gemm_kind kind,
                                           mx_dtype act_dtype, mx_quant quant, int tile_config,
                                           int64_t local_experts, int64_t m_tiles, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXT_CUDA_GROUPED_GEMM_SM90_CUH */
