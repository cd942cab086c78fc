/* Device queries of the CUDA engine. */
#include "common.cuh"
#include "grouped_gemm_sm90.cuh"

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

/* 1 when `device` runs this build's sm_90a kernels (mx_cuda_sm90_gemm_available
 * asked with that device current; the caller's device is restored). */
extern "C" int mx_cuda_sm90_kernels(int device)
{
    int previous = 0, ignored = 0;
    if (mx_cuda_swap_device(device, &previous).code != MX_OK) {
        cudaGetLastError();
        return 0;
    }
    const int yes = mx_cuda_sm90_gemm_available();
    mx_cuda_swap_device(previous, &ignored);
    return yes;
}
