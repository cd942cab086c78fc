/* CPU strided copy (abi.h mx_cpu_copy): dst = src elementwise over equal
 * shapes, any strides (in elements, 0-d included). Between F32 / F16 / BF16 /
 * F64 values convert (to F16 / BF16 through float32, as torch does, rounding
 * to nearest even); every other dtype copies only to itself, bit for bit.
 * The copy walks rows of the innermost dimension, in parallel over rows, and
 * converts a row in blocks through a double buffer (exact for every source). */
#include "cpu_common.h"

enum { MX_COPY_BLOCK = 256 }; /* elements per conversion block */

static int mx_is_float(mx_dtype dt)
{
    return dt == MX_F32 || dt == MX_F16 || dt == MX_BF16 || dt == MX_F64;
}

static void mx_read_block(mx_dtype dt, const char *src, int64_t stride, int64_t n, double *out)
{
    switch (dt) {
    case MX_F64:
        for (int64_t i = 0; i < n; i++)
            out[i] = ((const double *)(const void *)src)[i * stride];
        break;
    case MX_F32:
        for (int64_t i = 0; i < n; i++)
            out[i] = ((const float *)(const void *)src)[i * stride];
        break;
    case MX_F16:
        for (int64_t i = 0; i < n; i++)
            out[i] = mx_f16_to_f32(((const uint16_t *)(const void *)src)[i * stride]);
        break;
    default: /* MX_BF16 */
        for (int64_t i = 0; i < n; i++)
            out[i] = mx_bf16_to_f32(((const uint16_t *)(const void *)src)[i * stride]);
        break;
    }
}

static void mx_write_block(mx_dtype dt, char *dst, int64_t stride, int64_t n, const double *in)
{
    switch (dt) {
    case MX_F64:
        for (int64_t i = 0; i < n; i++)
            ((double *)(void *)dst)[i * stride] = in[i];
        break;
    case MX_F32:
        for (int64_t i = 0; i < n; i++)
            ((float *)(void *)dst)[i * stride] = (float)in[i];
        break;
    case MX_F16:
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)(void *)dst)[i * stride] = mx_f32_to_f16((float)in[i]);
        break;
    default: /* MX_BF16 */
        for (int64_t i = 0; i < n; i++)
            ((uint16_t *)(void *)dst)[i * stride] = mx_f32_to_bf16((float)in[i]);
        break;
    }
}

/* Same dtype: move elements of `size` bytes. */
static void mx_move_row(size_t size, char *dst, int64_t ds, const char *src, int64_t ss, int64_t n)
{
    if (ds == 1 && ss == 1) {
        memcpy(dst, src, (size_t)n * size);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + i * ds * (int64_t)size, src + i * ss * (int64_t)size, size);
}

static void mx_format_shape(char *buf, size_t cap, const mx_tensor *t)
{
    size_t used = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < t->ndim && used < cap; d++)
        used += (size_t)snprintf(buf + used, cap - used, d ? ", %lld" : "%lld", (long long)t->shape[d]);
    if (used < cap)
        snprintf(buf + used, cap - used, "]");
}

/* True when t is row-major contiguous. */
static int mx_is_contiguous(const mx_tensor *t)
{
    int64_t expect = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->strides[d] != expect)
            return 0;
        expect *= t->shape[d];
    }
    return 1;
}

mx_status mx_cpu_copy(const mx_tensor *dst, const mx_tensor *src)
{
    if (dst->device_type != MX_CPU || src->device_type != MX_CPU)
        return mx_error(MX_ERR_VALUE, "copy: the CPU engine needs both tensors on the CPU");
    if (dst->ndim < 0 || dst->ndim > MX_MAX_DIMS || src->ndim < 0 || src->ndim > MX_MAX_DIMS)
        return mx_error(MX_ERR_VALUE, "copy: ndim must be in [0, %d], got dst %d and src %d", MX_MAX_DIMS,
                        dst->ndim, src->ndim);
    int same_shape = dst->ndim == src->ndim;
    for (int d = 0; same_shape && d < dst->ndim; d++)
        same_shape = dst->shape[d] == src->shape[d];
    if (!same_shape) {
        char ds[100], ss[100];
        mx_format_shape(ds, sizeof ds, dst);
        mx_format_shape(ss, sizeof ss, src);
        return mx_error(MX_ERR_VALUE, "copy: shape mismatch, dst %s vs src %s", ds, ss);
    }
    const size_t dsize = mx_dtype_size(dst->dtype), ssize = mx_dtype_size(src->dtype);
    if (!dsize || !ssize)
        return mx_error(MX_ERR_TYPE, "copy: unknown dtype code (dst %d, src %d)", (int)dst->dtype, (int)src->dtype);
    const int convert = dst->dtype != src->dtype;
    if (convert && !(mx_is_float(dst->dtype) && mx_is_float(src->dtype)))
        return mx_error(MX_ERR_TYPE, "copy: cannot convert %s to %s (only float32/float16/bfloat16/float64 convert)",
                        mx_dtype_name(src->dtype), mx_dtype_name(dst->dtype));

    int64_t numel = 1;
    for (int d = 0; d < dst->ndim; d++)
        numel *= dst->shape[d];
    if (numel == 0)
        return mx_ok();
    if (!convert && mx_is_contiguous(dst) && mx_is_contiguous(src)) {
        memcpy(dst->data, src->data, (size_t)numel * dsize);
        return mx_ok();
    }

    /* rows of the innermost dimension (a 0-d tensor is one row of one element) */
    const int nd = dst->ndim;
    const int64_t ncol = nd ? dst->shape[nd - 1] : 1;
    const int64_t dcs = nd ? dst->strides[nd - 1] : 1, scs = nd ? src->strides[nd - 1] : 1;
    const int64_t nrow = numel / ncol;

    MX_OMP(parallel for schedule(static) if (numel > 65536))
    for (int64_t row = 0; row < nrow; row++) {
        int64_t doff = 0, soff = 0, rest = row;
        for (int d = nd - 2; d >= 0; d--) {
            int64_t i = rest % dst->shape[d];
            rest /= dst->shape[d];
            doff += i * dst->strides[d];
            soff += i * src->strides[d];
        }
        char *drow = (char *)dst->data + doff * (int64_t)dsize;
        const char *srow = (const char *)src->data + soff * (int64_t)ssize;
        if (!convert) {
            mx_move_row(dsize, drow, dcs, srow, scs, ncol);
            continue;
        }
        double buf[MX_COPY_BLOCK];
        for (int64_t c0 = 0; c0 < ncol; c0 += MX_COPY_BLOCK) {
            int64_t n = ncol - c0 < MX_COPY_BLOCK ? ncol - c0 : MX_COPY_BLOCK;
            mx_read_block(src->dtype, srow + c0 * scs * (int64_t)ssize, scs, n, buf);
            mx_write_block(dst->dtype, drow + c0 * dcs * (int64_t)dsize, dcs, n, buf);
        }
    }
    return mx_ok();
}
