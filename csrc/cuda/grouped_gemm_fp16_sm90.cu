/* float16 instantiation of the Hopper grouped GEMM (grouped_gemm_sm90_impl.cuh
 * describes operands, tiling and pipeline): 2 tile configs x 4 kinds. */
#include "grouped_gemm_sm90_impl.cuh"

extern "C" mx_status mx_cuda_grouped_gemm_fp16_sm90(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config,
                                                    int64_t local_experts, int64_t m_tiles, cudaStream_t stream)
{
    return grouped_gemm_sm90<__half>(g, kind, tile_config, local_experts, m_tiles, stream);
}
