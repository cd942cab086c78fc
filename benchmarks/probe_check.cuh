/* Helpers of the standalone CUDA probes in benchmarks/ (tma_stream_probe.cu,
 * route_probe.cu, l2_side_probe.cu, l2_side_latency.cu): CHECK(call), with
 * which a failed CUDA runtime call prints its error and line and exits the
 * probe, and the setup of a launch of one CTA per SM. */
#ifndef MOE_EXT_BENCHMARKS_PROBE_CHECK_CUH
#define MOE_EXT_BENCHMARKS_PROBE_CHECK_CUH

#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

#define CHECK(call)                                                                                                 \
    do {                                                                                                            \
        cudaError_t e_ = (call);                                                                                    \
        if (e_ != cudaSuccess) {                                                                                    \
            printf("CUDA error %s at line %d\n", cudaGetErrorString(e_), __LINE__);                                 \
            exit(1);                                                                                                \
        }                                                                                                           \
    } while (0)

/* Launches of one CTA per SM (l2_side_probe.cu, l2_side_latency.cu): this
 * much dynamic shared memory leaves no room for a second CTA on an SM. */
constexpr int kOneCtaPerSmSmemBytes = 160 * 1024;

/* Lets `kernel` take kOneCtaPerSmSmemBytes and returns device 0's SM count,
 * at most max_sms: the grid of such a launch. */
template <typename Kernel> int one_cta_per_sm(Kernel kernel, int max_sms)
{
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kOneCtaPerSmSmemBytes));
    return sms < max_sms ? sms : max_sms;
}

#endif /* MOE_EXT_BENCHMARKS_PROBE_CHECK_CUH */
