/* Grouped GEMM for Hopper (sm_90a) at few rows per expert, with the operands
 * swapped: the expert's weight rows are wgmma's m (two boxes of 64 rows, one
 * m64 wgmma each) and the tile's kBlockT sorted rows (tokens) its n, so a
 * 16-row tile costs m64n16 wgmmas instead of padding tokens to 64 rows.
 * Included by grouped_gemm_sm90_decode.cu, which instantiates it for
 * bfloat16, float16 and float8_e4m3 (per-tensor or 128x128 block scales),
 * every kind but FP8 GEMM2: that one runs the persistent form of this
 * kernel, grouped_gemm_sm90_decode_down.cuh, which shares the FP8 k block
 * step below.
 *
 * Operands, K contiguous, read by TMA into 128B-swizzled slots as in
 * grouped_gemm_sm90_impl.cuh (128 bytes of K per stage; the same byte
 * offsets for 16-bit and fp8 elements):
 *   A  [rows, K] by sorted row s: GEMM2 act by TMA, box 128 B x kBlockT
 *      rows; GEMM1 the x rows of the tile's tokens, copied by warp 0 with
 *      cp.async straight into the swizzled slot (no gather pass: one launch
 *      less per forward).
 *   W  [E_local, n_rows, K], box 128 B x 64 rows x 1. Box 0 / box 1 of a
 *      tile: gate / up rows of the same 64 output columns (GATE_UP), else
 *      128 consecutive rows (interleaved gate/up pairs for swigluoai).
 * CTA = one warpgroup, one (m tile, n tile, k split) unit, not persistent
 * (2 CTAs per SM hide each other's epilogues). Grid order: chunks of
 * kDecodeGroupN n tiles slowest, then m tiles, then the chunk's n tiles and
 * k splits: the CTAs running together walk contiguous weight rows of one
 * expert, and the next m tile of the same expert re-reads that chunk while
 * it is still in L2. (m tiles fastest made two-tile experts 12% faster but
 * scattered the weight stream over experts: up to 29% slower elsewhere;
 * m tiles slowest re-read two-tile experts from DRAM. H200, 2026-11-22.)
 * Kind MX_GEMM_LINEAR (dense FP8 layer, fp8_linear.cu): identity rows
 * (no tile table, g.rows rows, one "expert"), out = acc * scale + bias in T.
 * Thread 0 (with warp 0 for GEMM1's cp.async rows) keeps kStages k blocks of
 * loads in flight: it refills a slot once every warp's wgmmas on it have
 * retired (then a CTA barrier), so the weight stream never stops while the
 * math, a few hundred cycles per 16 KB k block, waits. 16-bit operands keep
 * one k block of wgmmas in flight (wait_group 1: the slot refilled is the
 * previous k block's), so a CTA does not stall on each k block's wgmma
 * latency; FP8 waits for each k block's products (wait_group 0) to promote
 * them.
 * FP8: wgmma's own FP8 accumulation keeps too few bits over a whole K
 * (without promotion a test of 144 tokens erred 0.025 against the 2e-2
 * bound), so each k block's products (128 fp8 columns, 4 chained k steps:
 * the persistent kernel's interval) land in part and are added in float32;
 * with block scales as acc += part * sa[token, kb] * sw[box, kb] (a k block
 * is one 128-wide scale block). (Promoting every k step, 32 columns, as
 * before: 0.0023 on that test, but four wgmma round trips per k block.)
 * Launched dependent (common.cuh mx_launch_dependent): GEMM2, LINEAR and FP8
 * GEMM1 issue their first kStages weight loads before waiting for the kernel
 * ahead (its output is only their A: act_q, or x_q from the x quantizer), so
 * their weight stream starts during that kernel's tail; 16-bit GEMM1 waits
 * first (the sort just wrote its tile table).
 * Epilogue: the accumulators go through shared memory (the drained ring) as
 * a [128 weight rows][kBlockT tokens] float tile, then the threads walk the
 * outputs column-fastest: GEMM1 kinds apply scale, bias and activation and
 * store act in T (per-tensor FP8 also the warp's atomic amax); GEMM2 stores
 * float32 (acc * scale + bias on split 0) * routing weight into its split-K
 * slice of y. Block-scaled FP8 GEMM1 on 16- and 32-token tiles stores act
 * quantized instead (sc.act_q, the group quantizer's bits: values rounded to
 * T, scale max(amax, 1e-10) / 448 per token and 128 columns): each token
 * row's maxima go to shared memory, and a tile of 64 act columns runs in a
 * 2-CTA cluster with its group's other tile, the two exchanging their maxima
 * through distributed shared memory before a cluster barrier. That saves
 * the act quantizer's launch and act's round trip (gemm_configs.cuh
 * kSm90DecodeQuantActMaxTokens has the measurements).
 *
 * The launcher guarantees: tile tables from moe_align with block_m =
 * kBlockT; TMA preconditions (16-byte row strides and bases); block scales
 * with GATE_UP only when out_cols % 64 == 0 (a 64-row box in one scale
 * block); g.k_splits slices of g.k_split_len (a multiple of 128 bytes of K),
 * each non-empty, splits only for GEMM2. */
#ifndef MOE_EXT_CUDA_GROUPED_GEMM_SM90_DECODE_CUH
#define MOE_EXT_CUDA_GROUPED_GEMM_SM90_DECODE_CUH

#include "gemm_configs.cuh"
#include "grouped_gemm_sm90.cuh"
#include "sm90_common.cuh"

namespace {

constexpr int kDecodeGroupN = 8; /* n tiles per chunk of the grid order (1024 weight rows) */

/* GEMM1 kinds read their A rows by token from g.a with cp.async; DOWN and
 * LINEAR read A [rows, K] by TMA. */
__host__ __device__ constexpr bool decode_rows_from_x(int kind) { return kind != MX_GEMM_DOWN && kind != MX_GEMM_LINEAR; }

/* GEMM1 kinds: act columns of a tile (128 weight rows: gate + up halves, or
 * gate / up pairs, give 64). */
__host__ __device__ constexpr int decode_act_cols(int kind) { return kind == MX_GEMM_UP ? 128 : 64; }

/* Whether the kernel quantizes act itself (sc.act_q): block-scaled GEMM1 on
 * small tiles (gemm_configs.cuh mx_tile_sm90_decode_quantizes_act). */
__host__ __device__ constexpr bool decode_quantizes_act(int kind, int quant, int tokens)
{
    return quant == MX_QUANT_FP8_BLOCK && decode_rows_from_x(kind) && tokens <= kSm90DecodeQuantActMaxTokens;
}

/* Whether those tiles hold half a 128-column group, so that they run in
 * 2-CTA clusters (the group's two tiles) to reduce its maxima. */
__host__ __device__ constexpr bool decode_quantizes_in_pairs(int kind, int quant, int tokens)
{
    return decode_quantizes_act(kind, quant, tokens) && decode_act_cols(kind) == 64;
}

/* What decode_fp8_k_block runs while its wgmmas do: nothing by default. */
struct decode_nothing {
    __device__ __forceinline__ void operator()() const {}
};

/* The scales of one k block of FP8 products: the thread's token slots'
 * (a_s; slot j is token column 8 (j / 2) + 2q + j % 2) and the two weight
 * boxes' (w0, w1); all 1 with per-tensor scales. */
template <int BT>
struct decode_k_scales {
    float a_s[BT / 4], w0, w1;
};

/* One k block of FP8 products, promoted: its 4 chained k steps land in
 * part0 / part1 (weight boxes 0 / 1 at w_src, w_src + box_bytes; A at
 * a_src) and are added in float32 as acc += part * ks.a_s[token slot] *
 * ks.w (the tensor cores' own FP8 accumulation keeps too few bits over the
 * whole K). Accumulator e holds token slot 2 (e / 4) + e % 2. `during`
 * runs between the wgmmas' issue and the wait for them, and may write ks
 * (its loads then overlap the wgmmas): ks is read after it. */
template <int BT, typename During = decode_nothing>
__device__ __forceinline__ void decode_fp8_k_block(float (&acc0)[BT / 2], float (&acc1)[BT / 2], uint32_t w_src,
                                                   uint32_t a_src, uint32_t box_bytes, const decode_k_scales<BT> &ks,
                                                   During during = During())
{
    typedef __nv_fp8_e4m3 TA;
    float part0[BT / 2], part1[BT / 2];
    fence_acc(part0);
    fence_acc(part1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        sm90_wgmma<TA, BT>::run(part0, sw128_desc(w_src + kk * 32), sw128_desc(a_src + kk * 32), kk > 0);
        sm90_wgmma<TA, BT>::run(part1, sw128_desc(w_src + box_bytes + kk * 32), sw128_desc(a_src + kk * 32), kk > 0);
    }
    wgmma_commit();
    during();
    wgmma_wait<0>();
    fence_acc(part0);
    fence_acc(part1);
#pragma unroll
    for (int e = 0; e < BT / 2; ++e) {
        const float a = ks.a_s[2 * (e / 4) + (e % 2)];
        acc0[e] = fmaf(part0[e], a * ks.w0, acc0[e]);
        acc1[e] = fmaf(part1[e], a * ks.w1, acc1[e]);
    }
}

template <typename TA, typename T, typename Shape, int KIND, int QUANT>
__global__ void __launch_bounds__(Shape::kThreads)
    grouped_gemm_sm90_decode_kernel(const __grid_constant__ CUtensorMap tma_a, /* A [rows, K], box 128 B x kBlockT */
                                    const __grid_constant__ CUtensorMap tma_w, /* W [E, n_rows, K], box 128 B x 64 x 1 */
                                    const mx_gemm_args g, const mx_sm90_scales sc,
                                    int m_tiles,      /* m tiles of the grid (the worst case) */
                                    int n_tiles,      /* n tiles per m tile */
                                    int kb_per_split) /* k blocks per split-K slice */
{
#if MX_SM90_DEVICE_PASS
    constexpr int BT = Shape::kBlockT, STAGES = Shape::kStages, LDD = Shape::kLdd;
    constexpr int BK = 128 / static_cast<int>(sizeof(TA)); /* k elements per stage */
    constexpr int NACC = BT / 2;                           /* accumulators of one m64nBT wgmma per thread */
    constexpr uint32_t W_BYTES = Shape::kWBytes, BOX_BYTES = W_BYTES / 2, STAGE_BYTES = Shape::kStageBytes;
    constexpr bool kGated = KIND == MX_GEMM_GATE_UP;
    constexpr bool kBlockScales = QUANT == MX_QUANT_FP8_BLOCK;
    constexpr bool kLinear = KIND == MX_GEMM_LINEAR;
    constexpr bool kRowsFromX = decode_rows_from_x(KIND);
    constexpr int kLoaders = kRowsFromX ? 32 : 1;                 /* warp 0's lanes, or thread 0 */
    constexpr int NCOL = decode_act_cols(KIND);                   /* GEMM1: act columns of a tile */
    /* BLOCK GEMM1 on tiles of up to kSm90DecodeQuantActMaxTokens quantizes
     * act in its epilogue (per token and 128 columns); tiles of 64 act
     * columns run in clusters of two (rank = n tile parity), which reduce
     * each group's amax over both tiles */
    constexpr bool kQuantAct = decode_quantizes_act(KIND, QUANT, BT);
    constexpr bool kPairQuant = decode_quantizes_in_pairs(KIND, QUANT, BT);
    /* launched dependent (common.cuh): GEMM2, LINEAR and FP8 GEMM1 (after
     * the x quantizer) know their weight tiles before the previous kernel
     * ends (the tile table is older); 16-bit GEMM1 reads the tile table the
     * previous kernel (moe_align) writes */
    constexpr bool kWaitFirst = kRowsFromX && QUANT == MX_QUANT_NONE;
    /* weight loads in pairs of k blocks (gemm_configs.cuh mx_sm90_decode_shape) */
    constexpr bool kPairedLoads = Shape::kPairedLoads;
    if (kWaitFirst) {
        mx_griddep_wait();
        mx_griddep_launch_dependents();
    }

    const int splits = g.k_splits;
    const int per_mt = kDecodeGroupN * splits; /* CTAs of one m tile in one chunk */
    const int chunk = blockIdx.x / (per_mt * m_tiles), in_chunk = blockIdx.x % (per_mt * m_tiles);
    const int mt = in_chunk / per_mt;
    const int nt = chunk * kDecodeGroupN + (in_chunk % per_mt) / splits;
    const int split = in_chunk % splits;
    /* the grid covers the worst case and whole chunks (an early exit writes
     * nothing); with paired quantization a tile past n_tiles whose partner
     * holds the last group's only tile meets it at the cluster barrier */
    const bool past = nt >= n_tiles, partner = kPairQuant && (nt ^ 1) < n_tiles;
    if ((past && !partner) || (!kLinear && mt >= *g.num_tiles))
        return;
    if (kPairQuant && past) {
        cluster_sync();
        return;
    }
    const int expert = kLinear ? 0 : g.tile_expert[mt];
    const int k_blocks = static_cast<int>((g.k + BK - 1) / BK);
    const int kb0 = split * kb_per_split;
    const int kb1 = kb0 + kb_per_split < k_blocks ? kb0 + kb_per_split : k_blocks;
    const int64_t a_row = static_cast<int64_t>(mt) * BT;
    const int c = kGated ? nt * 64 : nt * 128;
    const int row0 = c, row1 = kGated ? static_cast<int>(g.out_cols) + c : c + 64; /* the two boxes' first rows */

    extern __shared__ __align__(1024) unsigned char sm90_decode_smem[];
    const uint32_t raw = mx_smem_addr(sm90_decode_smem);
    const uint32_t base = (raw + 1023u) & ~1023u;
    const uint32_t bars = base + STAGES * STAGE_BYTES;
    auto full_bar = [&](int s) { return bars + 8u * static_cast<uint32_t>(s); };
    float *dtile = reinterpret_cast<float *>(sm90_decode_smem + (base - raw)); /* epilogue, over the drained ring */
    __shared__ int32_t tile_pair[BT];
    __shared__ float tile_weight[BT];
    __shared__ const unsigned char *tile_row[BT]; /* GEMM1: the token's x row, nullptr for padding */
    /* kQuantAct: the token rows' partial maxima as float bits [rank][warp of the row][token slot],
     * then each row's group scale and its reciprocal */
    __shared__ uint32_t tile_amax[kQuantAct ? 2 * (NCOL / 32) * BT : 1];
    __shared__ float tile_scale[kQuantAct ? BT : 1], tile_recip[kQuantAct ? BT : 1];

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, q = lane % 4;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s)
            mbar_init(full_bar(s), kRowsFromX ? 1 + kLoaders : 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        fence_proxy_async_smem();
    }
    if (tid < BT) {
        const int32_t pair = !kLinear ? g.sorted_ids[a_row + tid] : a_row + tid < g.rows ? static_cast<int32_t>(a_row + tid) : -1;
        tile_pair[tid] = pair;
        tile_weight[tid] = KIND == MX_GEMM_DOWN && g.scale_by_weight && pair >= 0 ? g.topk_weights[pair] : 1.0f;
        if (kRowsFromX)
            tile_row[tid] = pair < 0 ? nullptr
                                     : static_cast<const unsigned char *>(g.a) +
                                           static_cast<int64_t>(pair / g.top_k) * g.lda * static_cast<int64_t>(sizeof(TA));
    }
    __syncthreads();

    /* One stage: the two weight boxes by TMA (issue_w, thread 0: it also
     * announces the stage's bytes); the A rows (issue_a) by TMA (GEMM2,
     * LINEAR) or, for GEMM1, by cp.async from the token rows of x into the
     * same 128B-swizzled layout (16-byte chunk c of row r at r * 128 +
     * (c ^ r % 8) * 16; chunks past K and padding rows zero-filled), each
     * lane of warp 0 arriving on the stage's barrier when its copies land.
     * issue_a is called by the kLoaders threads. */
    const int64_t k_bytes = g.k * static_cast<int64_t>(sizeof(TA));
    auto slot = [&](int kb) { return (kb - kb0) % STAGES; };
    /* k block kb's stage bytes announced on its barrier; its weight box 0
     * (rows from row0) or 1 (from row1) */
    auto expect_w = [&](int kb) { mbar_arrive_expect_tx(full_bar(slot(kb)), kRowsFromX ? W_BYTES : STAGE_BYTES); };
    auto load_box = [&](int kb, int box) {
        const int s = slot(kb);
        tma_load_w(base + static_cast<uint32_t>(s) * STAGE_BYTES + box * BOX_BYTES, &tma_w, full_bar(s), kb, BK,
                   box ? row1 : row0, expert, g.w_packed);
    };
    auto issue_w = [&](int kb) {
        expect_w(kb);
        load_box(kb, 0);
        load_box(kb, 1);
    };
    /* k blocks kb and kb + 1 (if < kb1): each box's two k blocks issued together */
    auto issue_w_pair = [&](int kb) {
        if (kb + 1 >= kb1) {
            issue_w(kb);
            return;
        }
        expect_w(kb);
        expect_w(kb + 1);
        load_box(kb, 0);
        load_box(kb + 1, 0);
        load_box(kb, 1);
        load_box(kb + 1, 1);
    };
    auto issue_a = [&](int kb) {
        const int s = slot(kb);
        const uint32_t dst = base + static_cast<uint32_t>(s) * STAGE_BYTES;
        if (!kRowsFromX) {
            tma_load_2d(dst + W_BYTES, &tma_a, full_bar(s), kb * BK, static_cast<int>(a_row));
        } else {
            const int chunk = lane % 8;
            const int64_t at = static_cast<int64_t>(kb) * 128 + chunk * 16;
#pragma unroll
            for (int r = lane / 8; r < BT; r += 4) {
                const unsigned char *row = tile_row[r];
                const bool live = row != nullptr && at < k_bytes;
                mx_cp_async16(dst + W_BYTES + sw128_offset(r, 16u * chunk),
                                 live ? row + at : static_cast<const unsigned char *>(g.a), live ? 16 : 0);
            }
            mbar_arrive_cp_async(full_bar(s));
        }
    };
    const int first_end = kb1 < kb0 + STAGES ? kb1 : kb0 + STAGES;
    if (tid == 0) {
        if (!kRowsFromX)
            tma_prefetch_map(&tma_a);
        tma_prefetch_map(&tma_w);
        for (int kb = kb0; kb < first_end; kb += kPairedLoads ? 2 : 1) {
            if (kPairedLoads)
                issue_w_pair(kb);
            else
                issue_w(kb);
        }
    }
    if (!kWaitFirst) { /* A (or x_q) comes from the previous kernel */
        mx_griddep_wait();
        mx_griddep_launch_dependents();
    }
    if (tid < kLoaders)
        for (int kb = kb0; kb < first_end; ++kb)
            issue_a(kb);

    float acc0[NACC], acc1[NACC]; /* weight rows of box 0 / box 1 */
#pragma unroll
    for (int i = 0; i < NACC; ++i)
        acc0[i] = acc1[i] = 0.0f;
    /* Block scales of k block kb (decode_k_scales), loaded while its wgmmas
     * run (decode_fp8_k_block's `during`), not before its slot wait. The
     * token slots' scale rows are int32 offsets from sa_rows (the launcher
     * keeps them in range): GEMM1 from the first token's row by token,
     * DOWN and LINEAR from the tile's first row by slot; padding slots read
     * the first row's scales (their A rows are zeros or unused). */
    const float *sa_rows = kBlockScales ? sc.a_scale + (kRowsFromX ? 0 : a_row * sc.a_ld) : nullptr;
    int32_t sa_off[BT / 4];
    const float *sw0 = nullptr, *sw1 = nullptr;
    if (kBlockScales) {
        const int32_t a_ld = static_cast<int32_t>(sc.a_ld);
#pragma unroll
        for (int j = 0; j < BT / 4; ++j) {
            const int t = 8 * (j / 2) + 2 * q + (j % 2);
            const int32_t pair = tile_pair[t];
            sa_off[j] = pair < 0 ? 0 : (kRowsFromX ? pair / g.top_k : t) * a_ld;
        }
        sw0 = sm90_weight_block_scales(sc, expert, row0);
        sw1 = sm90_weight_block_scales(sc, expert, row1);
    }
    decode_k_scales<BT> ks;
#pragma unroll
    for (int j = 0; j < BT / 4; ++j)
        ks.a_s[j] = 1.0f;
    ks.w0 = ks.w1 = 1.0f;
    auto load_k_scales = [&](int kb) {
        if constexpr (kBlockScales) {
#pragma unroll
            for (int j = 0; j < BT / 4; ++j)
                ks.a_s[j] = sa_rows[sa_off[j] + kb];
            ks.w0 = sw0[kb];
            ks.w1 = sw1[kb];
        }
    };

    for (int kb = kb0; kb < kb1; ++kb) {
        const int i = kb - kb0, s = i % STAGES;
        mbar_wait(full_bar(s), static_cast<uint32_t>(i / STAGES) & 1u);
        if (kRowsFromX)
            fence_proxy_async_smem(); /* the cp.async rows, before wgmma reads them */
        const uint32_t w_src = base + static_cast<uint32_t>(s) * STAGE_BYTES, a_src = w_src + W_BYTES;
        if constexpr (QUANT != MX_QUANT_NONE) {
            decode_fp8_k_block<BT>(acc0, acc1, w_src, a_src, BOX_BYTES, ks, [&] { load_k_scales(kb); });
        } else {
            fence_acc(acc0);
            fence_acc(acc1);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                sm90_wgmma<TA, BT>::run(acc0, sw128_desc(w_src + kk * 32), sw128_desc(a_src + kk * 32), 1);
                sm90_wgmma<TA, BT>::run(acc1, sw128_desc(w_src + BOX_BYTES + kk * 32), sw128_desc(a_src + kk * 32), 1);
            }
            wgmma_commit();
            wgmma_wait<1>(); /* the previous k block's wgmmas; this one's stay in flight */
            fence_acc(acc0);
            fence_acc(acc1);
        }
        /* the k block whose slot is free: this one (FP8 waited for its
         * products), the previous one (16-bit) */
        const int done = QUANT != MX_QUANT_NONE ? kb : kb - 1;
        __syncthreads(); /* every warp's wgmmas on that slot have retired */
        if (kPairedLoads) {
            /* slots refilled two at a time: after the second of a pair frees */
            if (tid < kLoaders && done >= kb0 && (done - kb0) % 2 == 1 && done - 1 + STAGES < kb1) {
                if (tid == 0)
                    issue_w_pair(done - 1 + STAGES);
                issue_a(done - 1 + STAGES);
                if (done + STAGES < kb1)
                    issue_a(done + STAGES);
            }
        } else if (tid < kLoaders && done >= kb0 && done + STAGES < kb1) {
            if (tid == 0)
                issue_w(done + STAGES);
            issue_a(done + STAGES);
        }
    }
    if (QUANT == MX_QUANT_NONE) {
        wgmma_wait<0>();
        fence_acc(acc0);
        fence_acc(acc1);
    }

    /* The epilogue's operands, loaded before the accumulators go to shared
     * memory so that their round trips overlap that: the per-tensor scale,
     * and the bias. Its threads walk the outputs with a stride of kThreads,
     * a multiple of the tile's output columns, so each thread always stores
     * the same column j = tid % (128 or NCOL) and needs the bias of one or
     * two weight rows (0 past n_rows, on splits past the first, without a
     * bias); read from global memory in the store loop, each bias load
     * waited for the stores before it. (Held in registers across the main
     * loop instead, they cost block-scaled 48-token GEMM1 its third CTA per
     * SM: 167 -> 178 registers; in shared memory, 512 more bytes cost the
     * 16-token tiles theirs.) */
    const float scale = QUANT == MX_QUANT_FP8_TENSOR ? sc.a_scale[0] * sc.w_scale[expert] : 1.0f;
    static_assert(Shape::kThreads % 128 == 0 && Shape::kThreads % NCOL == 0, "a fixed output column per thread");
    auto row_bias = [&](int r) { /* tile weight row r: box 0 rows, then box 1 rows */
        const int row = r < 64 ? row0 + r : row1 + r - 64;
        return g.bias && split == 0 && row < g.n_rows
                   ? mx_to_float(static_cast<const T *>(g.bias)[static_cast<int64_t>(expert) * g.n_rows + row])
                   : 0.0f;
    };
    const int bias_j = tid % (KIND == MX_GEMM_DOWN || kLinear ? 128 : NCOL);
    /* bias_lo: row j (DOWN, LINEAR, UP), the gate row (GATE_UP) or 2j (interleaved); bias_hi: the up row or 2j + 1 */
    const float bias_lo = row_bias(KIND == MX_GEMM_GATE_UP_INTERLEAVED ? 2 * bias_j : bias_j);
    const float bias_hi = KIND == MX_GEMM_GATE_UP               ? row_bias(64 + bias_j)
                          : KIND == MX_GEMM_GATE_UP_INTERLEAVED ? row_bias(2 * bias_j + 1)
                                                                : 0.0f;

    /* epilogue: every issued load was waited for, so the ring is free */
    {
        const int r = warp * 16 + lane / 4;
#pragma unroll
        for (int e = 0; e < NACC; ++e) {
            const int rr = r + 8 * ((e / 2) % 2), t = 8 * (e / 4) + 2 * q + (e % 2);
            dtile[rr * LDD + t] = acc0[e];
            dtile[(64 + rr) * LDD + t] = acc1[e];
        }
    }
    __syncthreads();
    const float alpha = g.swiglu_alpha, limit = g.swiglu_limit;
    const int64_t oc = g.out_cols;
    if (KIND == MX_GEMM_DOWN) {
        float *y = static_cast<float *>(g.out) + split * g.out_split_stride;
        for (int idx = tid; idx < BT * 128; idx += Shape::kThreads) {
            const int t = idx / 128, j = idx % 128;
            const int64_t col = c + j;
            const int32_t pair = tile_pair[t];
            if (pair < 0 || col >= oc)
                continue;
            y[static_cast<int64_t>(pair) * g.ldo + col] = (dtile[j * LDD + t] * scale + bias_lo) * tile_weight[t];
        }
    } else if (kLinear) {
        T *out = static_cast<T *>(g.out);
        for (int idx = tid; idx < BT * 128; idx += Shape::kThreads) {
            const int t = idx / 128, j = idx % 128;
            const int64_t col = c + j;
            if (tile_pair[t] < 0 || col >= oc)
                continue;
            out[(a_row + t) * g.ldo + col] = mx_from_float<T>(dtile[j * LDD + t] * scale + bias_lo);
        }
    } else {
        /* act column j of token slot t, with scale, bias and activation */
        auto act_value = [&](int t, int j) {
            if (KIND == MX_GEMM_GATE_UP)
                return mx_act_gated(g.activation, dtile[j * LDD + t] * scale + bias_lo,
                                    dtile[(64 + j) * LDD + t] * scale + bias_hi, alpha, limit);
            if (KIND == MX_GEMM_GATE_UP_INTERLEAVED)
                return mx_act_gated(MX_ACT_SWIGLUOAI, dtile[2 * j * LDD + t] * scale + bias_lo,
                                    dtile[(2 * j + 1) * LDD + t] * scale + bias_hi, alpha, limit);
            return mx_act_plain(g.activation, dtile[j * LDD + t] * scale + bias_lo);
        };
        /* where the quantizing pass keeps that value: the first of the
         * dtile slots it was made from (the thread's own) */
        auto kept_at = [&](int t, int j) {
            return dtile + (KIND == MX_GEMM_GATE_UP_INTERLEAVED ? 2 * j : j) * LDD + t;
        };
        constexpr bool kAmax = QUANT == MX_QUANT_FP8_TENSOR;
        float amax = 0.0f;
        T *act = static_cast<T *>(g.out);
        /* a warp's 32 columns of one token row per step (NCOL / 32 warps a row) */
        constexpr int kRowWarps = NCOL / 32;
        const int rank = kPairQuant ? nt & 1 : 0;
        for (int idx = tid; idx < BT * NCOL; idx += Shape::kThreads) {
            const int t = idx / NCOL, j = idx % NCOL;
            const int64_t col = static_cast<int64_t>(nt) * NCOL + j;
            if (kQuantAct) {
                /* the act value as the act dtype rounds it, kept for the second
                 * pass; the row's maximum over the warp's columns (a padding
                 * row, warp-uniform, has none), here and in the partner: max
                 * of the amax bits (>= +0 or the positive canonical NaN), the
                 * NaN-propagating float maximum */
                if (tile_pair[t] < 0)
                    continue;
                const bool in = col < oc;
                const float v = in ? mx_to_float(mx_from_float<T>(act_value(t, j))) : 0.0f;
                if (in)
                    *kept_at(t, j) = v;
                const uint32_t row_max = __reduce_max_sync(0xffffffffu, __float_as_uint(mx_amax_step(0.0f, v)));
                uint32_t *at = &tile_amax[(rank * kRowWarps + warp % kRowWarps) * BT + t];
                if (lane == 0) {
                    *at = row_max;
                    if (partner)
                        st_shared_cluster(mx_smem_addr(at), rank ^ 1, row_max);
                }
                continue;
            }
            const bool live = tile_pair[t] >= 0 && col < oc;
            if (!live)
                continue;
            const T stored = mx_from_float<T>(act_value(t, j));
            act[(a_row + t) * g.ldo + col] = stored;
            if (kAmax)
                amax = mx_amax_step(amax, mx_to_float(stored));
        }
        if (kAmax) {
            amax = mx_warp_max(amax);
            if (lane == 0 && !(amax <= 0.0f)) /* > 0 or NaN */
                mx_atomic_amax(sc.amax, amax);
        }
        if (kQuantAct) {
            /* every row maximum is in (the partner's stores too): each live
             * row's group scale, then the fp8 values, as the group quantizer
             * makes them */
            if (kPairQuant)
                cluster_sync();
            else
                __syncthreads();
            if (tid < BT && tile_pair[tid] >= 0) {
                uint32_t group_max = 0;
#pragma unroll
                for (int w = 0; w < 2 * kRowWarps; ++w)
                    if (w < kRowWarps || partner)
                        group_max = max(group_max, tile_amax[((w < kRowWarps ? rank : rank ^ 1) * kRowWarps +
                                                              w % kRowWarps) * BT + tid]);
                const float s = mx_fp8_group_scale(__uint_as_float(group_max));
                tile_scale[tid] = s;
                tile_recip[tid] = mx_fp8_div_recip(s);
                if (rank == 0)
                    sc.act_q_scale[(a_row + tid) * sc.act_q_scale_ld + static_cast<int64_t>(nt) * NCOL / 128] = s;
            }
            __syncthreads();
            for (int idx = tid; idx < BT * NCOL; idx += Shape::kThreads) {
                const int t = idx / NCOL, j = idx % NCOL;
                const int64_t col = static_cast<int64_t>(nt) * NCOL + j;
                if (tile_pair[t] >= 0 && col < oc)
                    sc.act_q[(a_row + t) * sc.act_q_ld + col] =
                        mx_fp8_encode_divided(*kept_at(t, j), tile_scale[t], tile_recip[t]);
            }
        }
    }
#else
    __trap(); /* launched only where mx_cuda_sm90_gemm_available() saw sm_90a code */
#endif
}

/* The decode kernel's shared-memory opt-in (once per device), and where
 * resident_ctas is given the CTAs of it that fit the GPU at once. */
template <typename TA, typename T, typename Shape, int KIND, int QUANT>
mx_status sm90_decode_opt_in(const char *name, int *resident_ctas)
{
    auto kernel = grouped_gemm_sm90_decode_kernel<TA, T, Shape, KIND, QUANT>;
    static std::atomic<unsigned long long> configured{0};
    mx_status st = mx_opt_in_smem(kernel, Shape::kSmemBytes, configured, name);
    if (st.code != MX_OK || !resident_ctas)
        return st;
    static std::atomic<int> resident[64];
    return mx_resident_ctas(kernel, Shape::kThreads, Shape::kSmemBytes, resident, name, resident_ctas);
}

/* One GEMM of the decode kernel over A = g.a [rows, K] (stride g.lda
 * elements of TA); the caller checked the TMA preconditions. */
template <typename TA, typename T, typename Shape, int KIND, int QUANT>
mx_status launch_sm90_decode(const mx_gemm_args &g, const mx_sm90_scales &sc, int64_t local_experts,
                             int64_t m_tiles, cudaStream_t stream)
{
    auto kernel = grouped_gemm_sm90_decode_kernel<TA, T, Shape, KIND, QUANT>;
    constexpr int BK = 128 / static_cast<int>(sizeof(TA));
    constexpr bool kPaired = KIND == MX_GEMM_GATE_UP || KIND == MX_GEMM_GATE_UP_INTERLEAVED;
    const int64_t n_tiles = kPaired ? mx_ceil_div(g.out_cols, 64) : mx_ceil_div(g.n_rows, 128);
    if (KIND == MX_GEMM_LINEAR && (g.sorted_ids || g.rows < 1 || m_tiles != mx_ceil_div(g.rows, Shape::kBlockT)))
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90_decode: a dense launch needs rows and no tile table");
    const int64_t k_blocks = mx_ceil_div(g.k, BK);
    const int64_t kb_per_split = g.k_splits == 1 ? k_blocks : g.k_split_len / BK;
    static const mx_kernel_name kernel_name("grouped_gemm_sm90_decode_kernel<%s, %s, %d, %s%s>",
                                            sm90_dtype<TA>::name(), sm90_dtype<T>::name(), Shape::kBlockT,
                                            mx_gemm_kind_name(KIND),
                                            sm90_quant_names[QUANT]);
    const char *name = kernel_name.text;
    if (g.k_splits < 1 || kb_per_split < 1 || (g.k_splits > 1 && g.k_split_len % BK) ||
        mx_ceil_div(k_blocks, kb_per_split) != g.k_splits || (g.k_splits > 1 && KIND != MX_GEMM_DOWN))
        return mx_status_fail(MX_ERR_VALUE, "%s: %d k splits of %lld do not tile k = %lld", name, g.k_splits,
                              (long long)g.k_split_len, (long long)g.k);
    const int64_t grid = m_tiles * mx_ceil_div(n_tiles, kDecodeGroupN) * kDecodeGroupN * g.k_splits;
    if (grid > 0x7fffffff || m_tiles * Shape::kBlockT > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "%s: %lld CTAs exceed the grid", name, (long long)grid);
    if (grid == 0)
        return mx_status_ok();
    /* the kernel's int32 block-scale row offsets: GEMM1 by token (pairs /
     * top_k of them), else by slot of a tile */
    const int64_t scale_rows = decode_rows_from_x(KIND) ? (g.top_k > 0 ? g.pairs / g.top_k : 0) : Shape::kBlockT;
    if (QUANT == MX_QUANT_FP8_BLOCK && (scale_rows < 1 || scale_rows * sc.a_ld > 0x7fffffff))
        return mx_status_fail(MX_ERR_VALUE, "%s: %lld rows of block scales exceed int32 offsets (or the pair count is "
                              "unknown)", name, (long long)scale_rows);

    mx_status st = sm90_decode_opt_in<TA, T, Shape, KIND, QUANT>(name, nullptr);
    if (st.code != MX_OK)
        return st;
    /* A rows by TMA: LINEAR the rows of a (TMA zero-fills the last tile); DOWN
     * the workspace's worst case. GEMM1 kinds read x by cp.async: map_a is
     * then the weight map again, never read. */
    CUtensorMap map_a, map_w;
    /* L2 promotion 128B with paired loads, and for 16-bit GEMM2 on 16-token
     * tiles over rows shorter than kSm90DecodeDownShortRowBytes; else 256B
     * (gemm_configs.cuh has the measurements; packed maps always take 128B,
     * sm90_weight_map) */
    const bool short_down = KIND == MX_GEMM_DOWN && QUANT == MX_QUANT_NONE && Shape::kBlockT == 16 &&
                            g.k * static_cast<int64_t>(sizeof(TA)) < kSm90DecodeDownShortRowBytes;
    const int promotion =
        Shape::kPairedLoads || short_down ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
    if (!sm90_weight_map<TA>(g.w, g.k, g.n_rows, local_experts, 64, g.w_packed, &map_w, &st, promotion))
        return st;
    if (decode_rows_from_x(KIND))
        map_a = map_w;
    else if (!sm90_rows_map<TA>(g.a, g.lda, KIND == MX_GEMM_LINEAR ? g.rows : m_tiles * Shape::kBlockT,
                                Shape::kBlockT, g.k, &map_a, &st))
        return st;
    /* act quantized in the epilogue (by the caller's choice of the same rule):
     * tiles of 64 act columns in clusters of two (the grid's n tiles come in
     * even chunks) */
    constexpr bool kQuantAct = decode_quantizes_act(KIND, QUANT, Shape::kBlockT);
    constexpr unsigned kCluster = decode_quantizes_in_pairs(KIND, QUANT, Shape::kBlockT) ? 2u : 1u;
    if (kQuantAct != (sc.act_q != nullptr && sc.act_q_scale != nullptr))
        return mx_status_fail(MX_ERR_VALUE, "%s: act_q and act_q_scale %s", name,
                              kQuantAct ? "missing (this tile quantizes act)" : "given to a tile that does not quantize act");
    return mx_check_call(mx_launch_dependent_clusters(kCluster, kernel, dim3(static_cast<unsigned>(grid)),
                                                      dim3(Shape::kThreads), Shape::kSmemBytes, stream, map_a, map_w,
                                                      g, sc, static_cast<int>(m_tiles), static_cast<int>(n_tiles),
                                                      static_cast<int>(kb_per_split)),
                         name);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_GROUPED_GEMM_SM90_DECODE_CUH */
