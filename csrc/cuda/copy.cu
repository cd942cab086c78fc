/* mx_cuda_copy: dst = src elementwise over equal shapes, on one CUDA device.
 *
 * Operands: two strided views (shape and strides in elements, any sign, up
 * to MX_MAX_DIMS dims). Floating dtypes (float32, float16, bfloat16,
 * float64) convert among themselves (round to nearest even; float64 goes to
 * the 16-bit types through float32, as torch does); every other dtype
 * (int32, int64, uint8, int8, float8_e4m3fn, bool) copies only to itself,
 * bit for bit.
 *
 * Paths: both views contiguous with the same dtype -> cudaMemcpyAsync;
 * otherwise one thread per element of a grid-stride loop that turns the
 * linear row-major index into both offsets (64-bit arithmetic). The dtype
 * switch is uniform across the grid, so it does not diverge. */
#include "common.cuh"

namespace {

typedef struct copy_geometry {
    int ndim;
    int64_t shape[MX_MAX_DIMS];
    int64_t dst_strides[MX_MAX_DIMS];
    int64_t src_strides[MX_MAX_DIMS];
} copy_geometry;

__host__ __device__ inline int is_float(mx_dtype dt) { return dt == MX_F32 || dt == MX_F16 || dt == MX_BF16 || dt == MX_F64; }

__host__ __device__ inline size_t elem_size(mx_dtype dt)
{
    switch (dt) {
    case MX_F64:
    case MX_I64: return 8;
    case MX_F32:
    case MX_I32: return 4;
    case MX_F16:
    case MX_BF16: return 2;
    default: return 1;
    }
}

__device__ __forceinline__ double load_float(const void *p, mx_dtype dt, int64_t i)
{
    switch (dt) {
    case MX_F64: return static_cast<const double *>(p)[i];
    case MX_F16: return __half2float(static_cast<const __half *>(p)[i]);
    case MX_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
    }
}

__device__ __forceinline__ void store_float(void *p, mx_dtype dt, int64_t i, double v)
{
    switch (dt) {
    case MX_F64: static_cast<double *>(p)[i] = v; break;
    case MX_F16: static_cast<__half *>(p)[i] = __float2half_rn(static_cast<float>(v)); break;
    case MX_BF16: static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(static_cast<float>(v)); break;
    default: static_cast<float *>(p)[i] = static_cast<float>(v); break;
    }
}

__global__ void __launch_bounds__(256) copy_kernel(void *dst, mx_dtype dst_dtype, const void *src, mx_dtype src_dtype,
                                                   const copy_geometry geo, int64_t numel)
{
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        int64_t rest = i, d_off = 0, s_off = 0;
        for (int d = geo.ndim - 1; d >= 0; --d) {
            const int64_t idx = rest % geo.shape[d];
            rest /= geo.shape[d];
            d_off += idx * geo.dst_strides[d];
            s_off += idx * geo.src_strides[d];
        }
        if (is_float(dst_dtype) && dst_dtype != src_dtype) {
            store_float(dst, dst_dtype, d_off, load_float(src, src_dtype, s_off));
        } else {
            switch (elem_size(dst_dtype)) {
            case 8: static_cast<int64_t *>(dst)[d_off] = static_cast<const int64_t *>(src)[s_off]; break;
            case 4: static_cast<int32_t *>(dst)[d_off] = static_cast<const int32_t *>(src)[s_off]; break;
            case 2: static_cast<uint16_t *>(dst)[d_off] = static_cast<const uint16_t *>(src)[s_off]; break;
            default: static_cast<uint8_t *>(dst)[d_off] = static_cast<const uint8_t *>(src)[s_off]; break;
            }
        }
    }
}

int is_contiguous(const mx_tensor *t)
{
    int64_t expect = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {
        if (t->shape[d] != 1 && t->strides[d] != expect)
            return 0;
        expect *= t->shape[d];
    }
    return 1;
}

} /* namespace */

extern "C" mx_status mx_cuda_copy(const mx_tensor *dst, const mx_tensor *src, void *stream_ptr)
{
    if (dst->device_type != MX_CUDA || src->device_type != MX_CUDA || dst->device_id != src->device_id)
        return mx_status_fail(MX_ERR_VALUE, "copy (CUDA): both tensors must be on one CUDA device "
                              "(dst: type %d id %d, src: type %d id %d)",
                              (int)dst->device_type, dst->device_id, (int)src->device_type, src->device_id);
    if (dst->ndim != src->ndim || dst->ndim < 0 || dst->ndim > MX_MAX_DIMS)
        return mx_status_fail(MX_ERR_VALUE, "copy (CUDA): dst has %d dims, src %d (at most %d)", dst->ndim,
                              src->ndim, MX_MAX_DIMS);
    int64_t numel = 1;
    for (int d = 0; d < dst->ndim; ++d) {
        if (dst->shape[d] != src->shape[d] || dst->shape[d] < 0)
            return mx_status_fail(MX_ERR_VALUE, "copy (CUDA): shapes differ in dim %d (dst %lld, src %lld)", d,
                                  (long long)dst->shape[d], (long long)src->shape[d]);
        numel *= dst->shape[d];
    }
    if (dst->dtype != src->dtype && !(is_float(dst->dtype) && is_float(src->dtype)))
        return mx_status_fail(MX_ERR_TYPE, "copy (CUDA): no conversion from %s to %s", mx_dtype_name(src->dtype),
                              mx_dtype_name(dst->dtype));
    if (numel == 0)
        return mx_status_ok();

    /* Launch on the tensors' device, restoring the caller's current device. */
    int previous = 0;
    mx_status st = mx_check_call(cudaGetDevice(&previous), "cudaGetDevice");
    if (st.code != MX_OK)
        return st;
    if (previous != dst->device_id) {
        st = mx_check_call(cudaSetDevice(dst->device_id), "cudaSetDevice");
        if (st.code != MX_OK)
            return st;
    }

    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    if (dst->dtype == src->dtype && is_contiguous(dst) && is_contiguous(src)) {
        st = mx_check_call(cudaMemcpyAsync(dst->data, src->data, numel * elem_size(dst->dtype),
                                           cudaMemcpyDeviceToDevice, stream),
                           "copy (CUDA): cudaMemcpyAsync");
    } else {
        copy_geometry geo;
        geo.ndim = dst->ndim;
        for (int d = 0; d < dst->ndim; ++d) {
            geo.shape[d] = dst->shape[d];
            geo.dst_strides[d] = dst->strides[d];
            geo.src_strides[d] = src->strides[d];
        }
        const int64_t blocks = mx_ceil_div(numel, 256) < 65536 ? mx_ceil_div(numel, 256) : 65536;
        copy_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(dst->data, dst->dtype, src->data, src->dtype,
                                                                      geo, numel);
        st = mx_check_launch("copy_kernel");
    }
    if (previous != dst->device_id) {
        mx_status restore = mx_check_call(cudaSetDevice(previous), "cudaSetDevice");
        if (st.code == MX_OK)
            st = restore;
    }
    return st;
}
