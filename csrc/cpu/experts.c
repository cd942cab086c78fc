/* CPU experts engine (abi.h mx_cpu_experts, numerics.md "Experts" and "FP8").
 *
 * Operands, all row-major, in act_dtype (F32 | F16 | BF16) unless noted:
 *   hidden_states [M, H]; w13 [E_local, N1, H] with N1 = 2I (gated: gate rows
 *   then up rows, or interleaved gate/up rows for swigluoai) or I (non-gated);
 *   w2 [E_local, H, I]; w13_bias [E_local, N1]; w2_bias [E_local, H];
 *   topk_weights float32 [M, k]; topk_ids int32 [M, k]; expert_map int32
 *   [E_global] (-1: not on this rank); output [M, H].
 *   FP8 (quant != NONE): w13, w2 float8_e4m3fn; w13_scale / w2_scale float32,
 *   FP8_TENSOR [E_local], FP8_BLOCK [E_local, ceil(N1/128), ceil(H/128)] and
 *   [E_local, ceil(H/128), ceil(I/128)].
 *
 * Both GEMMs are "x times weight rows": out[n] = dot(x, W[n, :]), computed by
 * gemm.c (each work item reads its weight rows from memory once). Tokens are
 * processed in chunks of plan.chunk tokens (the workspace stays near
 * MX_WORKSPACE_BUDGET whatever M is). Per chunk, inside one parallel region:
 *   1. x rows -> float32 (times the router weight, rounded to act_dtype, when
 *      it goes on the input); FP8: quantized (the float32 of the fp8 values);
 *   2. a stable counting sort groups the chunk's (token, slot) pairs by local
 *      expert;
 *   3. GEMM1 + bias + activation, one work item per (expert, MX_COLS1
 *      activation columns); a rounded to act_dtype;
 *   4. FP8: a quantized (FP8_TENSOR after an amax reduction over the pairs);
 *   5. GEMM2 + bias, one work item per (expert, MX_ROWS2 rows of H) -> y in
 *      float32;
 *   6. out_t = sum over slots, in slot order, of w * y in float32, rounded once.
 *
 * FP8 activation quantization (numerics.md "FP8"), over the rows of local
 * experts only: FP8_BLOCK quantizes per row and 128 columns, row by row;
 * FP8_TENSOR uses one scale per GEMM input over the whole call, so all chunks
 * share it: before the chunks, an amax pass over the x rows of tokens with a
 * local expert gives the GEMM1 scale. The GEMM2 scale needs every activation
 * row: a first pass runs steps 1-3 of every chunk but the last for their
 * amax alone; the last chunk then runs in full, completing the amax between
 * steps 3 and 4, and the other chunks run again in full (with one chunk, no
 * GEMM1 is repeated; with more, all but one chunk's are, and the workspace
 * stays bounded). Amax reductions combine per-thread maxima, exact in any
 * order. Work items own
 * disjoint outputs and their arithmetic does not depend on the thread that
 * runs them, so results are the same for any thread count. */
#include "fp8.h"
#include "gemm.h"

enum {
    MX_COLS1 = 16, /* GEMM1 work item: activation columns (2x weight rows when gated) */
    MX_ROWS2 = 32, /* GEMM2 work item: rows of w2 */
};

#define MX_WORKSPACE_BUDGET ((size_t)64 << 20)
#define MX_ALIGN 64

/* Sizes and workspace offsets: a pure function of the problem. */
typedef struct mx_plan {
    int64_t n1;       /* rows of w13 per expert: 2I or I */
    int64_t ld_hy;    /* row stride of the h / y buffer: max(n1, H) */
    int64_t gx, ga;   /* FP8_BLOCK: 128-column groups of x (H) and of a (I); else 0 */
    int64_t chunk;    /* tokens per chunk */
    int64_t nchunks;
    size_t off_x;     /* float [chunk, H]: x in float32, then the output accumulator */
    size_t off_hy;    /* float [chunk * k, ld_hy]: h after GEMM1, y after GEMM2 */
    size_t off_a;     /* float [chunk * k, I]: activation output (act_dtype values) */
    size_t off_sx;    /* float [chunk, gx]: FP8_BLOCK scales of x */
    size_t off_sa;    /* float [chunk * k, ga]: FP8_BLOCK scales of a */
    size_t off_slot;  /* int32 [chunk * k]: local expert of each pair, -1 if none */
    size_t off_order; /* int32 [chunk * k]: pairs sorted by local expert */
    size_t off_start; /* int32 [E_local + 1]: first sorted pair of each expert */
    size_t off_active;/* int32 [E_local]: experts with pairs in this chunk */
    size_t bytes;
} mx_plan;

/* Everything a work item reads, resolved once per call. */
typedef struct mx_ctx {
    const mx_experts_problem *p;
    const mx_plan *plan;
    int avx2;
    size_t esize;     /* bytes of an act_dtype element */
    mx_dtype wdt;     /* dtype of w13 / w2: act_dtype, or F8E4M3 */
    int64_t H, I, k;
    float *x, *hy, *a, *sx, *sa;
    int32_t *slot, *order, *start, *active;
    int64_t n_active;
    /* FP8_TENSOR, shared by all threads: amax accumulators and the scales */
    float x_amax, a_amax, x_scale, a_scale;
} mx_ctx;

static size_t mx_align_up(size_t n)
{
    return (n + MX_ALIGN - 1) / MX_ALIGN * MX_ALIGN;
}

static size_t mx_plan_layout(mx_plan *pl, const mx_experts_problem *p, int64_t chunk)
{
    const size_t pairs = (size_t)(chunk * p->top_k), E = (size_t)p->num_local_experts;
    size_t off = 0;
    pl->chunk = chunk;
    pl->off_x = off;
    off += mx_align_up((size_t)(chunk * p->hidden_size) * sizeof(float));
    pl->off_hy = off;
    off += mx_align_up(pairs * (size_t)pl->ld_hy * sizeof(float));
    pl->off_a = off;
    off += mx_align_up(pairs * (size_t)p->intermediate_size * sizeof(float));
    pl->off_sx = off;
    off += mx_align_up((size_t)(chunk * pl->gx) * sizeof(float));
    pl->off_sa = off;
    off += mx_align_up(pairs * (size_t)pl->ga * sizeof(float));
    pl->off_slot = off;
    off += mx_align_up(pairs * sizeof(int32_t));
    pl->off_order = off;
    off += mx_align_up(pairs * sizeof(int32_t));
    pl->off_start = off;
    off += mx_align_up((E + 1) * sizeof(int32_t));
    pl->off_active = off;
    off += mx_align_up(E * sizeof(int32_t));
    pl->bytes = off;
    return off;
}

/* 1 when the sizes are usable (the rest is checked in mx_cpu_experts). */
static int mx_plan_make(mx_plan *pl, const mx_experts_problem *p)
{
    const int64_t M = p->num_tokens, H = p->hidden_size, I = p->intermediate_size;
    if (M < 0 || H < 1 || I < 1 || p->top_k < 1 || p->num_local_experts < 0 ||
        p->num_local_experts > INT32_MAX)
        return 0;
    pl->n1 = p->is_act_and_mul ? 2 * I : I;
    pl->ld_hy = pl->n1 > H ? pl->n1 : H;
    const int block = p->quant == MX_QUANT_FP8_BLOCK;
    pl->gx = block ? (H + MX_FP8_BLOCK - 1) / MX_FP8_BLOCK : 0;
    pl->ga = block ? (I + MX_FP8_BLOCK - 1) / MX_FP8_BLOCK : 0;
    /* largest chunk within the budget, then evened out over the chunks */
    mx_plan one = {.n1 = pl->n1, .ld_hy = pl->ld_hy, .gx = pl->gx, .ga = pl->ga};
    const size_t fixed = mx_plan_layout(&one, p, 0);
    const size_t per_token = mx_plan_layout(&one, p, 1) - fixed + MX_ALIGN;
    int64_t chunk = MX_WORKSPACE_BUDGET > fixed ? (int64_t)((MX_WORKSPACE_BUDGET - fixed) / per_token) : 1;
    chunk = chunk < 1 ? 1 : chunk;
    /* pairs are indexed by int32 */
    chunk = chunk < INT32_MAX / p->top_k ? chunk : INT32_MAX / p->top_k;
    chunk = chunk < M ? chunk : M;
    pl->nchunks = 0;
    if (M > 0) {
        pl->nchunks = (M + chunk - 1) / chunk;
        chunk = (M + pl->nchunks - 1) / pl->nchunks;
    }
    mx_plan_layout(pl, p, chunk);
    return 1;
}

size_t mx_cpu_experts_workspace_bytes(const mx_experts_problem *p)
{
    mx_plan pl;
    return mx_plan_make(&pl, p) ? pl.bytes : 0;
}

/* ---- activations ---------------------------------------------------------- */

static float mx_sigmoid(float v)
{
    return 1.0f / (1.0f + expf(-v));
}

static float mx_silu(float v)
{
    return v * mx_sigmoid(v);
}

static float mx_gelu(float v)
{
    return 0.5f * v * (1.0f + erff(v * 0.70710678118654752440f));
}

/* Non-gated activation (applied to h). */
static float mx_act1(mx_activation act, float v)
{
    switch (act) {
    case MX_ACT_SILU: return mx_silu(v);
    case MX_ACT_GELU: return mx_gelu(v);
    default: { /* MX_ACT_RELU2 */
        const float r = v > 0.0f ? v : 0.0f;
        return r * r;
    }
    }
}

/* Gated activation of (gate, up); comparisons keep NaN as NaN. */
static float mx_act2(const mx_experts_problem *p, float gate, float up)
{
    switch (p->activation) {
    case MX_ACT_SILU: return mx_silu(gate) * up;
    case MX_ACT_GELU: return mx_gelu(gate) * up;
    default: { /* MX_ACT_SWIGLUOAI */
        const float lim = p->swiglu_limit;
        const float g = gate > lim ? lim : gate;
        const float u = up > lim ? lim : (up < -lim ? -lim : up);
        return (u + 1.0f) * (g * mx_sigmoid(p->swiglu_alpha * g));
    }
    }
}

/* ---- work items ----------------------------------------------------------- */

/* Local expert e's matrix w [E_local, rows, K] (with its scales) for gemm.c. */
static mx_gemm_weights mx_expert_weights(const mx_ctx *c, const void *w, const float *scale, int64_t e, int64_t rows,
                                         int64_t K)
{
    const mx_quant quant = c->p->quant;
    const int64_t nscale = quant == MX_QUANT_FP8_BLOCK
                               ? (rows + MX_FP8_BLOCK - 1) / MX_FP8_BLOCK * ((K + MX_FP8_BLOCK - 1) / MX_FP8_BLOCK)
                               : 1;
    return (mx_gemm_weights){
        .w = (const char *)w + (size_t)(e * rows * K) * mx_dtype_size(c->wdt),
        .dtype = c->wdt,
        .K = K,
        .quant = quant,
        .scale = quant == MX_QUANT_NONE ? NULL : scale + e * nscale,
        .avx2 = c->avx2,
    };
}

/* GEMM1 for activation columns [i0, i0 + nc) of local expert e, then bias,
 * activation and rounding into a. */
static void mx_item_gemm1(const mx_ctx *c, int32_t e, int64_t i0, int nc)
{
    const mx_experts_problem *p = c->p;
    const int64_t H = c->H, I = c->I, n1 = c->plan->n1, ld = c->plan->ld_hy;
    const int32_t *pairs = c->order + c->start[e];
    const int64_t np = c->start[e + 1] - c->start[e];
    const mx_gemm_weights w = mx_expert_weights(c, p->w13, p->w13_scale, e, n1, H);
    const mx_gemm_input x = {
        .x = c->x, .ld = H, .div = c->k,
        .scale = p->quant == MX_QUANT_FP8_TENSOR ? &c->x_scale : c->sx, .ld_scale = c->plan->gx,
    };
    const int interleaved = p->is_act_and_mul && p->activation == MX_ACT_SWIGLUOAI;

    if (interleaved) {
        mx_gemm_rows(&w, 2 * i0, 2 * nc, &x, pairs, np, c->hy + 2 * i0, ld);
    } else {
        mx_gemm_rows(&w, i0, nc, &x, pairs, np, c->hy + i0, ld);
        if (p->is_act_and_mul)
            mx_gemm_rows(&w, I + i0, nc, &x, pairs, np, c->hy + I + i0, ld);
    }

    const void *bias = p->w13_bias ? (const char *)p->w13_bias + (size_t)(e * n1) * c->esize : NULL;
    for (int64_t n = 0; n < np; n++) {
        const float *h = c->hy + pairs[n] * ld;
        float *a = c->a + pairs[n] * I;
        for (int64_t i = i0; i < i0 + nc; i++) {
            float v;
            if (p->is_act_and_mul) {
                const int64_t ig = interleaved ? 2 * i : i, iu = interleaved ? 2 * i + 1 : I + i;
                float gate = h[ig], up = h[iu];
                if (bias) {
                    gate += mx_load_f32(p->act_dtype, bias, ig);
                    up += mx_load_f32(p->act_dtype, bias, iu);
                }
                v = mx_act2(p, gate, up);
            } else {
                v = mx_act1(p->activation, bias ? h[i] + mx_load_f32(p->act_dtype, bias, i) : h[i]);
            }
            a[i] = mx_round_to(p->act_dtype, v);
        }
    }
}

/* GEMM2 for output rows [r0, r0 + nr) of local expert e, then bias, into y. */
static void mx_item_gemm2(const mx_ctx *c, int32_t e, int64_t r0, int nr)
{
    const mx_experts_problem *p = c->p;
    const int64_t H = c->H, I = c->I, ld = c->plan->ld_hy;
    const int32_t *pairs = c->order + c->start[e];
    const int64_t np = c->start[e + 1] - c->start[e];
    const mx_gemm_weights w = mx_expert_weights(c, p->w2, p->w2_scale, e, H, I);
    const mx_gemm_input a = {
        .x = c->a, .ld = I, .div = 1,
        .scale = p->quant == MX_QUANT_FP8_TENSOR ? &c->a_scale : c->sa, .ld_scale = c->plan->ga,
    };

    mx_gemm_rows(&w, r0, nr, &a, pairs, np, c->hy + r0, ld);
    if (!p->w2_bias)
        return;
    const void *bias = (const char *)p->w2_bias + (size_t)(e * H) * c->esize;
    for (int64_t n = 0; n < np; n++) {
        float *y = c->hy + pairs[n] * ld;
        for (int64_t r = r0; r < r0 + nr; r++)
            y[r] += mx_load_f32(p->act_dtype, bias, r);
    }
}

/* ---- phases ----------------------------------------------------------------- */

/* Element i of token tg's x row as GEMM1 takes it before any quantization:
 * times the router weight, rounded to act_dtype, when it goes on the input. */
static float mx_x_at(const mx_ctx *c, int64_t tg, int64_t i)
{
    const mx_experts_problem *p = c->p;
    const float v = mx_load_f32(p->act_dtype, p->hidden_states, tg * c->H + i);
    return p->apply_router_weight_on_input ? mx_round_to(p->act_dtype, v * p->topk_weights[tg * c->k]) : v;
}

/* x row of chunk token t (global token tg) into float32, quantized with FP8. */
static void mx_load_x(const mx_ctx *c, int64_t t, int64_t tg)
{
    float *x = c->x + t * c->H;
    for (int64_t i = 0; i < c->H; i++)
        x[i] = mx_x_at(c, tg, i);
    if (c->p->quant == MX_QUANT_FP8_TENSOR) {
        const float inv = 1.0f / c->x_scale;
        for (int64_t i = 0; i < c->H; i++)
            x[i] = mx_fp8_round(x[i] * inv);
    } else if (c->p->quant == MX_QUANT_FP8_BLOCK) {
        mx_fp8_quant_groups(x, c->H, c->sx + t * c->plan->gx);
    }
}

/* Adds this thread's maximum to *amax once all threads have (call from
 * every thread of the team, after its share of a "for nowait" loop). */
static void mx_amax_combine(float *amax, float local)
{
    MX_OMP(critical)
    *amax = mx_max_nan(*amax, local);
    MX_OMP(barrier)
}

/* FP8_TENSOR: x_scale from the amax of the x rows of tokens with at least one
 * local expert, over all tokens. */
static void mx_x_scale(mx_ctx *c)
{
    const mx_experts_problem *p = c->p;
    float local = 0.0f;
    MX_OMP(for schedule(static) nowait)
    for (int64_t t = 0; t < p->num_tokens; t++) {
        int local_expert = 0;
        for (int64_t j = 0; j < c->k && !local_expert; j++)
            local_expert = !p->expert_map || p->expert_map[p->topk_ids[t * c->k + j]] >= 0;
        if (local_expert)
            for (int64_t i = 0; i < c->H; i++)
                local = mx_amax_step(local, mx_x_at(c, t, i));
    }
    mx_amax_combine(&c->x_amax, local);
    MX_OMP(single)
    c->x_scale = mx_fp8_tensor_scale(c->x_amax);
}

/* FP8_TENSOR: the amax of the activation rows of the chunk's npairs pairs
 * with a local expert joins a_amax. */
static void mx_a_amax(mx_ctx *c, int64_t npairs)
{
    float local = 0.0f;
    MX_OMP(for schedule(static) nowait)
    for (int64_t q = 0; q < npairs; q++)
        if (c->slot[q] >= 0)
            for (int64_t i = 0; i < c->I; i++)
                local = mx_amax_step(local, c->a[q * c->I + i]);
    mx_amax_combine(&c->a_amax, local);
}

/* Quantizes the activation row of pair q in place. */
static void mx_quant_a(const mx_ctx *c, int64_t q)
{
    float *a = c->a + q * c->I;
    if (c->p->quant == MX_QUANT_FP8_TENSOR) {
        const float inv = 1.0f / c->a_scale;
        for (int64_t i = 0; i < c->I; i++)
            a[i] = mx_fp8_round(a[i] * inv);
    } else {
        mx_fp8_quant_groups(a, c->I, c->sa + q * c->plan->ga);
    }
}

/* Stable counting sort of the chunk's pairs by local expert. */
static void mx_sort_pairs(mx_ctx *c, int64_t t0, int64_t mc)
{
    const mx_experts_problem *p = c->p;
    const int64_t E = p->num_local_experts, npairs = mc * c->k;
    const int32_t *ids = p->topk_ids + t0 * c->k;

    memset(c->start, 0, (size_t)(E + 1) * sizeof(int32_t));
    for (int64_t q = 0; q < npairs; q++) {
        const int32_t e = p->expert_map ? p->expert_map[ids[q]] : ids[q];
        c->slot[q] = e;
        if (e >= 0)
            c->start[e + 1]++;
    }
    c->n_active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (c->start[e + 1] > 0)
            c->active[c->n_active++] = (int32_t)e;
        c->start[e + 1] += c->start[e];
    }
    /* fill using start[e] as a cursor, then shift the cursors back */
    for (int64_t q = 0; q < npairs; q++)
        if (c->slot[q] >= 0)
            c->order[c->start[c->slot[q]]++] = (int32_t)q;
    for (int64_t e = E; e > 0; e--)
        c->start[e] = c->start[e - 1];
    c->start[0] = 0;
}

/* out row of chunk token t (global tg) = sum over its slots of w * y, rounded. */
static void mx_combine(const mx_ctx *c, int64_t t, int64_t tg)
{
    const mx_experts_problem *p = c->p;
    const int64_t H = c->H;
    float *acc = c->x + t * H;
    memset(acc, 0, (size_t)H * sizeof(float));
    for (int64_t j = 0; j < c->k; j++) {
        const int64_t q = t * c->k + j;
        if (c->slot[q] < 0)
            continue;
        const float w = p->apply_router_weight_on_input ? 1.0f : p->topk_weights[tg * c->k + j];
        const float *y = c->hy + q * c->plan->ld_hy;
        for (int64_t i = 0; i < H; i++)
            acc[i] += w * y[i];
    }
    char *out = (char *)p->output + (size_t)(tg * H) * c->esize;
    if (p->act_dtype == MX_F32) {
        memcpy(out, acc, (size_t)H * sizeof(float));
    } else if (p->act_dtype == MX_BF16) {
        for (int64_t i = 0; i < H; i++)
            ((uint16_t *)(void *)out)[i] = mx_f32_to_bf16(acc[i]);
    } else {
        for (int64_t i = 0; i < H; i++)
            ((uint16_t *)(void *)out)[i] = mx_f32_to_f16(acc[i]);
    }
}

/* How much of a chunk to run (FP8_TENSOR splits the work around the GEMM2
 * scale). */
typedef enum mx_pass {
    MX_PASS_AMAX,        /* up to GEMM1, adding the activations' amax to a_amax */
    MX_PASS_AMAX_OUTPUT, /* the same, then a_scale from the complete amax, then the rest */
    MX_PASS_OUTPUT,      /* everything, with a_scale (FP8_TENSOR) already known */
} mx_pass;

/* Chunk number ic (tokens [t0, t0 + mc)), run by every thread of the team. */
static void mx_run_chunk(mx_ctx *c, int64_t ic, mx_pass pass)
{
    const mx_experts_problem *p = c->p;
    const int64_t chunk = c->plan->chunk, t0 = ic * chunk;
    const int64_t mc = p->num_tokens - t0 < chunk ? p->num_tokens - t0 : chunk;
    const int64_t H = c->H, I = c->I, npairs = mc * c->k;
    const int64_t blocks1 = (I + MX_COLS1 - 1) / MX_COLS1, blocks2 = (H + MX_ROWS2 - 1) / MX_ROWS2;

    MX_OMP(for schedule(static))
    for (int64_t t = 0; t < mc; t++)
        mx_load_x(c, t, t0 + t);

    MX_OMP(single)
    mx_sort_pairs(c, t0, mc);

    MX_OMP(for schedule(dynamic))
    for (int64_t it = 0; it < c->n_active * blocks1; it++) {
        const int64_t i0 = it % blocks1 * MX_COLS1;
        mx_item_gemm1(c, c->active[it / blocks1], i0, (int)(I - i0 < MX_COLS1 ? I - i0 : MX_COLS1));
    }

    if (pass != MX_PASS_OUTPUT) {
        mx_a_amax(c, npairs);
        if (pass == MX_PASS_AMAX)
            return;
        MX_OMP(single)
        c->a_scale = mx_fp8_tensor_scale(c->a_amax);
    }
    if (p->quant != MX_QUANT_NONE) {
        MX_OMP(for schedule(static))
        for (int64_t q = 0; q < npairs; q++)
            if (c->slot[q] >= 0)
                mx_quant_a(c, q);
    }

    MX_OMP(for schedule(dynamic))
    for (int64_t it = 0; it < c->n_active * blocks2; it++) {
        const int64_t r0 = it % blocks2 * MX_ROWS2;
        mx_item_gemm2(c, c->active[it / blocks2], r0, (int)(H - r0 < MX_ROWS2 ? H - r0 : MX_ROWS2));
    }

    MX_OMP(for schedule(static))
    for (int64_t t = 0; t < mc; t++)
        mx_combine(c, t, t0 + t);
}

/* ---- entry point -------------------------------------------------------- */

static mx_status mx_check(const mx_experts_problem *p, const void *workspace)
{
    if (p->act_dtype == MX_F64)
        return mx_error(MX_ERR_NOT_IMPLEMENTED, "experts: float64 is not implemented by the CPU engine "
                                                "(use float32, float16 or bfloat16)");
    if (p->act_dtype != MX_F32 && p->act_dtype != MX_F16 && p->act_dtype != MX_BF16)
        return mx_error(MX_ERR_TYPE, "experts: act_dtype must be float32, float16 or bfloat16, got %s",
                        mx_dtype_name(p->act_dtype));
    if (p->num_tokens < 0 || p->hidden_size < 1 || p->intermediate_size < 1 || p->top_k < 1 ||
        p->num_local_experts < 0 || p->num_local_experts > INT32_MAX || p->global_num_experts < 1)
        return mx_error(MX_ERR_VALUE, "experts: bad sizes (num_tokens %lld, hidden_size %lld, intermediate_size %lld, "
                        "top_k %d, num_local_experts %lld, global_num_experts %lld)",
                        (long long)p->num_tokens, (long long)p->hidden_size, (long long)p->intermediate_size,
                        p->top_k, (long long)p->num_local_experts, (long long)p->global_num_experts);
    const int gated_only = p->activation == MX_ACT_SWIGLUOAI, plain_only = p->activation == MX_ACT_RELU2;
    if ((unsigned)p->activation > MX_ACT_RELU2 || (gated_only && !p->is_act_and_mul) ||
        (plain_only && p->is_act_and_mul))
        return mx_error(MX_ERR_NOT_IMPLEMENTED, "experts: activation %d with is_act_and_mul = %d is not supported",
                        (int)p->activation, p->is_act_and_mul);
    if ((unsigned)p->quant > MX_QUANT_FP8_BLOCK)
        return mx_error(MX_ERR_VALUE, "experts: unknown quant %d", (int)p->quant);
    if (p->quant != MX_QUANT_NONE && (!p->w13_scale || !p->w2_scale))
        return mx_error(MX_ERR_VALUE, "experts: FP8 weights need w13_scale and w2_scale");
    if (p->apply_router_weight_on_input && p->top_k != 1)
        return mx_error(MX_ERR_VALUE, "experts: apply_router_weight_on_input needs top_k == 1, got %d", p->top_k);
    if (p->num_tokens > 0 && !workspace)
        return mx_error(MX_ERR_VALUE, "experts: workspace is NULL");

    const int64_t k = p->top_k, Eg = p->global_num_experts, El = p->num_local_experts;
    for (int64_t q = 0; q < p->num_tokens * k; q++) {
        const int32_t id = p->topk_ids[q];
        if (id < 0 || id >= Eg)
            return mx_error(MX_ERR_VALUE, "topk_ids[%lld, %lld] = %d is outside [0, %lld)", (long long)(q / k),
                            (long long)(q % k), (int)id, (long long)Eg);
        const int32_t e = p->expert_map ? p->expert_map[id] : id;
        if (p->expert_map && (e < -1 || e >= El))
            return mx_error(MX_ERR_VALUE, "expert_map[%d] = %d is outside [-1, %lld)", (int)id, (int)e,
                            (long long)El);
        if (!p->expert_map && e >= El)
            return mx_error(MX_ERR_VALUE, "topk_ids[%lld, %lld] = %d but there are %lld local experts and no expert_map",
                            (long long)(q / k), (long long)(q % k), (int)id, (long long)El);
    }
    return mx_ok();
}

mx_status mx_cpu_experts(const mx_experts_problem *p, void *workspace)
{
    if (p->weights_packed)
        return mx_error(MX_ERR_NOT_IMPLEMENTED, "experts: weights in the packed Hopper layout are read by the "
                        "sm_90 CUDA kernels only (call the layer's process_weights_after_loading() on the "
                        "device it runs on)");
    if (p->routing && p->num_tokens > 0) {
        mx_status routed = mx_cpu_route(p->routing);
        if (routed.code != MX_OK)
            return routed;
    }
    mx_status st = mx_check(p, workspace);
    if (st.code != MX_OK)
        return st;
    mx_plan plan;
    mx_plan_make(&plan, p);
    if (p->num_tokens == 0)
        return st;

    char *ws = workspace;
    mx_ctx c = {
        .p = p,
        .plan = &plan,
        .avx2 = mx_gemm_avx2(),
        .esize = mx_dtype_size(p->act_dtype),
        .wdt = p->quant == MX_QUANT_NONE ? p->act_dtype : MX_F8E4M3,
        .H = p->hidden_size,
        .I = p->intermediate_size,
        .k = p->top_k,
        .x = (float *)(void *)(ws + plan.off_x),
        .hy = (float *)(void *)(ws + plan.off_hy),
        .a = (float *)(void *)(ws + plan.off_a),
        .sx = (float *)(void *)(ws + plan.off_sx),
        .sa = (float *)(void *)(ws + plan.off_sa),
        .slot = (int32_t *)(void *)(ws + plan.off_slot),
        .order = (int32_t *)(void *)(ws + plan.off_order),
        .start = (int32_t *)(void *)(ws + plan.off_start),
        .active = (int32_t *)(void *)(ws + plan.off_active),
        .n_active = 0,
        .x_amax = 0.0f,
        .a_amax = 0.0f,
        .x_scale = 0.0f,
        .a_scale = 0.0f,
    };
    const int64_t last = plan.nchunks - 1;
    /* Below about a million multiply-adds, waking the thread team costs more than it saves. */
    const int parallel = (double)p->num_tokens * p->top_k * (double)c.H * (double)c.I * 3.0 >=
                         MX_PARALLEL_MIN_WORK;
    (void)parallel; /* unused without OpenMP */

    MX_OMP(parallel if (parallel))
    {
        if (p->quant == MX_QUANT_FP8_TENSOR) {
            mx_x_scale(&c);
            for (int64_t ic = 0; ic < last; ic++)
                mx_run_chunk(&c, ic, MX_PASS_AMAX);
            mx_run_chunk(&c, last, MX_PASS_AMAX_OUTPUT);
            for (int64_t ic = 0; ic < last; ic++)
                mx_run_chunk(&c, ic, MX_PASS_OUTPUT);
        } else {
            for (int64_t ic = 0; ic <= last; ic++)
                mx_run_chunk(&c, ic, MX_PASS_OUTPUT);
        }
    }
    return st;
}
