/* CPU experts engine (abi.h mx_cpu_experts, numerics.md "Experts").
 *
 * Operands, all row-major, in act_dtype (F32 | F16 | BF16) unless noted:
 *   hidden_states [M, H]; w13 [E_local, N1, H] with N1 = 2I (gated: gate rows
 *   then up rows, or interleaved gate/up rows for swigluoai) or I (non-gated);
 *   w2 [E_local, H, I]; w13_bias [E_local, N1]; w2_bias [E_local, H];
 *   topk_weights float32 [M, k]; topk_ids int32 [M, k]; expert_map int32
 *   [E_global] (-1: not on this rank); output [M, H].
 *
 * Both GEMMs are "x times weight rows": out[n] = dot(x, W[n, :]). Tokens are
 * processed in chunks of plan.chunk tokens (the workspace stays near
 * MX_WORKSPACE_BUDGET whatever M is). Per chunk, inside one parallel region:
 *   1. x rows -> float32 (times the router weight, rounded to act_dtype, when
 *      it goes on the input);
 *   2. a stable counting sort groups the chunk's (token, slot) pairs by local
 *      expert;
 *   3. GEMM1 + bias + activation, one work item per (expert, MX_COLS1
 *      activation columns); a rounded to act_dtype;
 *   4. GEMM2 + bias, one work item per (expert, MX_ROWS2 rows of H) -> y in
 *      float32;
 *   5. out_t = sum over slots, in slot order, of w * y in float32, rounded once.
 * A work item reads its weight rows from memory once. The register tile
 * (4 weight rows x up to 3 pairs) converts weights to float32 as it loads
 * them and prefetches the item's next 4 rows meanwhile. An expert with more
 * than 3 pairs in the chunk keeps the float32 rows of that first pass in a
 * stack block (MX_WBUF_FLOATS, L1-resident) and feeds its other pairs from
 * there. Decode (1-4 pairs per expert) is therefore bound by weight reads;
 * prefill reuses every converted block across all of the expert's pairs.
 * Work items own disjoint outputs and their arithmetic does not depend on the
 * thread that runs them, so results are the same for any thread count.
 *
 * On x86-64 with GCC/Clang the tile has an AVX2 + FMA + F16C version picked
 * at run time (the build needs no -march); elsewhere, and on CPUs without
 * AVX2, portable C. */
#include <math.h>

#include "cpu_common.h"

enum {
    MX_TILE_ROWS = 4,      /* register tile: weight rows ... */
    MX_TILE_PAIRS = 3,     /* ... times pairs (12 accumulators of 8 floats) */
    MX_KC_MAX = 2048,      /* longest K slice of a block (longer rows go in slices) */
    MX_WBUF_PAD = 16,      /* floats between kept rows: no 4 KiB aliasing of stores and loads */
    MX_WBUF_FLOATS = MX_TILE_ROWS * (MX_KC_MAX + MX_WBUF_PAD), /* kept block: ~32 KiB, L1 */
    MX_COLS1 = 16,         /* GEMM1 work item: activation columns (2x weight rows when gated) */
    MX_ROWS2 = 32,         /* GEMM2 work item: rows of w2 */
};

#define MX_WORKSPACE_BUDGET ((size_t)64 << 20)
#define MX_ALIGN 64

#if defined(__x86_64__) && defined(__GNUC__)
#define MX_HAVE_AVX2_PATH 1
#include <cpuid.h>
#include <immintrin.h>
#define MX_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MX_INLINE_AVX2 static inline __attribute__((always_inline)) MX_AVX2
#else
#define MX_HAVE_AVX2_PATH 0
#endif

/* Sizes and workspace offsets: a pure function of the problem. */
typedef struct mx_plan {
    int64_t n1;       /* rows of w13 per expert: 2I or I */
    int64_t ld_hy;    /* row stride of the h / y buffer: max(n1, H) */
    int64_t chunk;    /* tokens per chunk */
    size_t off_x;     /* float [chunk, H]: x in float32, then the output accumulator */
    size_t off_hy;    /* float [chunk * k, ld_hy]: h after GEMM1, y after GEMM2 */
    size_t off_a;     /* float [chunk * k, I]: activation output (act_dtype values) */
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
    size_t esize;
    int64_t H, I, k;
    float *x, *hy, *a;
    int32_t *slot, *order, *start, *active;
    int64_t n_active;
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
    /* largest chunk within the budget, then evened out over the chunks */
    mx_plan one;
    one.n1 = pl->n1;
    one.ld_hy = pl->ld_hy;
    const size_t fixed = mx_plan_layout(&one, p, 0);
    const size_t per_token = mx_plan_layout(&one, p, 1) - fixed + MX_ALIGN;
    int64_t chunk = MX_WORKSPACE_BUDGET > fixed ? (int64_t)((MX_WORKSPACE_BUDGET - fixed) / per_token) : 1;
    chunk = chunk < 1 ? 1 : chunk;
    /* pairs are indexed by int32 */
    chunk = chunk < INT32_MAX / p->top_k ? chunk : INT32_MAX / p->top_k;
    chunk = chunk < M ? chunk : M;
    if (M > 0) {
        const int64_t nchunks = (M + chunk - 1) / chunk;
        chunk = (M + nchunks - 1) / nchunks;
    }
    mx_plan_layout(pl, p, chunk);
    return 1;
}

size_t mx_cpu_experts_workspace_bytes(const mx_experts_problem *p)
{
    mx_plan pl;
    return mx_plan_make(&pl, p) ? pl.bytes : 0;
}

/* ---- kernels: the register tile ------------------------------------------ */

/* Every tile computes out[r][p] = dot(W_r[0:K], x_p[0:K]) for r < 4 weight
 * rows and p < np pairs. W_r is in wdt (F32 | F16 | BF16), read straight from
 * memory and converted in registers, so weight loads and FMAs interleave.
 * With wstore, the float32 rows are also written to wstore + r * ldstore for
 * the expert's further pairs. A nonzero pf (bytes) prefetches the same
 * columns pf bytes past each row, i.e. the next rows of the work item: rows
 * shorter than a page share pages, which the hardware prefetcher tracks
 * poorly. */
typedef void (*mx_tile_fn)(const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS], int64_t K,
                           float *wstore, int64_t ldstore, ptrdiff_t pf, float out[MX_TILE_ROWS][MX_TILE_PAIRS]);

/* Sum of the 8 lanes in the order the AVX2 reduction uses. */
static float mx_lanes_sum(const float v[8])
{
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

static void mx_tile_generic(mx_dtype wdt, const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS],
                            int np, int64_t K, float *wstore, int64_t ldstore,
                            float out[MX_TILE_ROWS][MX_TILE_PAIRS])
{
    /* no prefetch here: the portable path favours simplicity */
    float acc[MX_TILE_ROWS][MX_TILE_PAIRS][8], wv[MX_TILE_ROWS][8];
    memset(acc, 0, sizeof acc);
    int64_t k0 = 0;
    for (; k0 + 8 <= K; k0 += 8) {
        for (int r = 0; r < MX_TILE_ROWS; r++)
            for (int l = 0; l < 8; l++)
                wv[r][l] = mx_load_f32(wdt, w[r], k0 + l);
        if (wstore)
            for (int r = 0; r < MX_TILE_ROWS; r++)
                memcpy(wstore + r * ldstore + k0, wv[r], sizeof wv[r]);
        for (int r = 0; r < MX_TILE_ROWS; r++)
            for (int p = 0; p < np; p++)
                for (int l = 0; l < 8; l++)
                    acc[r][p][l] += wv[r][l] * x[p][k0 + l];
    }
    for (int r = 0; r < MX_TILE_ROWS; r++) {
        for (int p = 0; p < np; p++) {
            float s = mx_lanes_sum(acc[r][p]);
            for (int64_t i = k0; i < K; i++)
                s += mx_load_f32(wdt, w[r], i) * x[p][i];
            out[r][p] = s;
        }
        if (wstore)
            for (int64_t i = k0; i < K; i++)
                wstore[r * ldstore + i] = mx_load_f32(wdt, w[r], i);
    }
}

#if MX_HAVE_AVX2_PATH
MX_INLINE_AVX2 float mx_hsum_avx2(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 weights from element k of row w, as float32. */
MX_INLINE_AVX2 __m256 mx_load8_avx2(mx_dtype wdt, const void *w, int64_t k)
{
    if (wdt == MX_F32)
        return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)w + k));
    if (wdt == MX_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* As mx_tile_generic. WDT and NP are constants after inlining, so the 4 x NP
 * accumulators stay in registers (12 + 3 + 1 of the 16 ymm at NP = 3). */
MX_INLINE_AVX2 void mx_tile_avx2(mx_dtype WDT, const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS],
                                 int NP, int64_t K, float *wstore, int64_t ldstore, ptrdiff_t pf,
                                 float out[MX_TILE_ROWS][MX_TILE_PAIRS])
{
    const int64_t esize = WDT == MX_F32 ? 4 : 2, line = 64 / esize; /* elements per cache line */
    __m256 acc[MX_TILE_ROWS][MX_TILE_PAIRS];
    for (int r = 0; r < MX_TILE_ROWS; r++)
        for (int p = 0; p < NP; p++)
            acc[r][p] = _mm256_setzero_ps();
    int64_t k0 = 0;
    for (; k0 + 8 <= K; k0 += 8) {
        __m256 xv[MX_TILE_PAIRS];
        for (int p = 0; p < NP; p++)
            xv[p] = _mm256_loadu_ps(x[p] + k0);
        for (int r = 0; r < MX_TILE_ROWS; r++) {
            const __m256 wv = mx_load8_avx2(WDT, w[r], k0);
            if (pf && k0 % line == 0)
                _mm_prefetch((const char *)w[r] + pf + k0 * esize, _MM_HINT_T0);
            if (wstore)
                _mm256_storeu_ps(wstore + r * ldstore + k0, wv);
            for (int p = 0; p < NP; p++)
                acc[r][p] = _mm256_fmadd_ps(wv, xv[p], acc[r][p]);
        }
    }
    for (int r = 0; r < MX_TILE_ROWS; r++) {
        for (int p = 0; p < NP; p++) {
            float s = mx_hsum_avx2(acc[r][p]);
            for (int64_t i = k0; i < K; i++)
                s += mx_load_f32(WDT, w[r], i) * x[p][i];
            out[r][p] = s;
        }
        if (wstore)
            for (int64_t i = k0; i < K; i++)
                wstore[r * ldstore + i] = mx_load_f32(WDT, w[r], i);
    }
}

/* One instantiation per (weight dtype, pairs, store or not). */
#define MX_TILE_AVX2_DEF(name, WDT, NP, STORE)                                                                  \
    MX_AVX2 static void name(const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS], int64_t K, \
                             float *wstore, int64_t ldstore, ptrdiff_t pf,                             \
                             float out[MX_TILE_ROWS][MX_TILE_PAIRS])                                   \
    {                                                                                                          \
        mx_tile_avx2(WDT, w, x, NP, K, STORE ? wstore : NULL, ldstore, pf, out);                               \
    }
#define MX_TILE_AVX2_DEFS(prefix, WDT, STORE)        \
    MX_TILE_AVX2_DEF(prefix##_1, WDT, 1, STORE)      \
    MX_TILE_AVX2_DEF(prefix##_2, WDT, 2, STORE)      \
    MX_TILE_AVX2_DEF(prefix##_3, WDT, 3, STORE)

MX_TILE_AVX2_DEFS(mx_tile_f32, MX_F32, 0)
MX_TILE_AVX2_DEFS(mx_tile_f16, MX_F16, 0)
MX_TILE_AVX2_DEFS(mx_tile_bf16, MX_BF16, 0)
MX_TILE_AVX2_DEFS(mx_tile_f16_store, MX_F16, 1)
MX_TILE_AVX2_DEFS(mx_tile_bf16_store, MX_BF16, 1)

/* [store][wdt][np - 1]; float32 rows are never stored (they are reused in place) */
static const mx_tile_fn mx_tiles_avx2[2][3][MX_TILE_PAIRS] = {
    {
        [MX_F32] = {mx_tile_f32_1, mx_tile_f32_2, mx_tile_f32_3},
        [MX_F16] = {mx_tile_f16_1, mx_tile_f16_2, mx_tile_f16_3},
        [MX_BF16] = {mx_tile_bf16_1, mx_tile_bf16_2, mx_tile_bf16_3},
    },
    {
        [MX_F32] = {mx_tile_f32_1, mx_tile_f32_2, mx_tile_f32_3},
        [MX_F16] = {mx_tile_f16_store_1, mx_tile_f16_store_2, mx_tile_f16_store_3},
        [MX_BF16] = {mx_tile_bf16_store_1, mx_tile_bf16_store_2, mx_tile_bf16_store_3},
    },
};

/* AVX2 and FMA (with OS support, per __builtin_cpu_supports) and F16C
 * (CPUID.1:ECX bit 29; Clang's __builtin_cpu_supports lacks "f16c"). */
static int mx_cpu_has_avx2(void)
{
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 29)))
        return 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

static void mx_tile(int avx2, mx_dtype wdt, const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS],
                    int np, int64_t K, float *wstore, int64_t ldstore, ptrdiff_t pf,
                    float out[MX_TILE_ROWS][MX_TILE_PAIRS])
{
#if MX_HAVE_AVX2_PATH
    if (avx2) {
        mx_tiles_avx2[wstore != NULL][wdt][np - 1](w, x, K, wstore, ldstore, pf, out);
        return;
    }
#else
    (void)avx2;
    (void)pf;
#endif
    mx_tile_generic(wdt, w, x, np, K, wstore, ldstore, out);
}

/* ---- one work item's GEMM ------------------------------------------------ */

/* For the np pairs in `pairs` and rows [row0, row0 + nrows) of the weight
 * matrix w [*, K] (act_dtype):
 *   d[q * ldd + r] = dot(W[row0 + r, :], x[(q / x_div) * ldx, :])
 * with q = pairs[i]. Rows go in blocks of nb rows x kc columns, nb a multiple
 * of 4 with nb * (kc + MX_WBUF_PAD) <= MX_WBUF_FLOATS; K > MX_KC_MAX goes in
 * slices whose partial dots add up in d. The first tile of pairs reads a
 * block from memory; with more pairs it also keeps the block in float32 in
 * wbuf for the rest, so each weight is read from memory and converted once. */
static void mx_rows_dot(const mx_ctx *c, const void *w, int64_t K, int64_t row0, int nrows, const float *x,
                        int64_t ldx, int64_t x_div, float *d, int64_t ldd, const int32_t *pairs, int64_t np)
{
    _Alignas(MX_ALIGN) float wbuf[MX_WBUF_FLOATS];
    const mx_dtype dt = c->p->act_dtype;
    const int keep = np > MX_TILE_PAIRS && dt != MX_F32;
    const int64_t kc_max = K < MX_KC_MAX ? K : MX_KC_MAX, ldk = kc_max + MX_WBUF_PAD;
    int nb = (int)(MX_WBUF_FLOATS / ldk);
    nb -= nb % MX_TILE_ROWS;

    for (int rb = 0; rb < nrows; rb += nb) {
        const int nr = nrows - rb < nb ? nrows - rb : nb;
        for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
            const int64_t kc = K - k0 < kc_max ? K - k0 : kc_max;
            for (int64_t p0 = 0; p0 < np; p0 += MX_TILE_PAIRS) {
                const int tp = np - p0 < MX_TILE_PAIRS ? (int)(np - p0) : MX_TILE_PAIRS;
                const int from_buf = keep && p0 > 0;
                const float *xs[MX_TILE_PAIRS];
                for (int j = 0; j < MX_TILE_PAIRS; j++)
                    xs[j] = x + (pairs[p0 + (j < tp ? j : tp - 1)] / x_div) * ldx + k0;
                for (int r0 = 0; r0 < nr; r0 += MX_TILE_ROWS) {
                    const int tr = nr - r0 < MX_TILE_ROWS ? nr - r0 : MX_TILE_ROWS;
                    const void *ws[MX_TILE_ROWS];
                    float out[MX_TILE_ROWS][MX_TILE_PAIRS];
                    for (int i = 0; i < MX_TILE_ROWS; i++) {
                        const int r = r0 + (i < tr ? i : tr - 1);
                        ws[i] = from_buf ? (const void *)(wbuf + r * ldk)
                                         : (const void *)((const char *)w + (size_t)((row0 + rb + r) * K + k0) * c->esize);
                    }
                    /* prefetch the next 4 rows while they are in this call */
                    const ptrdiff_t pf = !from_buf && rb + r0 + 2 * MX_TILE_ROWS <= nrows
                                             ? (ptrdiff_t)(MX_TILE_ROWS * K * (int64_t)c->esize) : 0;
                    mx_tile(c->avx2, from_buf ? MX_F32 : dt, ws, xs, tp, kc,
                            keep && p0 == 0 ? wbuf + r0 * ldk : NULL, ldk, pf, out);
                    for (int j = 0; j < tp; j++) {
                        float *dq = d + pairs[p0 + j] * ldd + rb + r0;
                        for (int i = 0; i < tr; i++)
                            dq[i] = k0 ? dq[i] + out[i][j] : out[i][j];
                    }
                }
            }
        }
    }
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

/* GEMM1 for activation columns [i0, i0 + nc) of local expert e, then bias,
 * activation and rounding into a. */
static void mx_item_gemm1(const mx_ctx *c, int32_t e, int64_t i0, int nc)
{
    const mx_experts_problem *p = c->p;
    const int64_t H = c->H, I = c->I, n1 = c->plan->n1, ld = c->plan->ld_hy;
    const int32_t *pairs = c->order + c->start[e];
    const int64_t np = c->start[e + 1] - c->start[e];
    const void *w = (const char *)p->w13 + (size_t)(e * n1 * H) * c->esize;
    const int interleaved = p->is_act_and_mul && p->activation == MX_ACT_SWIGLUOAI;

    if (interleaved) {
        mx_rows_dot(c, w, H, 2 * i0, 2 * nc, c->x, H, c->k, c->hy + 2 * i0, ld, pairs, np);
    } else {
        mx_rows_dot(c, w, H, i0, nc, c->x, H, c->k, c->hy + i0, ld, pairs, np);
        if (p->is_act_and_mul)
            mx_rows_dot(c, w, H, I + i0, nc, c->x, H, c->k, c->hy + I + i0, ld, pairs, np);
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
    const void *w = (const char *)p->w2 + (size_t)(e * H * I) * c->esize;

    mx_rows_dot(c, w, I, r0, nr, c->a, I, 1, c->hy + r0, ld, pairs, np);
    if (!p->w2_bias)
        return;
    const void *bias = (const char *)p->w2_bias + (size_t)(e * H) * c->esize;
    for (int64_t n = 0; n < np; n++) {
        float *y = c->hy + pairs[n] * ld;
        for (int64_t r = r0; r < r0 + nr; r++)
            y[r] += mx_load_f32(p->act_dtype, bias, r);
    }
}

/* ---- phases of one chunk ---------------------------------------------------- */

/* x row of chunk token t (global token tg) into float32. */
static void mx_load_x(const mx_ctx *c, int64_t t, int64_t tg)
{
    const mx_experts_problem *p = c->p;
    float *x = c->x + t * c->H;
    const void *src = (const char *)p->hidden_states + (size_t)(tg * c->H) * c->esize;
    const float w = p->apply_router_weight_on_input ? p->topk_weights[tg * c->k] : 1.0f;
    for (int64_t i = 0; i < c->H; i++)
        x[i] = p->apply_router_weight_on_input ? mx_round_to(p->act_dtype, mx_load_f32(p->act_dtype, src, i) * w)
                                               : mx_load_f32(p->act_dtype, src, i);
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
        .avx2 = 0,
        .esize = mx_dtype_size(p->act_dtype),
        .H = p->hidden_size,
        .I = p->intermediate_size,
        .k = p->top_k,
        .x = (float *)(void *)(ws + plan.off_x),
        .hy = (float *)(void *)(ws + plan.off_hy),
        .a = (float *)(void *)(ws + plan.off_a),
        .slot = (int32_t *)(void *)(ws + plan.off_slot),
        .order = (int32_t *)(void *)(ws + plan.off_order),
        .start = (int32_t *)(void *)(ws + plan.off_start),
        .active = (int32_t *)(void *)(ws + plan.off_active),
        .n_active = 0,
    };
#if MX_HAVE_AVX2_PATH
    c.avx2 = mx_cpu_has_avx2();
#endif
    const int64_t M = p->num_tokens, H = c.H, I = c.I;
    const int64_t blocks1 = (I + MX_COLS1 - 1) / MX_COLS1, blocks2 = (H + MX_ROWS2 - 1) / MX_ROWS2;

    MX_OMP(parallel)
    for (int64_t t0 = 0; t0 < M; t0 += plan.chunk) {
        const int64_t mc = M - t0 < plan.chunk ? M - t0 : plan.chunk;

        MX_OMP(for schedule(static))
        for (int64_t t = 0; t < mc; t++)
            mx_load_x(&c, t, t0 + t);

        MX_OMP(single)
        mx_sort_pairs(&c, t0, mc);

        MX_OMP(for schedule(dynamic))
        for (int64_t it = 0; it < c.n_active * blocks1; it++) {
            const int64_t i0 = it % blocks1 * MX_COLS1;
            mx_item_gemm1(&c, c.active[it / blocks1], i0, (int)(I - i0 < MX_COLS1 ? I - i0 : MX_COLS1));
        }

        MX_OMP(for schedule(dynamic))
        for (int64_t it = 0; it < c.n_active * blocks2; it++) {
            const int64_t r0 = it % blocks2 * MX_ROWS2;
            mx_item_gemm2(&c, c.active[it / blocks2], r0, (int)(H - r0 < MX_ROWS2 ? H - r0 : MX_ROWS2));
        }

        MX_OMP(for schedule(static))
        for (int64_t t = 0; t < mc; t++)
            mx_combine(&c, t, t0 + t);
    }
    return st;
}
