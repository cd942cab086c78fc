/* Device queries of the CUDA engine. */
#include "common.cuh"

/* Number of CUDA devices, 0 when there is no driver or no device (the error
 * is cleared so that it does not surface in a later launch check). */
extern "C" int mx_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}
