/* float16 instantiation of the Hopper grouped GEMM (grouped_gemm_sm90_impl.cuh
 * describes operands, tiling and pipeline): one tile config x 4 kinds. */
#include "grouped_gemm_sm90_impl.cuh"

extern "C" mx_status mx_cuda_grouped_gemm_fp16_sm90(const mx_gemm_args *g, mx_gemm_kind kind, int64_t local_experts,
                                                    void *a_gathered, int64_t m_tiles, cudaStream_t stream)
{
    return grouped_gemm_sm90<__half, mx_tile_sm90>(g, kind, local_experts, a_gathered, m_tiles, stream);
}
