/* float16 instantiation of the tensor-core grouped GEMM (grouped_gemm_tc.cuh
 * describes operands, tiling and pipeline): 3 tile configs x 4 kinds x
 * {aligned, unaligned}. */
#include "grouped_gemm_tc.cuh"

extern "C" mx_status mx_cuda_grouped_gemm_fp16(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config,
                                               int aligned, int64_t m_tiles, cudaStream_t stream)
{
    return grouped_gemm_tc<__half>(g, kind, tile_config, aligned, m_tiles, stream);
}
