/* CPU dense FP8 w8a8 linear (abi.h mx_cpu_fp8_linear, numerics.md "FP8").
 *
 * x [rows, K] in act_dtype (F32 | F16 | BF16); weight [N, K] float8_e4m3fn
 * with weight_scale float32, FP8_TENSOR [1] or FP8_BLOCK [ceil(N/128),
 * ceil(K/128)]; bias [N] in act_dtype or NULL; output [rows, N] in act_dtype:
 *   out = (qx @ qw.T) * sx * sw (+ bias), float32 accumulation (FP8_BLOCK: per
 *   128-column K slice, the partial times sx[row, kb] * sw[nb, kb]), bias
 *   added in float32, rounded once to act_dtype.
 * x is quantized dynamically as in the expert engine: FP8_TENSOR with one
 * scale over all rows (an amax pass before the chunks, so every chunk uses
 * it), FP8_BLOCK per row and 128 columns.
 *
 * Rows go in chunks of plan.chunk (the workspace stays near
 * MX_WORKSPACE_BUDGET); per chunk, in one parallel region: quantize the rows
 * into float32 fp8 values; one work item per MX_LINEAR_ROWS rows of the
 * weight, each read from memory once for all rows of the chunk (gemm.c);
 * bias and rounding per row. Results do not depend on the thread count. */
#include "fp8.h"
#include "gemm.h"

enum { MX_LINEAR_ROWS = 32 }; /* work item: weight rows (output columns) */

#define MX_WORKSPACE_BUDGET ((size_t)64 << 20)
#define MX_ALIGN 64

/* Sizes and workspace offsets: a pure function of the problem. */
typedef struct mx_linear_plan {
    int64_t gx;       /* FP8_BLOCK: 128-column groups of a row; else 0 */
    int64_t chunk;    /* rows per chunk */
    size_t off_x;     /* float [chunk, K]: quantized x */
    size_t off_sx;    /* float [chunk, gx]: FP8_BLOCK scales of x */
    size_t off_y;     /* float [chunk, N]: x @ W.T, scaled */
    size_t bytes;
} mx_linear_plan;

static size_t mx_align_up(size_t n)
{
    return (n + MX_ALIGN - 1) / MX_ALIGN * MX_ALIGN;
}

static int mx_linear_sizes_ok(const mx_fp8_linear_problem *p)
{
    return p->rows >= 0 && p->in_features >= 1 && p->out_features >= 1;
}

/* The plan of a problem whose sizes are usable. */
static mx_linear_plan mx_linear_plan_make(const mx_fp8_linear_problem *p)
{
    const int64_t M = p->rows, K = p->in_features, N = p->out_features;
    mx_linear_plan pl;
    pl.gx = p->quant == MX_QUANT_FP8_BLOCK ? (K + MX_FP8_BLOCK - 1) / MX_FP8_BLOCK : 0;
    /* largest chunk within the budget, then evened out over the chunks */
    const size_t per_row = (size_t)(K + pl.gx + N) * sizeof(float);
    int64_t chunk = (int64_t)(MX_WORKSPACE_BUDGET / per_row);
    chunk = chunk < 1 ? 1 : chunk;
    chunk = chunk < M ? chunk : M;
    if (M > 0) {
        const int64_t nchunks = (M + chunk - 1) / chunk;
        chunk = (M + nchunks - 1) / nchunks;
    }
    pl.chunk = chunk;
    pl.off_x = 0;
    pl.off_sx = mx_align_up((size_t)(chunk * K) * sizeof(float));
    pl.off_y = pl.off_sx + mx_align_up((size_t)(chunk * pl.gx) * sizeof(float));
    pl.bytes = pl.off_y + mx_align_up((size_t)(chunk * N) * sizeof(float));
    return pl;
}

size_t mx_cpu_fp8_linear_workspace_bytes(const mx_fp8_linear_problem *p)
{
    return mx_linear_sizes_ok(p) ? mx_linear_plan_make(p).bytes : 0;
}

static mx_status mx_linear_check(const mx_fp8_linear_problem *p, const void *workspace)
{
    if (p->quant != MX_QUANT_FP8_TENSOR && p->quant != MX_QUANT_FP8_BLOCK)
        return mx_error(MX_ERR_VALUE, "fp8 linear: quant must be FP8_TENSOR or FP8_BLOCK, got %d", (int)p->quant);
    if (p->act_dtype == MX_F64)
        return mx_error(MX_ERR_NOT_IMPLEMENTED, "fp8 linear: float64 is not implemented by the CPU engine "
                                                "(use float32, float16 or bfloat16)");
    if (p->act_dtype != MX_F32 && p->act_dtype != MX_F16 && p->act_dtype != MX_BF16)
        return mx_error(MX_ERR_TYPE, "fp8 linear: act_dtype must be float32, float16 or bfloat16, got %s",
                        mx_dtype_name(p->act_dtype));
    if (!mx_linear_sizes_ok(p))
        return mx_error(MX_ERR_VALUE, "fp8 linear: bad sizes (rows %lld, in_features %lld, out_features %lld)",
                        (long long)p->rows, (long long)p->in_features, (long long)p->out_features);
    if (p->rows > 0 && (!p->x || !p->weight || !p->weight_scale || !p->output || !workspace))
        return mx_error(MX_ERR_VALUE, "fp8 linear: x, weight, weight_scale, output and workspace must not be NULL");
    return mx_ok();
}

mx_status mx_cpu_fp8_linear(const mx_fp8_linear_problem *p, void *workspace)
{
    mx_status st = mx_linear_check(p, workspace);
    if (st.code != MX_OK || p->rows == 0)
        return st;
    const mx_linear_plan plan = mx_linear_plan_make(p);

    const int64_t M = p->rows, K = p->in_features, N = p->out_features;
    const int64_t items = (N + MX_LINEAR_ROWS - 1) / MX_LINEAR_ROWS;
    char *ws = workspace;
    float *x = (float *)(void *)(ws + plan.off_x), *sx = (float *)(void *)(ws + plan.off_sx);
    float *y = (float *)(void *)(ws + plan.off_y);
    const mx_gemm_weights w = {
        .w = p->weight, .dtype = MX_F8E4M3, .K = K, .quant = p->quant, .scale = p->weight_scale,
        .avx2 = mx_gemm_avx2(),
    };
    /* FP8_TENSOR, shared by the team: the amax of x, then its scale */
    float amax = 0.0f, scale = 0.0f;
    const mx_gemm_input in = {
        .x = x, .ld = K, .div = 1, .scale = p->quant == MX_QUANT_FP8_TENSOR ? &scale : sx, .ld_scale = plan.gx,
    };

    MX_OMP(parallel)
    {
        if (p->quant == MX_QUANT_FP8_TENSOR) {
            float local = 0.0f;
            MX_OMP(for schedule(static) nowait)
            for (int64_t i = 0; i < M * K; i++)
                local = mx_amax_step(local, mx_load_f32(p->act_dtype, p->x, i));
            MX_OMP(critical)
            amax = mx_max_nan(amax, local);
            MX_OMP(barrier)
            MX_OMP(single)
            scale = mx_fp8_tensor_scale(amax);
        }
        for (int64_t t0 = 0; t0 < M; t0 += plan.chunk) {
            const int64_t mc = M - t0 < plan.chunk ? M - t0 : plan.chunk;

            MX_OMP(for schedule(static))
            for (int64_t t = 0; t < mc; t++) {
                float *xr = x + t * K;
                for (int64_t i = 0; i < K; i++)
                    xr[i] = mx_load_f32(p->act_dtype, p->x, (t0 + t) * K + i);
                if (p->quant == MX_QUANT_FP8_TENSOR) {
                    const float inv = 1.0f / scale;
                    for (int64_t i = 0; i < K; i++)
                        xr[i] = mx_fp8_round(xr[i] * inv);
                } else {
                    mx_fp8_quant_groups(xr, K, sx + t * plan.gx);
                }
            }

            MX_OMP(for schedule(dynamic))
            for (int64_t it = 0; it < items; it++) {
                const int64_t r0 = it * MX_LINEAR_ROWS;
                mx_gemm_rows(&w, r0, (int)(N - r0 < MX_LINEAR_ROWS ? N - r0 : MX_LINEAR_ROWS), &in, NULL, mc,
                             y + r0, N);
            }

            MX_OMP(for schedule(static))
            for (int64_t t = 0; t < mc; t++)
                for (int64_t n = 0; n < N; n++)
                    mx_store_f32(p->act_dtype, p->output, (t0 + t) * N + n,
                                 p->bias ? y[t * N + n] + mx_load_f32(p->act_dtype, p->bias, n) : y[t * N + n]);
        }
    }
    return st;
}
