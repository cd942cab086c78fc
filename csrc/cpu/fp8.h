/* Internal float8_e4m3fn helpers of the CPU engine (numerics.md "FP8"): the
 * conversions and the scale formulas shared by the quantizers (fp8_quant.c),
 * the expert engine (experts.c) and the dense linear (fp8_linear.c). Not part
 * of the kernel ABI.
 *
 * float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities;
 * S.1111.111 is NaN; largest finite 448 (0x7E), smallest subnormal 2^-9.
 * float32 -> fp8 rounds to nearest even and saturates: every value of
 * magnitude >= 448, infinities included, becomes +-448 (what CUDA's
 * __NV_SATFINITE conversion does; torch turns >= 464 into NaN instead, which
 * no quantizer here produces, as each clamps or scales into [-448, 448]
 * first). Any NaN becomes 0x7F.
 *
 * The scale formulas are in float32, in the order numerics.md writes them;
 * their max() propagates NaN (fmaxf would drop it), so a NaN in the data
 * gives a NaN scale rather than a silently finite one. */
#ifndef MOE_EXT_CPU_FP8_H
#define MOE_EXT_CPU_FP8_H

#include <math.h>

#include "cpu_common.h"

#define MX_FP8_MAX 448.0f
/* 1 / (448 * 512): the smallest per-tensor scale, float32 of the double quotient */
#define MX_FP8_MIN_TENSOR_SCALE ((float)(1.0 / (448.0 * 512.0)))

static inline uint8_t mx_f32_to_fp8(float f)
{
    const uint32_t u = mx_f32_bits(f);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return 0x7f;
    if (a >= 0x43e00000u) /* >= 448, infinity included */
        return (uint8_t)(sign | 0x7eu);
    if (a >= 0x3c800000u) { /* >= 2^-6: normal; rebias the exponent 127 -> 7, round 20 bits away */
        const uint32_t r = a - (120u << 23);
        return (uint8_t)(sign | ((r + 0x7ffffu + ((r >> 20) & 1u)) >> 20));
    }
    /* subnormal: round(|f| * 2^9) in units of 2^-9 (8 gives 0x08, the smallest normal) */
    const uint32_t e = a >> 23;
    if (e < 117) /* below 2^-10: rounds to zero (2^-10 itself ties to even 0) */
        return sign;
    const uint32_t man = (a & 0x7fffffu) | 0x800000u, shift = 141u - e; /* 21..24 */
    uint32_t q = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return (uint8_t)(sign | q);
}

static inline float mx_fp8_to_f32(uint8_t b)
{
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24, exp = (b >> 3) & 0xfu, man = b & 7u;
    if (exp == 0xfu && man == 7u)
        return mx_bits_f32(sign | 0x7fc00000u);
    if (exp == 0) {
        const float v = (float)man * 0.001953125f; /* man * 2^-9, exact */
        return sign ? -v : v;
    }
    return mx_bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

/* v rounded to the nearest float8_e4m3fn value (saturating), as float32. */
static inline float mx_fp8_round(float v)
{
    return mx_fp8_to_f32(mx_f32_to_fp8(v));
}

/* max(a, b) that returns NaN when either is NaN. */
static inline float mx_max_nan(float a, float b)
{
    if (a != a)
        return a;
    if (b != b)
        return b;
    return a > b ? a : b;
}

/* max(m, |v|), NaN-propagating: the running amax of a quantizer. */
static inline float mx_amax_step(float m, float v)
{
    return mx_max_nan(m, fabsf(v));
}

/* Per-tensor scale (scaled_fp8_quant): max(amax / 448, 1 / (448 * 512)). */
static inline float mx_fp8_tensor_scale(float amax)
{
    return mx_max_nan(amax / MX_FP8_MAX, MX_FP8_MIN_TENSOR_SCALE);
}

/* Per-token-group scale (per_token_group_quant_fp8): max(amax, 1e-10) / 448. */
static inline float mx_fp8_group_scale(float amax)
{
    return mx_max_nan(amax, 1e-10f) / MX_FP8_MAX;
}

/* Per-block scale (per_block_cast_to_fp8): max(amax, 1e-4) / 448, with ue8m0
 * rounded up to a power of two exactly (frexpf: sf = m * 2^e, m in [0.5, 1);
 * m == 0.5 is already a power of two). NaN and infinity stay as they are. */
static inline float mx_fp8_block_scale(float amax, int use_ue8m0)
{
    const float sf = mx_max_nan(amax, 1e-4f) / MX_FP8_MAX;
    if (!use_ue8m0 || !isfinite(sf))
        return sf;
    int e;
    const float m = frexpf(sf, &e);
    return m == 0.5f ? sf : ldexpf(1.0f, e);
}

/* Per-token-group quantization of n float32 values in place, groups of
 * MX_FP8_BLOCK: scales[g] = s, v = fp8(clamp(v / s, -448, 448)) as float32
 * (the clamp is the conversion's saturation). */
static inline void mx_fp8_quant_groups(float *v, int64_t n, float *scales)
{
    for (int64_t g0 = 0; g0 < n; g0 += MX_FP8_BLOCK) {
        const int64_t g1 = n - g0 < MX_FP8_BLOCK ? n : g0 + MX_FP8_BLOCK;
        float amax = 0.0f;
        for (int64_t i = g0; i < g1; i++)
            amax = mx_amax_step(amax, v[i]);
        const float s = mx_fp8_group_scale(amax);
        for (int64_t i = g0; i < g1; i++)
            v[i] = mx_fp8_round(v[i] / s);
        scales[g0 / MX_FP8_BLOCK] = s;
    }
}

#endif /* MOE_EXT_CPU_FP8_H */
