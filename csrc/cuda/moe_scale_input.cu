/* apply_router_weight_on_input (top_k == 1): x_scaled = x * w before GEMM1.
 *
 * Operands: x [M, H] and x_scaled [M, H] row-major in the activation dtype;
 * topk_weights float32 [M, top_k], slot 0 used. As in vLLM
 * (`x * topk_weights.to(x.dtype)`), the weight is first rounded to the
 * activation dtype and the product, formed in float32, is rounded again.
 * One thread per element, grid-stride; GEMM1 then gathers from x_scaled. */
#include "common.cuh"
#include "experts.cuh"

namespace {

template <typename T>
__global__ void __launch_bounds__(256)
    moe_scale_input_kernel(const T *__restrict__ x, const float *__restrict__ topk_weights, int64_t tokens,
                           int64_t hidden, int top_k, T *__restrict__ x_scaled)
{
    const int64_t n = tokens * hidden;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t t = i / hidden;
        const float w = mx_to_float(mx_from_float<T>(topk_weights[t * top_k]));
        x_scaled[i] = mx_from_float<T>(mx_to_float(x[i]) * w);
    }
}

template <typename T>
mx_status launch(const void *x, const float *w, int64_t tokens, int64_t hidden, int top_k, void *out,
                 cudaStream_t stream)
{
    const int64_t n = tokens * hidden;
    const int64_t blocks = mx_ceil_div(n, 256) < 65536 ? mx_ceil_div(n, 256) : 65536;
    moe_scale_input_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        static_cast<const T *>(x), w, tokens, hidden, top_k, static_cast<T *>(out));
    return mx_check_launch("moe_scale_input_kernel");
}

} /* namespace */

extern "C" mx_status mx_cuda_moe_scale_input(const void *x, const float *topk_weights, int64_t tokens,
                                             int64_t hidden, int top_k, mx_dtype dtype, void *x_scaled,
                                             cudaStream_t stream)
{
    switch (dtype) {
    case MX_BF16: return launch<__nv_bfloat16>(x, topk_weights, tokens, hidden, top_k, x_scaled, stream);
    case MX_F16: return launch<__half>(x, topk_weights, tokens, hidden, top_k, x_scaled, stream);
    case MX_F32: return launch<float>(x, topk_weights, tokens, hidden, top_k, x_scaled, stream);
    default:
        return mx_status_fail(MX_ERR_TYPE, "moe_scale_input: dtype %s", mx_dtype_name(dtype));
    }
}
