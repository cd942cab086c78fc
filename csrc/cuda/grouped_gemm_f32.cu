/* Grouped GEMM for float32 activations and weights: a plain SIMT path
 * (correct, not fast; float32 MoE layers are for testing).
 *
 * Operands and tile tables as in grouped_gemm_tc.cuh (A gathered by token
 * for GEMM1, act rows for GEMM2; W [E_local, n_rows, K] row-major). Tiling:
 * a CTA of 256 threads computes MX_F32_BLOCK_M (16) rows x 64 weight rows,
 * staging 16 x 32 and 64 x 32 k-slices in shared memory; thread (r, c)
 * accumulates rows r, columns c + 16 q (q < 4) in float32 with fmaf.
 * Epilogue: the shared mx_gemm_epilogue (bias, activation or routing weight).
 * Any K, no alignment needed. */
#include "common.cuh"
#include "experts.cuh"
#include "gemm_configs.cuh"
#include "gemm_epilogue.cuh"

namespace {

constexpr int kBM = MX_F32_BLOCK_M, kBN = 64, kBK = 32, kThreads = 256;

template <int KIND>
__global__ void __launch_bounds__(kThreads) grouped_gemm_f32_kernel(const mx_gemm_args g)
{
    __shared__ float sA[kBM][kBK + 1];
    __shared__ float sB[kBN][kBK + 1];
    __shared__ float C[kBM][kBN + 8];
    __shared__ const float *a_rows[kBM];
    __shared__ const float *b_rows[kBN];
    __shared__ int32_t tile_pairs[kBM];

    const int tid = threadIdx.x;
    const int64_t mt = g.m_tile_base + blockIdx.x;
    const int64_t nt = blockIdx.y;
    if (mt >= *g.num_tiles)
        return;
    const int expert = g.tile_expert[mt];
    const int64_t row0 = mt * kBM;
    const float *A = static_cast<const float *>(g.a);
    const float *W = static_cast<const float *>(g.w) + static_cast<int64_t>(expert) * g.n_rows * g.k;
    const int64_t K = g.k;

    if (tid < kBM) {
        const int32_t pair = g.sorted_ids[row0 + tid];
        tile_pairs[tid] = pair;
        const float *src = nullptr;
        if (pair >= 0)
            src = KIND == MX_GEMM_DOWN ? A + (row0 + tid) * g.lda : A + static_cast<int64_t>(pair / g.top_k) * g.lda;
        a_rows[tid] = src;
    }
    if (tid < kBN) {
        int64_t row;
        bool ok;
        if (KIND == MX_GEMM_GATE_UP) {
            const int half = tid >= kBN / 2;
            const int64_t c = nt * (kBN / 2) + tid - half * (kBN / 2);
            ok = c < g.out_cols;
            row = half * g.out_cols + c;
        } else {
            row = nt * kBN + tid;
            ok = row < g.n_rows;
        }
        b_rows[tid] = ok ? W + row * K : nullptr;
    }
    __syncthreads();

    const int r = tid / 16, c = tid % 16;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t k0 = 0; k0 < K; k0 += kBK) {
        for (int i = tid; i < kBM * kBK; i += kThreads) {
            const int rr = i / kBK, kk = i % kBK;
            const float *src = a_rows[rr];
            sA[rr][kk] = (src && k0 + kk < K) ? src[k0 + kk] : 0.f;
        }
        for (int i = tid; i < kBN * kBK; i += kThreads) {
            const int rr = i / kBK, kk = i % kBK;
            const float *src = b_rows[rr];
            sB[rr][kk] = (src && k0 + kk < K) ? src[k0 + kk] : 0.f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < kBK; ++kk) {
            const float a = sA[r][kk];
#pragma unroll
            for (int q = 0; q < 4; ++q)
                acc[q] = fmaf(a, sB[c + 16 * q][kk], acc[q]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < 4; ++q)
        C[r][c + 16 * q] = acc[q];
    __syncthreads();
    mx_gemm_epilogue<float, KIND, kBM, kBN, kThreads>(&C[0][0], kBN + 8, tile_pairs, row0, nt, expert, 0, g);
}

template <int KIND> mx_status launch(const mx_gemm_args &args, int64_t m_tiles, cudaStream_t stream)
{
    const int64_t n_tiles = KIND == MX_GEMM_GATE_UP ? mx_ceil_div(args.out_cols, kBN / 2)
                                                    : mx_ceil_div(args.n_rows, kBN);
    if (n_tiles > 65535 || m_tiles > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_f32_kernel: %lld x %lld tiles exceed the grid",
                              (long long)m_tiles, (long long)n_tiles);
    mx_gemm_args g = args;
    g.m_tile_base = 0;
    grouped_gemm_f32_kernel<KIND><<<dim3(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles)),
                                    kThreads, 0, stream>>>(g);
    return mx_check_launch("grouped_gemm_f32_kernel");
}

} /* namespace */

extern "C" mx_status mx_cuda_grouped_gemm_f32(const mx_gemm_args *g, mx_gemm_kind kind, int64_t m_tiles,
                                              cudaStream_t stream)
{
    if (m_tiles <= 0)
        return mx_status_ok();
    if (g->k_splits != 1)
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_f32: split-K is not supported (k_splits=%d)", g->k_splits);
    switch (kind) {
    case MX_GEMM_GATE_UP: return launch<MX_GEMM_GATE_UP>(*g, m_tiles, stream);
    case MX_GEMM_GATE_UP_INTERLEAVED: return launch<MX_GEMM_GATE_UP_INTERLEAVED>(*g, m_tiles, stream);
    case MX_GEMM_UP: return launch<MX_GEMM_UP>(*g, m_tiles, stream);
    case MX_GEMM_DOWN: return launch<MX_GEMM_DOWN>(*g, m_tiles, stream);
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_f32: unknown kind %d", (int)kind);
}
