/* Internal row-dot GEMM of the CPU engine (gemm.c), shared by the expert
 * engine (experts.c) and the dense FP8 linear (fp8_linear.c). Not part of the
 * kernel ABI. */
#ifndef MOE_EXT_CPU_GEMM_H
#define MOE_EXT_CPU_GEMM_H

#include "cpu_common.h"

/* A weight matrix W [rows, K], row-major, as mx_gemm_rows reads it. */
typedef struct mx_gemm_weights {
    const void *w;
    mx_dtype dtype;      /* F32 | F16 | BF16, or F8E4M3 with an FP8 quant */
    int64_t K;
    mx_quant quant;      /* NONE, or the FP8 scaling of the dots (see mx_gemm_rows) */
    const float *scale;  /* FP8_TENSOR [1]; FP8_BLOCK [ceil(rows / 128), ceil(K / 128)] */
    int avx2;            /* mx_gemm_avx2() */
} mx_gemm_weights;

/* The float32 input rows: pair q reads row q / div, at x + (q / div) * ld.
 * With an FP8 quant they hold fp8 values (the quantized inputs). */
typedef struct mx_gemm_input {
    const float *x;
    int64_t ld, div;
    const float *scale;  /* FP8_TENSOR [1]; FP8_BLOCK [*, ld_scale]: per row and 128 columns */
    int64_t ld_scale;
} mx_gemm_input;

/* 1 when the AVX2 + FMA + F16C kernels can run on this CPU. */
int mx_gemm_avx2(void);

/* For rows [row0, row0 + nrows) of W and the np pairs q = pairs[i] (q = i
 * when pairs is NULL):
 *   NONE         d[q * ldd + r] = dot(W[row0 + r, :], x_q)
 *   FP8_TENSOR   d[q * ldd + r] = dot(W[row0 + r, :], x_q) * x.scale[0] * w.scale[0]
 *   FP8_BLOCK    d[q * ldd + r] = sum over 128-column slices kb of the slice's
 *                dot * (x.scale[row(q), kb] * w.scale[(row0 + r) / 128, kb])
 * with float32 accumulation (FP8_BLOCK: the tile's 8 lanes each scale their
 * partial dot of a slice, and the lanes are summed once at the end); each
 * weight is read from memory once. */
void mx_gemm_rows(const mx_gemm_weights *w, int64_t row0, int nrows, const mx_gemm_input *x,
                  const int32_t *pairs, int64_t np, float *d, int64_t ldd);

#endif /* MOE_EXT_CPU_GEMM_H */
