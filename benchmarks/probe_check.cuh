/* CHECK(call) for the standalone CUDA probes in benchmarks/ (tma_stream_probe.cu,
 * route_probe.cu, l2_side_probe.cu, l2_side_latency.cu): a failed CUDA runtime
 * call prints its error and line and exits the probe. */
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

#endif /* MOE_EXT_BENCHMARKS_PROBE_CHECK_CUH */
