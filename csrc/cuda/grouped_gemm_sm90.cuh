/* Entry points of the Hopper (sm_90a) grouped GEMM (grouped_gemm_sm90_impl.cuh
 * holds the kernel and describes it). experts.cu calls these in place of
 * mx_cuda_grouped_gemm_bf16 / _fp16 when the plan picked MX_TILE_SM90
 * (gemm_configs.cuh, mx_select_sm90_config) and the operands allow TMA. */
#ifndef MOE_EXT_CUDA_GROUPED_GEMM_SM90_CUH
#define MOE_EXT_CUDA_GROUPED_GEMM_SM90_CUH

#include "experts.cuh"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when the current device runs the sm_90a kernels: compute capability 9.0,
 * sm_90a code in this build, and cuTensorMapEncodeTiled in the driver.
 * Cached per device; no synchronization. */
int mx_cuda_sm90_gemm_available(void);

/* One grouped GEMM (mx_gemm_args as for mx_cuda_grouped_gemm_bf16, tile
 * tables built with block_m = 128, k_splits == 1); tile_config is
 * MX_TILE_SM90 or MX_TILE_SM90_PAIR (gemm_configs.cuh). Preconditions (TMA):
 * g->k, g->n_rows, g->lda multiples of 8; g->a, g->w 16-byte aligned.
 * GEMM1 kinds: a_gathered is scratch of m_tiles * 128 * g->k elements,
 * 16-byte aligned, that receives the gathered rows of g->a; unused for
 * MX_GEMM_DOWN. local_experts: the leading dimension of g->w. */
mx_status mx_cuda_grouped_gemm_bf16_sm90(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config,
                                         int64_t local_experts, void *a_gathered, int64_t m_tiles,
                                         cudaStream_t stream);
mx_status mx_cuda_grouped_gemm_fp16_sm90(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config,
                                         int64_t local_experts, void *a_gathered, int64_t m_tiles,
                                         cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXT_CUDA_GROUPED_GEMM_SM90_CUH */
