/* CPU FP8 quantizers (abi.h mx_cpu_fp8_quant, numerics.md "FP8").
 *
 * x (F32 | F16 | BF16, contiguous) -> q float8_e4m3fn bytes of the same shape
 * and float32 scales; every step in float32 in the order numerics.md gives,
 * so the CUDA engine and a torch rendering of the formulas agree bit for bit:
 *   PER_TENSOR      x [batch, n] (rows == 1, n = cols): per slice b,
 *                   scale[b] = max(amax / 448, 1 / (448 * 512)) (or as given
 *                   with scale_given), inv = 1 / scale[b],
 *                   q = fp8(clamp(x * inv, -448, 448));
 *   PER_BLOCK       x [batch, rows, cols], blocks block_rows x block_cols (the
 *                   edge blocks hold only the real elements):
 *                   sf = max(amax, 1e-4) / 448 (use_ue8m0: 2^ceil(log2 sf)),
 *                   q = fp8(x * (1 / sf)); scale [batch, ceil(rows / br),
 *                   ceil(cols / bc)] = sf;
 *   PER_TOKEN_GROUP x [1, rows, cols], per row and block_cols columns:
 *                   s = max(amax, 1e-10) / 448, q = fp8(clamp(x / s, -448, 448))
 *                   (a division, not a reciprocal); scale [rows, ceil(cols / bc)].
 * amax = max |x| ignores nothing: a NaN gives a NaN scale (fp8.h). The clamps
 * are the conversion's saturation. Work is split over slices, blocks or rows;
 * a per-tensor amax is split over the slice and reduced with max, which is
 * exact in any order, so results do not depend on the thread count. */
#include "fp8.h"

enum { MX_QUANT_SPAN = 16384 }; /* elements per work item of a per-tensor slice */

/* amax of x[i0, i1). */
static float mx_amax_range(mx_dtype dt, const void *x, int64_t i0, int64_t i1)
{
    float amax = 0.0f;
    for (int64_t i = i0; i < i1; i++)
        amax = mx_amax_step(amax, mx_load_f32(dt, x, i));
    return amax;
}

static void mx_quant_tensor(const mx_fp8_quant_problem *p)
{
    const int64_t n = p->cols, spans = (n + MX_QUANT_SPAN - 1) / MX_QUANT_SPAN;
    float amax = 0.0f; /* shared: the current slice's amax */

    MX_OMP(parallel)
    for (int64_t b = 0; b < p->batch; b++) {
        const void *x = (const char *)p->x + (size_t)(b * n) * mx_dtype_size(p->dtype);
        if (!p->scale_given) {
            float local = 0.0f;
            MX_OMP(for schedule(static) nowait)
            for (int64_t s = 0; s < spans; s++) {
                const int64_t i0 = s * MX_QUANT_SPAN;
                local = mx_max_nan(local, mx_amax_range(p->dtype, x, i0, n - i0 < MX_QUANT_SPAN ? n : i0 + MX_QUANT_SPAN));
            }
            MX_OMP(critical)
            amax = mx_max_nan(amax, local);
            MX_OMP(barrier)
            MX_OMP(single)
            {
                p->scale[b] = mx_fp8_tensor_scale(amax);
                amax = 0.0f;
            }
        }
        const float inv = 1.0f / p->scale[b];
        uint8_t *q = p->q + b * n;
        MX_OMP(for schedule(static))
        for (int64_t s = 0; s < spans; s++) {
            const int64_t i0 = s * MX_QUANT_SPAN, i1 = n - i0 < MX_QUANT_SPAN ? n : i0 + MX_QUANT_SPAN;
            for (int64_t i = i0; i < i1; i++)
                q[i] = mx_f32_to_fp8(mx_load_f32(p->dtype, x, i) * inv);
        }
    }
}

static void mx_quant_block(const mx_fp8_quant_problem *p)
{
    const int64_t R = p->rows, C = p->cols, br = p->block_rows, bc = p->block_cols;
    const int64_t nbr = (R + br - 1) / br, nbc = (C + bc - 1) / bc;
    const size_t esize = mx_dtype_size(p->dtype);

    MX_OMP(parallel for schedule(static))
    for (int64_t blk = 0; blk < p->batch * nbr * nbc; blk++) {
        const int64_t b = blk / (nbr * nbc), r0 = blk / nbc % nbr * br, c0 = blk % nbc * bc;
        const int64_t r1 = R - r0 < br ? R : r0 + br, c1 = C - c0 < bc ? C : c0 + bc;
        const char *x = (const char *)p->x + (size_t)(b * R * C) * esize;
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; r++)
            amax = mx_max_nan(amax, mx_amax_range(p->dtype, x, r * C + c0, r * C + c1));
        const float sf = mx_fp8_block_scale(amax, p->use_ue8m0), inv = 1.0f / sf;
        for (int64_t r = r0; r < r1; r++)
            for (int64_t c = c0; c < c1; c++)
                p->q[b * R * C + r * C + c] = mx_f32_to_fp8(mx_load_f32(p->dtype, x, r * C + c) * inv);
        p->scale[blk] = sf;
    }
}

static void mx_quant_token_group(const mx_fp8_quant_problem *p)
{
    const int64_t C = p->cols, bc = p->block_cols, nbc = (C + bc - 1) / bc;

    MX_OMP(parallel for schedule(static))
    for (int64_t g = 0; g < p->rows * nbc; g++) {
        const int64_t r = g / nbc, c0 = g % nbc * bc, c1 = C - c0 < bc ? C : c0 + bc;
        const float s = mx_fp8_group_scale(mx_amax_range(p->dtype, p->x, r * C + c0, r * C + c1));
        for (int64_t c = c0; c < c1; c++)
            p->q[r * C + c] = mx_f32_to_fp8(mx_load_f32(p->dtype, p->x, r * C + c) / s);
        p->scale[g] = s;
    }
}

mx_status mx_cpu_fp8_quant(const mx_fp8_quant_problem *p)
{
    if (p->dtype != MX_F32 && p->dtype != MX_F16 && p->dtype != MX_BF16)
        return mx_error(MX_ERR_TYPE, "fp8 quant: x must be float32, float16 or bfloat16, got %s",
                        mx_dtype_name(p->dtype));
    if (p->batch < 0 || p->rows < 0 || p->cols < 0)
        return mx_error(MX_ERR_VALUE, "fp8 quant: bad shape [%lld, %lld, %lld]", (long long)p->batch,
                        (long long)p->rows, (long long)p->cols);
    switch (p->mode) {
    case MX_FP8_PER_TENSOR:
        if (p->rows != 1)
            return mx_error(MX_ERR_VALUE, "fp8 quant: per-tensor mode takes rows == 1, got %lld", (long long)p->rows);
        break;
    case MX_FP8_PER_BLOCK:
        if (p->block_rows < 1 || p->block_cols < 1)
            return mx_error(MX_ERR_VALUE, "fp8 quant: block %d x %d must be at least 1 x 1", p->block_rows,
                            p->block_cols);
        break;
    case MX_FP8_PER_TOKEN_GROUP:
        if (p->batch != 1 || p->block_cols < 1)
            return mx_error(MX_ERR_VALUE, "fp8 quant: per-token-group mode takes batch == 1 and group_size >= 1, "
                            "got batch %lld, group_size %d", (long long)p->batch, p->block_cols);
        break;
    default:
        return mx_error(MX_ERR_VALUE, "fp8 quant: unknown mode %d", (int)p->mode);
    }
    /* scales are written even for empty slices (per-tensor: the floor) */
    const int64_t nscale = p->mode == MX_FP8_PER_TENSOR ? p->batch : p->batch * p->rows * p->cols;
    if ((p->batch * p->rows * p->cols > 0 && (!p->x || !p->q)) || (nscale > 0 && !p->scale))
        return mx_error(MX_ERR_VALUE, "fp8 quant: x, q and scale must not be NULL");

    if (p->mode == MX_FP8_PER_TENSOR)
        mx_quant_tensor(p);
    else if (p->mode == MX_FP8_PER_BLOCK)
        mx_quant_block(p);
    else
        mx_quant_token_group(p);
    return mx_ok();
}
