/* FP8 w8a8 grouped GEMM on tensor cores (float8_e4m3fn x float8_e4m3fn,
 * float32 accumulate). Included by grouped_gemm_fp8.cu (expert kinds) and
 * fp8_linear.cu (dense layer), which instantiate it.
 *
 * Operands (row-major, K contiguous):
 *   A  fp8 [*, lda], quantized by fp8_quant.cu: GEMM1 x_q (row of pair p =
 *      token p / top_k: the gather is fused into the A loads), GEMM2 act_q
 *      (row s), LINEAR x_q (row s). lda % 16 == 0 and the columns [k, lda)
 *      are zero, so A always takes 16-byte loads.
 *   W  fp8 [E_local, n_rows, K] (w13, w2 or the linear weight), read as the
 *      mma's column-major B.
 *   Scales: TENSOR  a_scale [1], w_scale [E_local];
 *           BLOCK   a_scale [row, K/128] (per token and 128 columns),
 *                   w_scale [E_local, n_rows/128, K/128] (128x128 blocks).
 * Math (numerics.md "FP8"): TENSOR out = (qa @ qw.T) * sa * sw; BLOCK: each
 * 128-wide k tile is accumulated on its own (acc_slice) and promoted as
 * acc += acc_slice * sa[row, kb] * sw[nb, kb] in registers (the scales of the
 * tile's rows and columns come with the tile through shared memory).
 Tensor cores: mma.sync m16n8k32 e4m3 on sm_89. sm_90 has no e4m3
 * mma.sync in hardware (ptxas lowers it to f16 HMMA plus unpacks), so there
 * the fragments are converted to f16 once (exact) and fed to m16n8k16 f16
 * mmas: the rate of the 16-bit kernels, not Hopper's FP8 rate, which only
 * wgmma reaches. sm_80 converts with a bit shuffle instead (no FP8 cvt
 * there); see fp8_mma_tile.
 * Tiling, pipeline and epilogue follow grouped_gemm_tc.cuh: kStages-deep
 * cp.async ring of 128-byte k slices, XOR swizzle, ldmatrix.x4 (an 8x8 b16
 * matrix is 8 rows x 16 fp8 values, exactly the m16n8k32 fragment layout);
 * rows past the expert's segment, weight rows past n_rows and columns past
 * K read as zero; weights whose rows do not allow 16-byte loads take the
 * byte-wise loader (kAlignedW = false). Split-K (GEMM2 at decode) writes
 * float32 slices that moe_sum adds in a fixed order.
 * Epilogue (runtime out_dtype): bias in float32 after scaling; GEMM1 kinds
 * apply the activation and store act rounded to out_dtype (with TENSOR also
 * the atomic amax of the rounded values, for GEMM2's activation scale);
 * DOWN multiplies by the routing weight and stores float32 y; LINEAR stores
 * out rounded to out_dtype.
 *
 * The launcher guarantees: tile tables from moe_align with this config's
 * kBlockM (not LINEAR); grids sized for the worst case (CTAs past num_tiles
 * exit); int32-indexable rows; k_split_len a multiple of 128. */
#ifndef MOE_EXT_CUDA_GROUPED_GEMM_FP8_CUH
#define MOE_EXT_CUDA_GROUPED_GEMM_FP8_CUH

#include <atomic>

#include "common.cuh"
#include "fp8.cuh"
#include "gemm_configs_fp8.cuh"
#include "mma_sync_ptx.cuh"

namespace {

/* Which tensor-core path a device pass compiles (see the file comment):
 *   sm_89          native e4m3 mma (QMMA)
 *   sm_90          e4m3 -> f16 by cvt, once per fragment register, then f16
 *                  mma: ptxas would lower the e4m3 mma.sync to the same f16
 *                  HMMA but re-convert the operands for every mma (3
 *                  unpacks per HMMA instead of 1.5 here)
 *   sm_80          no FP8 conversion either: the bit-shuffle fp8x2_as_f16x2
 * MX_FP8_FORCE_F16_MMA (test builds) selects the sm_80 path on any GPU. */
#if defined(__CUDA_ARCH__) && !defined(MX_FP8_FORCE_F16_MMA)
#if __CUDA_ARCH__ >= 890 && __CUDA_ARCH__ < 900
#define MX_FP8_MMA_NATIVE 1
#elif __CUDA_ARCH__ >= 900
#define MX_FP8_MMA_CVT 1
#endif
#endif

/* e4m3 bytes (b0, b1) and (b2, b3) of x as two f16 pairs, lo and hi. The
 * sm_80 form re-reads each byte as an f16 worth 2^-8 of it: the e4m3
 * exponent and mantissa fields land in the low end of the f16 fields (bias 7
 * read as bias 15); exact for all finite e4m3 values, subnormals included
 * (NaN reads as 1.875); fp8_mma_unit() restores the 2^16 of a product. */
__device__ __forceinline__ void fp8x4_to_f16x4(uint32_t x, uint32_t &lo, uint32_t &hi)
{
#if defined(MX_FP8_MMA_CVT)
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
        " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(x));
#else
    const uint32_t wl = __byte_perm(x, 0u, 0x1404u); /* b0, b1 -> high byte of each half */
    const uint32_t wh = __byte_perm(x, 0u, 0x3424u); /* b2, b3 */
    lo = (wl & 0x80008000u) | ((wl >> 1) & 0x3f803f80u);
    hi = (wh & 0x80008000u) | ((wh >> 1) & 0x3f803f80u);
#endif
}

__device__ __forceinline__ float fp8_mma_unit()
{
#if defined(MX_FP8_MMA_NATIVE) || defined(MX_FP8_MMA_CVT)
    return 1.0f;
#else
    return 65536.0f;
#endif
}

/* c[i][j] += a[i] (16x32, row) * b[j] (32x8, col) on e4m3 fragments from
 * ldmatrix (a: rows g | g+8 x k 0-15 | 16-31; b: k 0-15 | 16-31; a thread's
 * register holds k 4t..4t+3). The f16 path splits k into two k16 mmas; in
 * each, the f16 slots (2t, 2t+1) and (8+2t, 9+2t) of a thread hold its real
 * k (4t, 4t+1) and (4t+2, 4t+3) in A and B alike, so the sum over k is the
 * same. */
template <int MI, int NJ>
__device__ __forceinline__ void fp8_mma_tile(float (&c)[MI][NJ][4], const uint32_t (&a)[MI][4],
                                             const uint32_t (&b)[NJ][2])
{
#if defined(MX_FP8_MMA_NATIVE)
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
            asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
                         "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                         : "+f"(c[i][j][0]), "+f"(c[i][j][1]), "+f"(c[i][j][2]), "+f"(c[i][j][3])
                         : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b[j][0]), "r"(b[j][1]));
#else
#pragma unroll
    for (int h = 0; h < 2; ++h) { /* k 0-15, then 16-31 */
        uint32_t ah[MI][4], bh[NJ][2];
#pragma unroll
        for (int i = 0; i < MI; ++i) {
            fp8x4_to_f16x4(a[i][2 * h], ah[i][0], ah[i][2]);     /* row g */
            fp8x4_to_f16x4(a[i][2 * h + 1], ah[i][1], ah[i][3]); /* row g + 8 */
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j)
            fp8x4_to_f16x4(b[j][h], bh[j][0], bh[j][1]);
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j)
                mx_mma_16816<__half>::run(c[i][j], ah[i], bh[j]);
    }
#endif
}

/* One 16-byte chunk (16 fp8 values from column k0) of a weight row; row ==
 * nullptr or columns >= k_end read as zero. */
template <bool kAligned>
__device__ __forceinline__ void fp8_load_w_chunk(uint8_t *dst, const uint8_t *row, int64_t k0, int64_t k_end,
                                                 const void *dummy)
{
    if (kAligned) {
        const bool ok = row != nullptr && k0 < k_end; /* K % 16 == 0: a chunk is all in or all out */
        mx_cp_async16(dst, ok ? static_cast<const void *>(row + k0) : dummy, ok ? 16 : 0);
    } else {
        uint32_t w[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            w[e] = 0u;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int64_t k = k0 + 4 * e + b;
                w[e] |= (row && k < k_end ? static_cast<uint32_t>(row[k]) : 0u) << (8 * b);
            }
        }
        *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

/* ---- epilogue ------------------------------------------------------------------ */

__device__ __forceinline__ float fp8_round_to(float v, mx_dtype dt)
{
    return dt == MX_BF16 ? __bfloat162float(__float2bfloat16_rn(v))
         : dt == MX_F16  ? __half2float(__float2half_rn(v))
                         : v;
}

/* n (<= 4) consecutive values into a row of dtype dt; vec: one 8- or
 * 16-byte store of all four (the caller guarantees the alignment). */
__device__ __forceinline__ void fp8_store_out(void *base, mx_dtype dt, int64_t off, const float (&v)[4], int n,
                                              bool vec)
{
    if (dt == MX_F32) {
        float *d = static_cast<float *>(base) + off;
        if (vec && n == 4) {
            *reinterpret_cast<float4 *>(d) = make_float4(v[0], v[1], v[2], v[3]);
            return;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (q < n)
                d[q] = v[q];
    } else if (dt == MX_BF16) {
        __nv_bfloat16 *d = static_cast<__nv_bfloat16 *>(base) + off;
        if (vec && n == 4) {
            *reinterpret_cast<uint2 *>(d) =
                make_uint2(mx_pack2<__nv_bfloat16>(v[0], v[1]), mx_pack2<__nv_bfloat16>(v[2], v[3]));
            return;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (q < n)
                d[q] = __float2bfloat16_rn(v[q]);
    } else {
        __half *d = static_cast<__half *>(base) + off;
        if (vec && n == 4) {
            *reinterpret_cast<uint2 *>(d) = make_uint2(mx_pack2<__half>(v[0], v[1]), mx_pack2<__half>(v[2], v[3]));
            return;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (q < n)
                d[q] = __float2half_rn(v[q]);
    }
}

/* Input: the CTA's scaled float32 tile C [BM][ldc] in shared memory (column
 * c = the CTA's weight row c; gated kinds as in gemm_epilogue.cuh) and its
 * pair indices (-1 = padding). Threads walk the tile row by row, four
 * consecutive output columns each (a warp covers 128 consecutive columns). */
template <int KIND, int QUANT, int BM, int BN, int THREADS>
__device__ __forceinline__ void fp8_gemm_epilogue(const float *C, int ldc, const int32_t *tile_pairs, int64_t row0,
                                                  int64_t nt, int expert, int split, const mx_fp8_gemm_args &g)
{
    constexpr bool kPaired = KIND == MX_GEMM_GATE_UP || KIND == MX_GEMM_GATE_UP_INTERLEAVED;
    constexpr bool kGemm1 = kPaired || KIND == MX_GEMM_UP;
    constexpr int OC = kPaired ? BN / 2 : BN; /* output columns of the tile */
    constexpr int V = 4;
    static_assert(OC % V == 0, "whole column quads per tile");
    const mx_dtype dt = g.out_dtype;
    /* with split-K (GEMM2 only) the bias goes into slice 0 alone */
    const void *bias = split == 0 ? g.bias : nullptr;
    const int64_t b0 = static_cast<int64_t>(expert) * g.n_rows;
    const int64_t col0 = nt * OC;
    const bool vec = g.vec_out != 0;
    float amax = 0.0f;
    for (int idx = threadIdx.x; idx < BM * (OC / V); idx += THREADS) {
        const int r = idx / (OC / V), c = (idx % (OC / V)) * V;
        const int32_t pair = tile_pairs[r];
        const int64_t col = col0 + c;
        if (pair < 0 || col >= g.out_cols)
            continue;
        const int valid = g.out_cols - col < V ? static_cast<int>(g.out_cols - col) : V;
        const float *crow = C + r * ldc;
        float v[V];
        if (KIND == MX_GEMM_GATE_UP) {
            const float4 ga = *reinterpret_cast<const float4 *>(crow + c);
            const float4 up = *reinterpret_cast<const float4 *>(crow + OC + c);
            const float gv[V] = {ga.x, ga.y, ga.z, ga.w}, uv[V] = {up.x, up.y, up.z, up.w};
#pragma unroll
            for (int q = 0; q < V; ++q) {
                float gate = gv[q], u = uv[q];
                if (bias && q < valid) {
                    gate += mx_load_float(bias, dt, b0 + col + q);
                    u += mx_load_float(bias, dt, b0 + g.out_cols + col + q);
                }
                v[q] = mx_act_gated(g.activation, gate, u, g.swiglu_alpha, g.swiglu_limit);
            }
        } else if (KIND == MX_GEMM_GATE_UP_INTERLEAVED) {
            const float4 p0 = *reinterpret_cast<const float4 *>(crow + 2 * c);
            const float4 p1 = *reinterpret_cast<const float4 *>(crow + 2 * c + 4);
            const float gv[V] = {p0.x, p0.z, p1.x, p1.z}, uv[V] = {p0.y, p0.w, p1.y, p1.w};
#pragma unroll
            for (int q = 0; q < V; ++q) {
                float gate = gv[q], u = uv[q];
                if (bias && q < valid) {
                    gate += mx_load_float(bias, dt, b0 + 2 * (col + q));
                    u += mx_load_float(bias, dt, b0 + 2 * (col + q) + 1);
                }
                v[q] = mx_act_gated(g.activation, gate, u, g.swiglu_alpha, g.swiglu_limit);
            }
        } else {
            const float4 h = *reinterpret_cast<const float4 *>(crow + c);
            const float hv[V] = {h.x, h.y, h.z, h.w};
            const float w = KIND == MX_GEMM_DOWN && g.scale_by_weight ? g.topk_weights[pair] : 1.0f;
#pragma unroll
            for (int q = 0; q < V; ++q) {
                float x = hv[q] + (bias && q < valid ? mx_load_float(bias, dt, b0 + col + q) : 0.0f);
                v[q] = KIND == MX_GEMM_UP ? mx_act_plain(g.activation, x) : KIND == MX_GEMM_DOWN ? x * w : x;
            }
        }
        if (KIND == MX_GEMM_DOWN) {
            fp8_store_out(g.out, MX_F32, split * g.out_split_stride + static_cast<int64_t>(pair) * g.ldo + col, v,
                          valid, vec);
        } else {
#pragma unroll
            for (int q = 0; q < V; ++q) {
                v[q] = fp8_round_to(v[q], dt); /* the act-dtype values GEMM2's quantizer will see */
                if (kGemm1 && QUANT == MX_QUANT_FP8_TENSOR && q < valid)
                    amax = mx_amax_step(amax, v[q]);
            }
            const int64_t out_row = KIND == MX_GEMM_LINEAR ? static_cast<int64_t>(pair) : row0 + r;
            fp8_store_out(g.out, dt, out_row * g.ldo + col, v, valid, vec);
        }
    }
    if (kGemm1 && QUANT == MX_QUANT_FP8_TENSOR) {
        amax = mx_warp_max(amax);
        if ((threadIdx.x & 31) == 0 && !(amax <= 0.0f)) /* > 0 or NaN */
            mx_atomic_amax(g.amax, amax);
    }
}

/* ---- kernel ------------------------------------------------------------------- */

template <typename Shape, int KIND, int QUANT, bool kAlignedW>
__global__ void __launch_bounds__(Shape::kThreads,
                                  QUANT == MX_QUANT_FP8_BLOCK ? Shape::kMinBlocksBlock : Shape::kMinBlocksTensor)
    grouped_gemm_fp8_kernel(const mx_fp8_gemm_args g)
{
    constexpr int BM = Shape::kBlockM, BN = Shape::kBlockN, BK = Shape::kBlockK;
    constexpr int THREADS = Shape::kThreads, STAGES = Shape::kStages;
    constexpr int WM = BM / Shape::kWarpsM, WN = BN / Shape::kWarpsN;
    constexpr int MI = WM / 16, NJ = WN / 8;
    constexpr int ROWS_PER_PASS = THREADS / 8; /* tile rows loaded per pass (8 chunks each) */
    constexpr int A_PASSES = BM / ROWS_PER_PASS, B_PASSES = BN / ROWS_PER_PASS;
    constexpr bool kBlock = QUANT == MX_QUANT_FP8_BLOCK;
    constexpr bool kLinear = KIND == MX_GEMM_LINEAR;
    static_assert(BK == 128 && BK == kFp8Block, "a k tile is one row of 8 16-byte chunks and one scale block");
    static_assert(ROWS_PER_PASS % 8 == 0, "a thread keeps the same swizzle phase in every pass");
    static_assert(A_PASSES >= 1 && B_PASSES >= 1, "every thread loads A and B chunks");

    extern __shared__ __align__(128) unsigned char fp8_smem[];
    __shared__ const uint8_t *a_rows[BM];                 /* source row of each tile row, nullptr = zero */
    __shared__ const uint8_t *b_rows[BN];                 /* weight row of each tile column, nullptr = zero */
    __shared__ const float *a_scale_rows[kBlock ? BM : 1]; /* BLOCK: scale row of each tile row */
    __shared__ const float *b_scale_rows[kBlock ? BN : 1]; /* BLOCK: scale row of each weight row's 128-block */
    __shared__ int32_t tile_pairs[BM];                    /* pair (or LINEAR row) of each tile row, -1 = none */
    uint8_t *const sA = fp8_smem;
    uint8_t *const sB = sA + STAGES * BM * BK;
    float *const sSA = reinterpret_cast<float *>(sB + STAGES * BN * BK); /* [STAGES][BM] */
    float *const sSB = sSA + STAGES * BM;                                /* [STAGES][BN] */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / Shape::kWarpsN, wn = warp % Shape::kWarpsN;
    const int64_t mt = g.m_tile_base + (Shape::kMOnX ? blockIdx.x : blockIdx.y);
    const int64_t nt = Shape::kMOnX ? blockIdx.y : blockIdx.x;
    const int split = blockIdx.z;
    int expert = 0;
    if (!kLinear) {
        if (mt >= *g.num_tiles)
            return; /* past the tiles in use: the grid is sized for the worst case */
        expert = g.tile_expert[mt];
    }
    const int64_t row0 = mt * BM;
    const uint8_t *W = g.w + static_cast<int64_t>(expert) * g.n_rows * g.k;
    const int64_t k_blocks = (g.k + BK - 1) / BK;
    const int64_t k_begin = static_cast<int64_t>(split) * g.k_split_len;
    const int64_t k_end = g.k - k_begin < g.k_split_len ? g.k : k_begin + g.k_split_len;

    for (int r = tid; r < BM; r += THREADS) {
        int32_t pair;
        int64_t src;
        if (kLinear) {
            pair = row0 + r < g.rows ? static_cast<int32_t>(row0 + r) : -1;
            src = row0 + r;
        } else {
            pair = g.sorted_ids[row0 + r];
            src = KIND == MX_GEMM_DOWN ? row0 + r : static_cast<int64_t>(pair / g.top_k);
        }
        tile_pairs[r] = pair;
        a_rows[r] = pair >= 0 ? g.a + src * g.lda : nullptr;
        if (kBlock)
            a_scale_rows[r] = pair >= 0 ? g.a_scale + src * g.a_scale_ld : nullptr;
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
        if (kBlock)
            b_scale_rows[r] = ok ? g.w_scale + (static_cast<int64_t>(expert) * ((g.n_rows + BK - 1) / BK) + row / BK) *
                                                   k_blocks
                                 : nullptr;
    }
    __syncthreads();

    const int chunk = tid & 7;
    const int first_row = tid >> 3;
    const int swz = (chunk ^ (first_row & 7)) << 4; /* same for every pass */
    auto load_stage = [&](int stage, int kt) {
        const int64_t kt0 = k_begin + static_cast<int64_t>(kt) * BK;
        const int64_t k0 = kt0 + chunk * 16;
        uint8_t *a = sA + stage * BM * BK;
        uint8_t *b = sB + stage * BN * BK;
#pragma unroll
        for (int i = 0; i < A_PASSES; ++i) {
            const int r = first_row + i * ROWS_PER_PASS;
            /* a chunk straddling k reads A's zero padding: whole chunks only */
            const bool ok = a_rows[r] != nullptr && k0 < k_end;
            mx_cp_async16(a + r * BK + swz, ok ? static_cast<const void *>(a_rows[r] + k0) : g.w, ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < B_PASSES; ++i) {
            const int r = first_row + i * ROWS_PER_PASS;
            fp8_load_w_chunk<kAlignedW>(b + r * BK + swz, b_rows[r], k0, k_end, g.w);
        }
        if (kBlock) {
            const int64_t kb = kt0 / BK;
            for (int r = tid; r < BM + BN; r += THREADS) {
                const float *s = r < BM ? a_scale_rows[r] : b_scale_rows[r - BM];
                float *d = r < BM ? sSA + stage * BM + r : sSB + stage * BN + (r - BM);
                mx_cp_async4(d, s ? static_cast<const void *>(s + kb) : g.w, s ? 4 : 0);
            }
        }
    };

    float acc[MI][NJ][4];
    float part[kBlock ? MI : 1][kBlock ? NJ : 1][4]; /* BLOCK: the current k tile's sums */
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

    /* ldmatrix lane roles: A matrices (rows 0-7 | 8-15) x (k 0-15 | 16-31);
     * B matrices (fragment j | j+1) x (k 0-15 | 16-31). */
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

        const int stage = kt % STAGES;
        const uint8_t *a = sA + stage * BM * BK;
        const uint8_t *b = sB + stage * BN * BK;
        if constexpr (kBlock) {
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        part[i][j][q] = 0.0f;
        }
#pragma unroll
        for (int ks = 0; ks < BK / 32; ++ks) {
            uint32_t af[MI][4];
            uint32_t bf[NJ][2];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const int r = a_row + i * 16;
                mx_ldmatrix_x4(af[i][0], af[i][1], af[i][2], af[i][3],
                                a + r * BK + (((2 * ks + a_chunk) ^ (r & 7)) << 4));
            }
#pragma unroll
            for (int j = 0; j < NJ; j += 2) {
                const int r = b_row + j * 8;
                mx_ldmatrix_x4(bf[j][0], bf[j][1], bf[j + 1][0], bf[j + 1][1],
                                b + r * BK + (((2 * ks + b_chunk) ^ (r & 7)) << 4));
            }
            if constexpr (kBlock)
                fp8_mma_tile<MI, NJ>(part, af, bf);
            else
                fp8_mma_tile<MI, NJ>(acc, af, bf);
        }
        if constexpr (kBlock) {
            /* promote: acc += part * sa[row] * sw[col] (this k tile's scales) */
            const float *sa = sSA + stage * BM;
            const float *sb = sSB + stage * BN;
            const float unit = fp8_mma_unit();
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const int r = wm * WM + i * 16 + (lane >> 2);
                const float sa0 = sa[r] * unit, sa1 = sa[r + 8] * unit;
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    const float2 sw = *reinterpret_cast<const float2 *>(sb + wn * WN + j * 8 + 2 * (lane & 3));
                    acc[i][j][0] = fmaf(part[i][j][0], sa0 * sw.x, acc[i][j][0]);
                    acc[i][j][1] = fmaf(part[i][j][1], sa0 * sw.y, acc[i][j][1]);
                    acc[i][j][2] = fmaf(part[i][j][2], sa1 * sw.x, acc[i][j][2]);
                    acc[i][j][3] = fmaf(part[i][j][3], sa1 * sw.y, acc[i][j][3]);
                }
            }
        }
    }

    mx_cp_async_wait<0>();
    __syncthreads(); /* the pipeline buffers become the epilogue tile */
    const float scale = kBlock ? 1.0f : g.a_scale[0] * g.w_scale[expert] * fp8_mma_unit();
    float *C = reinterpret_cast<float *>(fp8_smem);
    constexpr int LDC = Shape::kLdc;
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int r = wm * WM + i * 16 + (lane >> 2);
            const int c = wn * WN + j * 8 + 2 * (lane & 3);
            *reinterpret_cast<float2 *>(C + r * LDC + c) = make_float2(acc[i][j][0] * scale, acc[i][j][1] * scale);
            *reinterpret_cast<float2 *>(C + (r + 8) * LDC + c) =
                make_float2(acc[i][j][2] * scale, acc[i][j][3] * scale);
        }
    __syncthreads();
    fp8_gemm_epilogue<KIND, QUANT, BM, BN, THREADS>(C, LDC, tile_pairs, row0, nt, expert, split, g);
}

/* ---- launch ------------------------------------------------------------------- */

template <typename Shape, int KIND, int QUANT, bool kAlignedW>
mx_status launch_fp8(const mx_fp8_gemm_args &g, int64_t m_tiles, cudaStream_t stream)
{
    constexpr int BN = Shape::kBlockN;
    auto kernel = grouped_gemm_fp8_kernel<Shape, KIND, QUANT, kAlignedW>;
    const int64_t n_tiles = KIND == MX_GEMM_GATE_UP ? mx_ceil_div(g.out_cols, BN / 2)
                                                        : mx_ceil_div(g.n_rows, BN);
    static const mx_kernel_name kernel_name("grouped_gemm_fp8_kernel<%dx%d, %s, %s%s>", Shape::kBlockM, BN,
                                            mx_gemm_kind_name(KIND), QUANT == MX_QUANT_FP8_BLOCK ? "block" : "tensor",
                                            kAlignedW ? "" : ", unaligned");
    const char *name = kernel_name.text;

    static std::atomic<unsigned long long> configured{0};
    mx_status st = mx_opt_in_smem(kernel, Shape::kSmemBytes, configured, name);
    if (st.code != MX_OK)
        return st;

    if (g.k_splits < 1 || g.k_splits > 65535 ||
        (g.k_splits > 1 && (KIND != MX_GEMM_DOWN || g.k_split_len % Shape::kBlockK)))
        return mx_status_fail(MX_ERR_VALUE, "%s: bad split-K (%d x %lld)", name, g.k_splits, (long long)g.k_split_len);
    return mx_launch_tile_grid<Shape>(kernel, g, m_tiles, n_tiles, name, stream);
}

/* (config, alignment) -> instantiation; unaligned weights only with mid. */
template <int KIND, int QUANT>
mx_status launch_fp8_config(const mx_fp8_gemm_args &g, int tile_config, int aligned_w, int64_t m_tiles,
                            cudaStream_t stream)
{
    if (!aligned_w) {
        if (tile_config != MX_FP8_TILE_MID)
            return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_fp8: weights without 16-byte rows need the mid "
                                  "tile config, got %d", tile_config);
        return launch_fp8<mx_fp8_tile_mid, KIND, QUANT, false>(g, m_tiles, stream);
    }
    switch (tile_config) {
    case MX_FP8_TILE_DECODE: return launch_fp8<mx_fp8_tile_decode, KIND, QUANT, true>(g, m_tiles, stream);
    case MX_FP8_TILE_MID: return launch_fp8<mx_fp8_tile_mid, KIND, QUANT, true>(g, m_tiles, stream);
    case MX_FP8_TILE_LARGE: return launch_fp8<mx_fp8_tile_large, KIND, QUANT, true>(g, m_tiles, stream);
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_fp8: unknown tile config %d", tile_config);
}

template <int KIND>
mx_status launch_fp8_quant(const mx_fp8_gemm_args &g, mx_quant quant, int tile_config, int aligned_w,
                           int64_t m_tiles, cudaStream_t stream)
{
    if (m_tiles <= 0)
        return mx_status_ok();
    switch (quant) {
    case MX_QUANT_FP8_TENSOR:
        return launch_fp8_config<KIND, MX_QUANT_FP8_TENSOR>(g, tile_config, aligned_w, m_tiles, stream);
    case MX_QUANT_FP8_BLOCK:
        return launch_fp8_config<KIND, MX_QUANT_FP8_BLOCK>(g, tile_config, aligned_w, m_tiles, stream);
    default: break;
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_fp8: quant %d is not an FP8 format", (int)quant);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_GROUPED_GEMM_FP8_CUH */
