/* Expert-kind instantiations of the FP8 grouped GEMM (grouped_gemm_fp8.cuh
 * describes operands, tiling and pipeline): 4 kinds x {tensor, block}
 * scales x 3 tile configs, plus the byte-wise weight loader for mid. */
#include "grouped_gemm_fp8.cuh"

extern "C" mx_status mx_cuda_grouped_gemm_fp8(const mx_fp8_gemm_args *g, mx_gemm_kind kind, mx_quant quant,
                                              int tile_config, int aligned_w, int64_t m_tiles, cudaStream_t stream)
{
    switch (kind) {
    case MX_GEMM_GATE_UP:
        return launch_fp8_quant<MX_GEMM_GATE_UP>(*g, quant, tile_config, aligned_w, m_tiles, stream);
    case MX_GEMM_GATE_UP_INTERLEAVED:
        return launch_fp8_quant<MX_GEMM_GATE_UP_INTERLEAVED>(*g, quant, tile_config, aligned_w, m_tiles, stream);
    case MX_GEMM_UP:
        return launch_fp8_quant<MX_GEMM_UP>(*g, quant, tile_config, aligned_w, m_tiles, stream);
    case MX_GEMM_DOWN:
        return launch_fp8_quant<MX_GEMM_DOWN>(*g, quant, tile_config, aligned_w, m_tiles, stream);
    default: break;
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_fp8: kind %d is not an expert kind", (int)kind);
}
