/* Grouped GEMM on tensor cores (mma.sync m16n8k16, bf16 or fp16 in, float32
 * accumulate), sm_80 and later. Included by grouped_gemm_bf16.cu and
 * grouped_gemm_fp16.cu, which instantiate it for one dtype each.
 *
 * Operands (all row-major, K contiguous):
 *   A  GEMM1: x [M, H] (or x * w), row of pair p = x[p / top_k]: the token
 *      gather is fused into the A loads.  GEMM2: act [rows, ld_act], row s.
 *   W  [E_local, n_rows, K]: w13 (n_rows = 2I or I, K = H) or w2 (n_rows =
 *      H, K = I). Read as the mma's column-major B without any transpose.
 * Tiling: a CTA computes a kBlockM x kBlockN tile: kBlockM sorted rows of one
 * expert (tile mt) against kBlockN weight rows (tile nt). For MX_GEMM_GATE_UP
 * those rows are kBlockN/2 gate rows and the kBlockN/2 up rows of the same
 * output columns, so act(gate) * up is formed in the epilogue. Warps split the
 * tile kWarpsM x kWarpsN; each warp holds (WM/16) x (WN/8) fragments of 4
 * floats.
 * Pipeline: kStages-deep cp.async ring of (A, B) k-slices of 64 columns,
 * 16-byte chunks XOR-swizzled by row; ldmatrix.x4 feeds the mma. Rows past
 * the expert's segment (sorted id -1), weight rows past n, and columns past
 * K are zero-filled (cp.async src-size 0), so any H and I work; when a row
 * stride or base is not 16-byte aligned (H or I not a multiple of 8), the
 * kAligned = false instantiation loads element by element instead.
 * Split-K (GEMM2 at decode, grid z): split z reduces k in [z * k_split_len,
 * ...) and writes its own float32 slice of y; moe_sum adds the slices in a
 * fixed order, so the result stays deterministic.
 * Epilogue: accumulators -> shared memory (reusing the pipeline buffers) ->
 * mx_gemm_epilogue (bias, activation / routing weight, coalesced stores).
 *
 * The launcher guarantees: tile tables from moe_align with this config's
 * kBlockM; grid over the worst-case tile count (CTAs past num_tiles exit);
 * int32-indexable rows. */
#ifndef MOE_EXT_CUDA_GROUPED_GEMM_TC_CUH
#define MOE_EXT_CUDA_GROUPED_GEMM_TC_CUH

#include <atomic>

#include "common.cuh"
#include "experts.cuh"
#include "gemm_configs.cuh"
#include "gemm_epilogue.cuh"
#include "mma_sync_ptx.cuh"

namespace {

/* One 16-byte chunk (8 elements from column k0) of a tile row into shared
 * memory; row == nullptr or columns >= K (the end of this CTA's k range)
 * read as zero. */
template <typename T, bool kAligned>
__device__ __forceinline__ void load_chunk(T *dst, const T *row, int64_t k0, int64_t K, const void *dummy)
{
    if (kAligned) {
        const bool ok = row != nullptr && k0 < K; /* K % 8 == 0: a chunk is all in or all out */
        mx_cp_async16(dst, ok ? static_cast<const void *>(row + k0) : dummy, ok ? 16 : 0);
    } else {
        const unsigned short *src = reinterpret_cast<const unsigned short *>(row);
        uint32_t w[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int64_t k = k0 + 2 * e;
            const uint32_t lo = (row && k < K) ? src[k] : 0u;
            const uint32_t hi = (row && k + 1 < K) ? src[k + 1] : 0u;
            w[e] = lo | (hi << 16);
        }
        *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

/* ---- kernel ------------------------------------------------------------------- */

template <typename T, typename Shape, int KIND, bool kAligned>
__global__ void __launch_bounds__(Shape::kThreads, Shape::kMinBlocks) grouped_gemm_tc_kernel(const mx_gemm_args g)
{
    constexpr int BM = Shape::kBlockM, BN = Shape::kBlockN, BK = Shape::kBlockK;
    constexpr int THREADS = Shape::kThreads, STAGES = Shape::kStages;
    constexpr int WM = BM / Shape::kWarpsM, WN = BN / Shape::kWarpsN;
    constexpr int MI = WM / 16, NJ = WN / 8;
    constexpr int ROWS_PER_PASS = THREADS / 8; /* tile rows loaded per pass (8 chunks each) */
    constexpr int A_PASSES = BM / ROWS_PER_PASS, B_PASSES = BN / ROWS_PER_PASS;
    static_assert(BK == 64, "the swizzle assumes 8 chunks of 8 elements per row");
    static_assert(ROWS_PER_PASS % 8 == 0, "a thread keeps the same swizzle phase in every pass");

    extern __shared__ __align__(128) unsigned char gemm_smem[];
    __shared__ const T *a_rows[BM];     /* source row of each tile row, nullptr = zero */
    __shared__ const T *b_rows[BN];     /* weight row of each tile column, nullptr = zero */
    __shared__ int32_t tile_pairs[BM];  /* pair index of each tile row, -1 = padding */
    T *const sA = reinterpret_cast<T *>(gemm_smem);
    T *const sB = sA + STAGES * BM * BK;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / Shape::kWarpsN, wn = warp % Shape::kWarpsN;
    const int64_t mt = g.m_tile_base + (Shape::kMOnX ? blockIdx.x : blockIdx.y);
    const int64_t nt = Shape::kMOnX ? blockIdx.y : blockIdx.x;
    const int split = blockIdx.z;
    if (mt >= *g.num_tiles)
        return; /* past the tiles in use: the grid is sized for the worst case */
    const int expert = g.tile_expert[mt];
    const int64_t row0 = mt * BM;
    const T *A = static_cast<const T *>(g.a);
    const T *W = static_cast<const T *>(g.w) + static_cast<int64_t>(expert) * g.n_rows * g.k;
    /* this CTA's k range; k_split_len is a multiple of BK, so a split
     * boundary never cuts a 16-byte chunk */
    const int64_t k_begin = static_cast<int64_t>(split) * g.k_split_len;
    const int64_t k_end = g.k - k_begin < g.k_split_len ? g.k : k_begin + g.k_split_len;

    for (int r = tid; r < BM; r += THREADS) {
        const int32_t pair = g.sorted_ids[row0 + r];
        tile_pairs[r] = pair;
        const T *src = nullptr;
        if (pair >= 0)
            src = KIND == MX_GEMM_DOWN ? A + (row0 + r) * g.lda : A + static_cast<int64_t>(pair / g.top_k) * g.lda;
        a_rows[r] = src;
    }
    for (int r = tid; r < BN; r += THREADS) {
        int64_t row;
        bool ok;
        if (KIND == MX_GEMM_GATE_UP) {
            const int half = r >= BN / 2;
            const int64_t c = nt * (BN / 2) + r - half * (BN / 2);
            ok = c < g.out_cols;
            row = half * g.out_cols + c;
        } else {
            row = nt * BN + r;
            ok = row < g.n_rows;
        }
        b_rows[r] = ok ? W + row * g.k : nullptr;
    }
    __syncthreads();

    const int chunk = tid & 7;
    const int first_row = tid >> 3;
    const int swz = (chunk ^ (first_row & 7)) << 3; /* same for every pass */
    auto load_stage = [&](int stage, int kt) {
        const int64_t k0 = k_begin + static_cast<int64_t>(kt) * BK + chunk * 8;
        T *a = sA + stage * BM * BK;
        T *b = sB + stage * BN * BK;
#pragma unroll
        for (int i = 0; i < A_PASSES; ++i) {
            const int r = first_row + i * ROWS_PER_PASS;
            load_chunk<T, kAligned>(a + r * BK + swz, a_rows[r], k0, k_end, g.w);
        }
#pragma unroll
        for (int i = 0; i < B_PASSES; ++i) {
            const int r = first_row + i * ROWS_PER_PASS;
            load_chunk<T, kAligned>(b + r * BK + swz, b_rows[r], k0, k_end, g.w);
        }
    };

    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q)
                acc[i][j][q] = 0.0f;

    const int KT = static_cast<int>((k_end - k_begin + BK - 1) / BK);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT)
            load_stage(s, s);
        mx_cp_async_commit();
    }

    /* ldmatrix lane roles: A matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15);
     * B matrices (fragment j | j+1) x (k 0-7 | 8-15). */
    const int a_row = wm * WM + (lane & 15);
    const int a_chunk = lane >> 4;
    const int b_row = wn * WN + (lane & 7) + ((lane >> 4) << 3);
    const int b_chunk = (lane >> 3) & 1;

    for (int kt = 0; kt < KT; ++kt) {
        mx_cp_async_wait<STAGES - 2>();
        __syncthreads(); /* stage kt landed for everyone; stage kt-1 is free */
        if (kt + STAGES - 1 < KT)
            load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        mx_cp_async_commit();

        const T *a = sA + (kt % STAGES) * BM * BK;
        const T *b = sB + (kt % STAGES) * BN * BK;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            uint32_t af[MI][4];
            uint32_t bf[NJ][2];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const int r = a_row + i * 16;
                mx_ldmatrix_x4(af[i][0], af[i][1], af[i][2], af[i][3],
                            a + r * BK + (((2 * ks + a_chunk) ^ (r & 7)) << 3));
            }
#pragma unroll
            for (int j = 0; j < NJ; j += 2) {
                const int r = b_row + j * 8;
                mx_ldmatrix_x4(bf[j][0], bf[j][1], bf[j + 1][0], bf[j + 1][1],
                            b + r * BK + (((2 * ks + b_chunk) ^ (r & 7)) << 3));
            }
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
                    mx_mma_16816<T>::run(acc[i][j], af[i], bf[j]);
        }
    }

    mx_cp_async_wait<0>();
    __syncthreads(); /* the pipeline buffers become the epilogue tile */
    float *C = reinterpret_cast<float *>(gemm_smem);
    constexpr int LDC = Shape::kLdc;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int r = wm * WM + i * 16 + (lane >> 2);
            const int c = wn * WN + j * 8 + 2 * (lane & 3);
            *reinterpret_cast<float2 *>(C + r * LDC + c) = make_float2(acc[i][j][0], acc[i][j][1]);
            *reinterpret_cast<float2 *>(C + (r + 8) * LDC + c) = make_float2(acc[i][j][2], acc[i][j][3]);
        }
    __syncthreads();
    mx_gemm_epilogue<T, KIND, BM, BN, THREADS>(C, LDC, tile_pairs, row0, nt, expert, split, g);
}

/* ---- launch ------------------------------------------------------------------- */

template <typename T> const char *tc_dtype_name();
template <> const char *tc_dtype_name<__nv_bfloat16>() { return "bf16"; }
template <> const char *tc_dtype_name<__half>() { return "fp16"; }

template <typename T, typename Shape, int KIND, bool kAligned>
mx_status launch_tc(const mx_gemm_args &g, int64_t m_tiles, cudaStream_t stream)
{
    constexpr int BN = Shape::kBlockN;
    auto kernel = grouped_gemm_tc_kernel<T, Shape, KIND, kAligned>;
    const int64_t n_tiles = KIND == MX_GEMM_GATE_UP ? mx_ceil_div(g.out_cols, BN / 2)
                                                    : mx_ceil_div(g.n_rows, BN);
    static const mx_kernel_name kernel_name("grouped_gemm_tc_kernel<%s, %dx%d, %s%s>", tc_dtype_name<T>(),
                                            Shape::kBlockM, BN, mx_gemm_kind_name(KIND), kAligned ? "" : ", unaligned");
    const char *name = kernel_name.text;

    static std::atomic<unsigned long long> configured{0};
    mx_status st = mx_opt_in_smem(kernel, Shape::kSmemBytes, configured, name);
    if (st.code != MX_OK)
        return st;

    if (g.k_splits < 1 || g.k_splits > 65535 || (g.k_splits > 1 && (KIND != MX_GEMM_DOWN || g.k_split_len % 64)))
        return mx_status_fail(MX_ERR_VALUE, "%s: bad split-K (%d x %lld)", name, g.k_splits, (long long)g.k_split_len);
    return mx_launch_tile_grid<Shape>(kernel, g, m_tiles, n_tiles, name, stream);
}

template <typename T, typename Shape, int KIND>
mx_status launch_tc_aligned(const mx_gemm_args &g, int aligned, int64_t m_tiles, cudaStream_t stream)
{
    return aligned ? launch_tc<T, Shape, KIND, true>(g, m_tiles, stream)
                   : launch_tc<T, Shape, KIND, false>(g, m_tiles, stream);
}

template <typename T, typename Shape>
mx_status launch_tc_kind(const mx_gemm_args &g, mx_gemm_kind kind, int aligned, int64_t m_tiles,
                         cudaStream_t stream)
{
    switch (kind) {
    case MX_GEMM_GATE_UP: return launch_tc_aligned<T, Shape, MX_GEMM_GATE_UP>(g, aligned, m_tiles, stream);
    case MX_GEMM_GATE_UP_INTERLEAVED:
        return launch_tc_aligned<T, Shape, MX_GEMM_GATE_UP_INTERLEAVED>(g, aligned, m_tiles, stream);
    case MX_GEMM_UP: return launch_tc_aligned<T, Shape, MX_GEMM_UP>(g, aligned, m_tiles, stream);
    case MX_GEMM_DOWN: return launch_tc_aligned<T, Shape, MX_GEMM_DOWN>(g, aligned, m_tiles, stream);
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_tc: unknown kind %d", (int)kind);
}

/* Entry used by the per-dtype .cu files. */
template <typename T>
mx_status grouped_gemm_tc(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config, int aligned, int64_t m_tiles,
                          cudaStream_t stream)
{
    if (m_tiles <= 0)
        return mx_status_ok();
    switch (tile_config) {
    case MX_TILE_DECODE: return launch_tc_kind<T, mx_tile_decode>(*g, kind, aligned, m_tiles, stream);
    case MX_TILE_MID: return launch_tc_kind<T, mx_tile_mid>(*g, kind, aligned, m_tiles, stream);
    case MX_TILE_LARGE:
        return launch_tc_kind<T, mx_tile_large>(*g, kind, aligned, m_tiles, stream);
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_tc: unknown tile config %d", tile_config);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_GROUPED_GEMM_TC_CUH */
