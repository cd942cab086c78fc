/* Internal helpers shared by the CPU engine (the files of csrc/cpu): status construction,
 * dtype sizes and names, float16 / bfloat16 <-> float32 conversions
 * (round-to-nearest-even, NaN kept NaN, payload preserved where it fits) and
 * the OpenMP pragma wrapper. Not part of the kernel ABI. */
#ifndef MOE_EXT_CPU_COMMON_H
#define MOE_EXT_CPU_COMMON_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "moe_ext/abi.h"

/* OpenMP only through this wrapper, so builds without -fopenmp see no
 * unknown pragmas and run serially. */
#ifdef _OPENMP
#include <omp.h>
#define MX_PRAGMA(x) _Pragma(#x)
#define MX_OMP(x) MX_PRAGMA(omp x)
#else
#define MX_OMP(x)
#endif

/* Multiply-adds under which a call stays on one thread (waking the team costs more). */
#define MX_PARALLEL_MIN_WORK (1 << 20)

#if defined(__GNUC__)
#define MX_PRINTF_LIKE(fmt, first) __attribute__((format(printf, fmt, first)))
#else
#define MX_PRINTF_LIKE(fmt, first)
#endif

static inline mx_status mx_ok(void)
{
    mx_status st;
    st.code = MX_OK;
    st.message[0] = '\0';
    return st;
}

static inline mx_status mx_error(mx_code code, const char *fmt, ...) MX_PRINTF_LIKE(2, 3);
static inline mx_status mx_error(mx_code code, const char *fmt, ...)
{
    mx_status st;
    va_list ap;
    st.code = code;
    va_start(ap, fmt);
    vsnprintf(st.message, sizeof st.message, fmt, ap);
    va_end(ap);
    return st;
}

/* Bytes per element; 0 for a value outside the enum. */
static inline uint32_t mx_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float mx_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float mx_bf16_to_f32(uint16_t h)
{
    return mx_bits_f32((uint32_t)h << 16);
}

static inline uint16_t mx_f32_to_bf16(float f)
{
    uint32_t u = mx_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN, sign and top payload kept */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float mx_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu)
        return mx_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        float v = (float)man * 5.9604644775390625e-08f; /* man * 2^-24, exact */
        return sign ? -v : v;
    }
    return mx_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t mx_f32_to_f16(float f)
{
    uint32_t u = mx_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520: rounds to infinity (or is infinity) */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below 2^-14: float16 subnormal or zero */
        uint32_t e = a >> 23;
        if (e < 101) /* below 2^-26: rounds to zero */
            return (uint16_t)sign;
        uint32_t man = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..25: units of 2^-24 */
        uint32_t q = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
    a -= 0x38000000u; /* rebias the exponent from 127 to 15 */
    a += 0x0fffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | (a >> 13));
}

/* v rounded to the precision of dt (F16 / BF16); F32 returns v. */
static inline float mx_round_to(mx_dtype dt, float v)
{
    if (dt == MX_BF16)
        return mx_bf16_to_f32(mx_f32_to_bf16(v));
    if (dt == MX_F16)
        return mx_f16_to_f32(mx_f32_to_f16(v));
    return v;
}

/* Element i of a F32 / F16 / BF16 array, as float32. */
static inline float mx_load_f32(mx_dtype dt, const void *base, int64_t i)
{
    if (dt == MX_BF16)
        return mx_bf16_to_f32(((const uint16_t *)base)[i]);
    if (dt == MX_F16)
        return mx_f16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

/* Element i of a F32 / F16 / BF16 array = v, rounded to nearest even. */
static inline void mx_store_f32(mx_dtype dt, void *base, int64_t i, float v)
{
    if (dt == MX_BF16)
        ((uint16_t *)base)[i] = mx_f32_to_bf16(v);
    else if (dt == MX_F16)
        ((uint16_t *)base)[i] = mx_f32_to_f16(v);
    else
        ((float *)base)[i] = v;
}

#endif /* MOE_EXT_CPU_COMMON_H */
