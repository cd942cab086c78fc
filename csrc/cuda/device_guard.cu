/* Device selection for the glue: every CUDA entry point runs on the device
 * of its tensors, and the caller's current device is restored afterwards. */
#include <cstdio>

#include <cuda_runtime.h>

#include "moe_ext/abi.h"

extern "C" mx_status mx_cuda_swap_device(int device, int *previous)
{
    mx_status status = {MX_OK, ""};
    cudaError_t err = cudaGetDevice(previous);
    if (err == cudaSuccess && *previous != device)
        err = cudaSetDevice(device);
    if (err != cudaSuccess) {
        status.code = MX_ERR_CUDA;
        snprintf(status.message, sizeof status.message, "cudaSetDevice(%d): %s", device,
                 cudaGetErrorString(err));
    }
    return status;
}
