/* bfloat16 instantiation of the Hopper grouped GEMM (grouped_gemm_sm90_impl.cuh
 * describes operands, tiling and pipeline): 2 tile configs x 4 kinds, plus
 * the availability probe shared with the float16 file. */
#include "grouped_gemm_sm90_impl.cuh"

extern "C" int mx_cuda_sm90_gemm_available(void)
{
    static std::atomic<int> state[64];
    return mx_device_property(state, [](int device) {
        int major = 0, minor = 0;
        cudaFuncAttributes attr;
        memset(&attr, 0, sizeof attr);
        const bool sm90 =
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
            major == 9 && minor == 0 &&
            cudaFuncGetAttributes(&attr, grouped_gemm_sm90_kernel<__nv_bfloat16, __nv_bfloat16, mx_tile_sm90,
                                                                  MX_GEMM_DOWN, MX_QUANT_NONE, false, false>) ==
                cudaSuccess;
        /* The code the device runs must come from the sm_90a pass: PTX JIT-compiled
         * from an older virtual architecture reports ptxVersion < 90 and holds
         * only the trapping stub. (A build targeting plain sm_90 without the 'a'
         * suffix would also hold the stub; setup.py builds 90a.) */
        return sm90 && attr.binaryVersion == 90 && attr.ptxVersion >= 90 && sm90_encode_tiled() != nullptr;
    });
}

extern "C" mx_status mx_cuda_grouped_gemm_bf16_sm90(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config,
                                                    int64_t local_experts, int64_t m_tiles, cudaStream_t stream)
{
    return grouped_gemm_sm90<__nv_bfloat16>(g, kind, tile_config, local_experts, m_tiles, stream);
}
