/* Row-dot GEMM of the CPU engine (gemm.h mx_gemm_rows): d = x_q . W rows for
 * a work item's rows of one weight matrix and a list of float32 input rows.
 *
 * Weights W [rows, K] are row-major in F32 | F16 | BF16 | F8E4M3 (fp8 with a
 * per-tensor or per-128x128-block float32 scale, numerics.md "FP8"); the
 * inputs are float32 rows (for fp8, the quantized values, with their scales).
 *
 * Rows go in blocks of nb rows x kc columns, nb a multiple of 4 with
 * nb * (kc + MX_WBUF_PAD) <= MX_WBUF_FLOATS; K > MX_KC_MAX goes in slices
 * whose partial dots add up in d. The register tile (4 weight rows x up to 3
 * pairs) converts weights to float32 as it loads them and prefetches the
 * item's next 4 rows meanwhile. With more than 3 pairs, the first tile of
 * pairs also keeps the block's float32 rows in a stack block (L1-resident)
 * and feeds the other pairs from there, so each weight is read from memory and
 * converted once: decode (1-4 pairs) is bound by weight reads, prefill reuses
 * every converted block across all pairs. FP8 block scaling happens inside
 * the tile, at each 128-column slice boundary.
 *
 * On x86-64 with GCC/Clang the tile has an AVX2 + FMA + F16C version picked
 * at run time (the build needs no -march); elsewhere, and on CPUs without
 * AVX2, portable C. The arithmetic of an output does not depend on which
 * thread runs it. */
#include <stdatomic.h>
#include <math.h>

#include "gemm.h"

enum {
    MX_TILE_ROWS = 4,      /* register tile: weight rows ... */
    MX_TILE_PAIRS = 3,     /* ... times pairs (12 accumulators of 8 floats) */
    MX_KC_MAX = 2048,      /* longest K slice of a block (longer rows go in slices); a multiple of 128 */
    MX_WBUF_PAD = 16,      /* floats between kept rows: no 4 KiB aliasing of stores and loads */
    MX_WBUF_FLOATS = MX_TILE_ROWS * (MX_KC_MAX + MX_WBUF_PAD), /* kept block: ~32 KiB, L1 */
};

_Static_assert(MX_KC_MAX % MX_FP8_BLOCK == 0, "K slices must hold whole fp8 scale blocks");

#if defined(__x86_64__) && defined(__GNUC__)
#define MX_HAVE_AVX2_PATH 1
#include <cpuid.h>
#include <immintrin.h>
#define MX_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MX_INLINE_AVX2 static inline __attribute__((always_inline)) MX_AVX2
#else
#define MX_HAVE_AVX2_PATH 0
#endif

/* FP8 tiles read each weight byte S.EEEE.MMM as the float16 S.0EEEE.MMM0000000,
 * i.e. its value / 256 (subnormals included): two integer ops and a
 * float16 conversion in AVX2, no multiply. The scaling step multiplies the
 * dots back by MX_FP8_UNSCALE. With fp8 inputs (multiples of 2^-9) every
 * product and partial sum stays a normal float32, so the power-of-two scaling
 * commutes with each rounding and the results are those of the true values,
 * bit for bit. The NaN code S.1111.111 reads as +-480: fp8 weights never hold
 * it (the glue rejects non-finite weights; the quantizers saturate), and
 * testing for it would cost the AVX2 tile about a fifth of its speed. */
#define MX_FP8_UNSCALE 256.0f

/* Element i of a weight row, as float32 (fp8: value / 256, as above). */
static inline float mx_load_w(mx_dtype wdt, const void *w, int64_t i)
{
    if (wdt != MX_F8E4M3)
        return mx_load_f32(wdt, w, i);
    const uint8_t b = ((const uint8_t *)w)[i];
    return mx_f16_to_f32((uint16_t)((b & 0x80u) << 8 | (b & 0x7fu) << 7));
}

/* Every tile computes out[r][p] = dot(W_r[0:K], x_p[0:K]) for r < 4 weight
 * rows and p < np pairs. W_r is in wdt, read straight from memory and
 * converted in registers, so weight loads and FMAs interleave. With wstore,
 * the float32 rows are also written to wstore + r * ldstore for the further
 * pairs. A nonzero pf (bytes) prefetches the same columns pf bytes past each
 * row, i.e. the next rows of the work item: rows shorter than a page share
 * pages, which the hardware prefetcher tracks poorly.
 * With bs (FP8 block scaling), the dot is the sum over 128-column slices s
 * of the slice's dot times MX_FP8_UNSCALE * (bs->x[p][s] * bs->w[r][s]): at
 * each slice boundary every accumulator lane (a partial dot of the slice) is
 * scaled into a second set (one FMA per lane), so the lanes are summed once,
 * at the end; the K % 8 tail belongs to the last slice. */
typedef struct mx_tile_scales {
    const float *w[MX_TILE_ROWS];  /* row r's weight scales, from the tile's first slice on */
    const float *x[MX_TILE_PAIRS]; /* pair p's input scales, the same */
} mx_tile_scales;

typedef void (*mx_tile_fn)(const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS], int64_t K,
                           float *wstore, int64_t ldstore, ptrdiff_t pf, const mx_tile_scales *bs,
                           float out[MX_TILE_ROWS][MX_TILE_PAIRS]);

/* The scale of slice s, row r, pair p: 256 * (x * w), exactly (256 * x) * w. */
static inline float mx_tile_scale(const mx_tile_scales *bs, int64_t s, int r, int p)
{
    return bs->x[p][s] * MX_FP8_UNSCALE * bs->w[r][s];
}

/* Sum of the 8 lanes in the order the AVX2 reduction uses. */
static float mx_lanes_sum(const float v[8])
{
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

static void mx_tile_generic(mx_dtype wdt, const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS],
                            int np, int64_t K, float *wstore, int64_t ldstore, const mx_tile_scales *bs,
                            float out[MX_TILE_ROWS][MX_TILE_PAIRS])
{
    /* no prefetch here: the portable path favours simplicity */
    float acc[MX_TILE_ROWS][MX_TILE_PAIRS][8], tot[MX_TILE_ROWS][MX_TILE_PAIRS][8], wv[MX_TILE_ROWS][8];
    memset(acc, 0, sizeof acc);
    memset(tot, 0, sizeof tot);
    int64_t k0 = 0;
    for (; k0 < K; k0 += 8) {
        if (bs && k0 % MX_FP8_BLOCK == 0 && k0 > 0) /* a slice ends (the tail starts one too) */
            for (int r = 0; r < MX_TILE_ROWS; r++)
                for (int p = 0; p < np; p++)
                    for (int l = 0; l < 8; l++) {
                        tot[r][p][l] = fmaf(acc[r][p][l], mx_tile_scale(bs, k0 / MX_FP8_BLOCK - 1, r, p), tot[r][p][l]);
                        acc[r][p][l] = 0.0f;
                    }
        if (k0 + 8 > K)
            break;
        for (int r = 0; r < MX_TILE_ROWS; r++)
            for (int l = 0; l < 8; l++)
                wv[r][l] = mx_load_w(wdt, w[r], k0 + l);
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
                s += mx_load_w(wdt, w[r], i) * x[p][i];
            out[r][p] = bs ? mx_lanes_sum(tot[r][p]) + s * mx_tile_scale(bs, (K - 1) / MX_FP8_BLOCK, r, p) : s;
        }
        if (wstore)
            for (int64_t i = k0; i < K; i++)
                wstore[r * ldstore + i] = mx_load_w(wdt, w[r], i);
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

/* 8 weights from element k of row w, as float32 (fp8: value / 256, as
 * mx_load_w: the byte moved to bits 15..8, shifted right by one
 * arithmetically, bit 14 cleared). */
MX_INLINE_AVX2 __m256 mx_load8_avx2(mx_dtype wdt, const void *w, int64_t k)
{
    if (wdt == MX_F32)
        return _mm256_loadu_ps((const float *)w + k);
    if (wdt == MX_F8E4M3) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(const void *)((const uint8_t *)w + k));
        const __m128i h = _mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1);
        return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16((short)0xbfff)));
    }
    const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)w + k));
    if (wdt == MX_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* As mx_tile_generic. WDT and NP are constants after inlining, so the 4 x NP
 * accumulators stay in registers (12 + 3 + 1 of the 16 ymm at NP = 3). */
MX_INLINE_AVX2 void mx_tile_avx2(mx_dtype WDT, const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS],
                                 int NP, int64_t K, float *wstore, int64_t ldstore, ptrdiff_t pf,
                                 const mx_tile_scales *bs, float out[MX_TILE_ROWS][MX_TILE_PAIRS])
{
    const int64_t esize = (int64_t)mx_dtype_size(WDT), line = 64 / esize; /* elements per cache line */
    __m256 acc[MX_TILE_ROWS][MX_TILE_PAIRS], tot[MX_TILE_ROWS][MX_TILE_PAIRS];
    for (int r = 0; r < MX_TILE_ROWS; r++)
        for (int p = 0; p < NP; p++)
            acc[r][p] = tot[r][p] = _mm256_setzero_ps();
    int64_t k0 = 0;
    for (; k0 < K; k0 += 8) {
        if (bs && k0 % MX_FP8_BLOCK == 0 && k0 > 0) /* a slice ends (the tail starts one too) */
            for (int r = 0; r < MX_TILE_ROWS; r++)
                for (int p = 0; p < NP; p++) {
                    const __m256 sv = _mm256_set1_ps(mx_tile_scale(bs, k0 / MX_FP8_BLOCK - 1, r, p));
                    tot[r][p] = _mm256_fmadd_ps(acc[r][p], sv, tot[r][p]);
                    acc[r][p] = _mm256_setzero_ps();
                }
        if (k0 + 8 > K)
            break;
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
                s += mx_load_w(WDT, w[r], i) * x[p][i];
            out[r][p] = bs ? mx_hsum_avx2(tot[r][p]) + s * mx_tile_scale(bs, (K - 1) / MX_FP8_BLOCK, r, p) : s;
        }
        if (wstore)
            for (int64_t i = k0; i < K; i++)
                wstore[r * ldstore + i] = mx_load_w(WDT, w[r], i);
    }
}

/* One instantiation per (weight dtype, pairs, store or not, block-scaled or not). */
#define MX_TILE_AVX2_DEF(name, WDT, NP, STORE, BLOCK)                                                           \
    MX_AVX2 static void name(const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS], int64_t K, \
                             float *wstore, int64_t ldstore, ptrdiff_t pf, const mx_tile_scales *bs,        \
                             float out[MX_TILE_ROWS][MX_TILE_PAIRS])                                   \
    {                                                                                                          \
        mx_tile_avx2(WDT, w, x, NP, K, STORE ? wstore : NULL, ldstore, pf, BLOCK ? bs : NULL, out);           \
    }
#define MX_TILE_AVX2_DEFS(prefix, WDT, STORE, BLOCK)        \
    MX_TILE_AVX2_DEF(prefix##_1, WDT, 1, STORE, BLOCK)      \
    MX_TILE_AVX2_DEF(prefix##_2, WDT, 2, STORE, BLOCK)      \
    MX_TILE_AVX2_DEF(prefix##_3, WDT, 3, STORE, BLOCK)

MX_TILE_AVX2_DEFS(mx_tile_f32, MX_F32, 0, 0)
MX_TILE_AVX2_DEFS(mx_tile_f16, MX_F16, 0, 0)
MX_TILE_AVX2_DEFS(mx_tile_bf16, MX_BF16, 0, 0)
MX_TILE_AVX2_DEFS(mx_tile_f8, MX_F8E4M3, 0, 0)
MX_TILE_AVX2_DEFS(mx_tile_f16_store, MX_F16, 1, 0)
MX_TILE_AVX2_DEFS(mx_tile_bf16_store, MX_BF16, 1, 0)
MX_TILE_AVX2_DEFS(mx_tile_f8_store, MX_F8E4M3, 1, 0)
MX_TILE_AVX2_DEFS(mx_tile_f32_block, MX_F32, 0, 1)
MX_TILE_AVX2_DEFS(mx_tile_f8_block, MX_F8E4M3, 0, 1)
MX_TILE_AVX2_DEFS(mx_tile_f8_store_block, MX_F8E4M3, 1, 1)

/* [block][store][weight dtype: F32, F16, BF16, F8E4M3][np - 1]; float32 rows
 * are never stored (they are reused in place); block scaling comes only with
 * fp8 weights (or their kept float32 rows) */
static const mx_tile_fn mx_tiles_avx2[2][2][4][MX_TILE_PAIRS] = {
    {
        {
            {mx_tile_f32_1, mx_tile_f32_2, mx_tile_f32_3},
            {mx_tile_f16_1, mx_tile_f16_2, mx_tile_f16_3},
            {mx_tile_bf16_1, mx_tile_bf16_2, mx_tile_bf16_3},
            {mx_tile_f8_1, mx_tile_f8_2, mx_tile_f8_3},
        },
        {
            {mx_tile_f32_1, mx_tile_f32_2, mx_tile_f32_3},
            {mx_tile_f16_store_1, mx_tile_f16_store_2, mx_tile_f16_store_3},
            {mx_tile_bf16_store_1, mx_tile_bf16_store_2, mx_tile_bf16_store_3},
            {mx_tile_f8_store_1, mx_tile_f8_store_2, mx_tile_f8_store_3},
        },
    },
    {
        {
            [0] = {mx_tile_f32_block_1, mx_tile_f32_block_2, mx_tile_f32_block_3},
            [3] = {mx_tile_f8_block_1, mx_tile_f8_block_2, mx_tile_f8_block_3},
        },
        {
            [0] = {mx_tile_f32_block_1, mx_tile_f32_block_2, mx_tile_f32_block_3},
            [3] = {mx_tile_f8_store_block_1, mx_tile_f8_store_block_2, mx_tile_f8_store_block_3},
        },
    },
};

static int mx_tile_dtype_index(mx_dtype wdt)
{
    switch (wdt) {
    case MX_F16: return 1;
    case MX_BF16: return 2;
    case MX_F8E4M3: return 3;
    default: return 0; /* MX_F32 */
    }
}
#endif

/* AVX2 and FMA (with OS support, per __builtin_cpu_supports) and F16C
 * (CPUID.1:ECX bit 29; Clang's __builtin_cpu_supports lacks "f16c"). */
static int mx_detect_avx2(void)
{
#if MX_HAVE_AVX2_PATH
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 29)))
        return 0;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* Detected once: CPUID traps to the hypervisor in a VM (microseconds per call). */
int mx_gemm_avx2(void)
{
    static _Atomic int cached = -1;
    int avx2 = atomic_load_explicit(&cached, memory_order_relaxed);
    if (avx2 < 0) {
        avx2 = mx_detect_avx2();
        atomic_store_explicit(&cached, avx2, memory_order_relaxed);
    }
    return avx2;
}

static void mx_tile(int avx2, mx_dtype wdt, const void *const w[MX_TILE_ROWS], const float *const x[MX_TILE_PAIRS],
                    int np, int64_t K, float *wstore, int64_t ldstore, ptrdiff_t pf, const mx_tile_scales *bs,
                    float out[MX_TILE_ROWS][MX_TILE_PAIRS])
{
#if MX_HAVE_AVX2_PATH
    if (avx2) {
        mx_tiles_avx2[bs != NULL][wstore != NULL][mx_tile_dtype_index(wdt)][np - 1](w, x, K, wstore, ldstore, pf, bs,
                                                                                    out);
        return;
    }
#else
    (void)avx2;
    (void)pf;
#endif
    mx_tile_generic(wdt, w, x, np, K, wstore, ldstore, bs, out);
}

void mx_gemm_rows(const mx_gemm_weights *gw, int64_t row0, int nrows, const mx_gemm_input *in,
                  const int32_t *pairs, int64_t np, float *d, int64_t ldd)
{
    _Alignas(64) float wbuf[MX_WBUF_FLOATS];
    const mx_dtype dt = gw->dtype;
    const size_t esize = mx_dtype_size(dt);
    const int64_t K = gw->K;
    const int keep = np > MX_TILE_PAIRS && dt != MX_F32, block = gw->quant == MX_QUANT_FP8_BLOCK;
    const int64_t nkb = (K + MX_FP8_BLOCK - 1) / MX_FP8_BLOCK;
    const int64_t kc_max = K < MX_KC_MAX ? K : MX_KC_MAX, ldk = kc_max + MX_WBUF_PAD;
    int nb = (int)(MX_WBUF_FLOATS / ldk);
    nb -= nb % MX_TILE_ROWS;

    for (int rb = 0; rb < nrows; rb += nb) {
        const int nr = nrows - rb < nb ? nrows - rb : nb;
        for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
            const int64_t kc = K - k0 < kc_max ? K - k0 : kc_max;
            const int last = k0 + kc == K;
            for (int64_t p0 = 0; p0 < np; p0 += MX_TILE_PAIRS) {
                const int tp = np - p0 < MX_TILE_PAIRS ? (int)(np - p0) : MX_TILE_PAIRS;
                const int from_buf = keep && p0 > 0;
                int64_t q[MX_TILE_PAIRS], xrow[MX_TILE_PAIRS];
                const float *xs[MX_TILE_PAIRS];
                for (int j = 0; j < MX_TILE_PAIRS; j++) {
                    const int64_t i = p0 + (j < tp ? j : tp - 1);
                    q[j] = pairs ? pairs[i] : i;
                    xrow[j] = q[j] / in->div;
                    xs[j] = in->x + xrow[j] * in->ld + k0;
                }
                for (int r0 = 0; r0 < nr; r0 += MX_TILE_ROWS) {
                    const int tr = nr - r0 < MX_TILE_ROWS ? nr - r0 : MX_TILE_ROWS;
                    const void *ws[MX_TILE_ROWS];
                    int64_t rows[MX_TILE_ROWS];
                    float out[MX_TILE_ROWS][MX_TILE_PAIRS];
                    for (int i = 0; i < MX_TILE_ROWS; i++) {
                        const int r = r0 + (i < tr ? i : tr - 1);
                        rows[i] = row0 + rb + r;
                        ws[i] = from_buf ? (const void *)(wbuf + r * ldk)
                                         : (const void *)((const char *)gw->w + (size_t)(rows[i] * K + k0) * esize);
                    }
                    /* prefetch the next 4 rows while they are in this call */
                    const ptrdiff_t pf = !from_buf && rb + r0 + 2 * MX_TILE_ROWS <= nrows
                                             ? (ptrdiff_t)(MX_TILE_ROWS * K * (int64_t)esize) : 0;
                    mx_tile_scales bs;
                    if (block) {
                        for (int i = 0; i < MX_TILE_ROWS; i++)
                            bs.w[i] = gw->scale + rows[i] / MX_FP8_BLOCK * nkb + k0 / MX_FP8_BLOCK;
                        for (int j = 0; j < MX_TILE_PAIRS; j++)
                            bs.x[j] = in->scale + xrow[j] * in->ld_scale + k0 / MX_FP8_BLOCK;
                    }
                    mx_tile(gw->avx2, from_buf ? MX_F32 : dt, ws, xs, tp, kc, keep && p0 == 0 ? wbuf + r0 * ldk : NULL,
                            ldk, pf, block ? &bs : NULL, out);
                    for (int i = 0; i < tr; i++)
                        for (int j = 0; j < tp; j++)
                            out[i][j] = k0 ? d[q[j] * ldd + rb + r0 + i] + out[i][j] : out[i][j];
                    if (gw->quant == MX_QUANT_FP8_TENSOR && last)
                        for (int i = 0; i < tr; i++)
                            for (int j = 0; j < tp; j++)
                                out[i][j] = out[i][j] * MX_FP8_UNSCALE * in->scale[0] * gw->scale[0];
                    for (int j = 0; j < tp; j++)
                        for (int i = 0; i < tr; i++)
                            d[q[j] * ldd + rb + r0 + i] = out[i][j];
                }
            }
        }
    }
}
