/* Device scope of one engine call: makes the tensor's CUDA device current,
 * fetches the producer's current stream, and restores the caller's device;
 * on the CPU, or in a build without CUDA, it only checks. */
#include "glue.h"

#ifdef MOE_EXT_WITH_CUDA
int mx_enter_device(mx_module_state *st, const mx_tensor *t, mx_device_scope *scope)
{
    scope->swapped = 0;
    scope->stream = NULL;
    if (t->device_type != MX_CUDA)
        return 0;
    mx_status status = mx_cuda_swap_device(t->device_id, &scope->previous);
    if (status.code != MX_OK) {
        mx_raise_status(&status);
        return -1;
    }
    scope->swapped = 1;
    if (mx_current_stream(st, t->device_id, &scope->stream) < 0) {
        int ignored;
        mx_cuda_swap_device(scope->previous, &ignored);
        scope->swapped = 0;
        return -1;
    }
    return 0;
}

void mx_leave_device(mx_device_scope *scope)
{
    if (scope->swapped) {
        int ignored;
        mx_cuda_swap_device(scope->previous, &ignored);
    }
}
#else
int mx_enter_device(mx_module_state *st, const mx_tensor *t, mx_device_scope *scope)
{
    (void)st;
    scope->swapped = 0;
    scope->stream = NULL;
    if (t->device_type == MX_CUDA) {
        PyErr_SetString(PyExc_NotImplementedError, "CUDA tensors: this moe_ext build has no CUDA "
                        "engine (built without nvcc or with MOE_EXT_CUDA=0)");
        return -1;
    }
    return 0;
}

void mx_leave_device(mx_device_scope *scope)
{
    (void)scope;
}
#endif
