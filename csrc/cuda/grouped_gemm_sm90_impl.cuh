/* Grouped GEMM for Hopper (sm_90a): TMA -> 128B-swizzled shared memory ->
 * wgmma, warp-specialized, persistent. Included by grouped_gemm_bf16_sm90.cu
 * and grouped_gemm_fp16_sm90.cu (16-bit operands, one dtype each) and
 * grouped_gemm_fp8_sm90.cu (float8_e4m3 operands, FP8 scales), which
 * instantiate it.
 *
 * Operands (row-major, K contiguous; TA = bf16 / fp16, or e4m3 with a 16-bit
 * act dtype T for outputs and biases):
 *   A  [rows, K] by sorted row s. GEMM2: act [rows_max, ld_act] as written by
 *      GEMM1, by TMA. GEMM1: the token gather x[pair / top_k] cannot be a
 *      tensor map; the producer warpgroup copies the rows from x (16-bit)
 *      or x_q (FP8 at few rows per expert) with cp.async into the TMA box's
 *      swizzled layout; FP8 from more rows per expert: the x quantizer has
 *      written each token's row to its pairs' sorted rows (experts_fp8.cu),
 *      loaded by TMA (the kernel's A_BY_TOKEN says which; the kernel
 *      comment says why).
 *   W  [E_local, n_rows, K]: w13 or w2, one 3-D tensor map, so the rows of
 *      one expert past n_rows read as zero.
 *   Both maps: box = 128 bytes of K (the swizzle span: 64 16-bit or 128 fp8
 *   elements) x rows, CU_TENSOR_MAP_SWIZZLE_128B; columns past K are
 *   zero-filled by the TMA. Every byte offset below is the same for both
 *   element sizes; a wgmma k step is 32 bytes (k16 for 16-bit, k32 for fp8).
 *   FP8 scales: per tensor, sa * sw[expert] multiplies the accumulator in
 *   the epilogue (GEMM1 then also takes the atomic amax of the stored act
 *   for GEMM2's activation scale); 128x128 blocks, see the kernel comment.
 *   FP8 accumulation: wgmma's own FP8 accumulation keeps too few bits over
 *   a long K (a decode-kernel test without promotion erred 1.2x the 2e-2
 *   bound), so the products are accumulated on their own and added to the
 *   float32 accumulator: with block scales every k block (128 fp8 columns,
 *   one scale block), per tensor every two; on 256-wide tiles per weight
 *   box (m64n128 wgmmas, so that the extra set is BN/4 registers).
 * Tiling: CTA tile kBlockM (128) x kBlockN (256, or 128 for some block-scale
 * GEMMs) x 128 bytes of K; the kBlockN weight
 * rows arrive as two boxes of kBlockN/2 rows. For MX_GEMM_GATE_UP the boxes
 * are kBlockN/2 gate rows and the kBlockN/2 up rows of the same output
 * columns, so act(gate) * up is formed in registers. Interleaved (swigluoai)
 * tiles take kBlockN consecutive rows: accumulator columns 2i / 2i+1 are
 * gate / up of output column i.
 * Threads: 3 warpgroups. Warpgroups 0 and 1 (math, 232 registers each via
 * setmaxnreg) own rows [0, 64) and [64, 128) of the tile and issue
 * wgmma.m64n{kBlockN} with both operands read from shared memory through
 * descriptors; warpgroup 2 (40 registers) has one thread issuing the TMA
 * loads (and, for 16-bit GEMM1, all 128 copying A rows: a full barrier
 * then also waits for each one's cp.async arrival). Pipeline: kStages
 * slots of (A 16 KB, W kBlockN * 128 bytes), each with a full barrier (1
 * arrival + the transaction bytes) and an empty
 * barrier (one arrival per math warp of the cluster, sent once the wgmmas
 * reading the slot have retired: the math warpgroups keep one k-block of
 * wgmma in flight).
 * Ping-pong (Shape::kPingPong, at a few tens of rows per expert with short
 * K or many experts, gemm_configs.cuh mx_sm90_ping_pong): units of 64 rows
 * (a 64-row tile table) x kBlockN, each taken whole by one math
 * warpgroup, the two in turn (the CTA's units 0, 2, 4, ... and 1, 3, ...);
 * the producer fills the ring in unit order, so one warpgroup's epilogue
 * runs while the other's wgmmas drain the ring, which the cooperative tile
 * leaves idle behind every epilogue. A turn barrier per warpgroup orders
 * their mainloops (see turn_bar); an empty barrier then counts the 4 warps
 * of the one warpgroup that read the slot.
 * Clusters (kClusterM = 2): the two CTAs take m tiles 2u and 2u + 1 of the
 * same n tile. When both tiles belong to one expert, CTA r loads weight box
 * r once and multicasts it into both CTAs' slot (A stays per CTA), so each
 * CTA pulls 32 instead of 48 KB per k block from L2; otherwise each loads
 * both boxes itself. Either way every slot receives the same bytes, and a
 * slot is refilled only when the math warps of both CTAs released it.
 * Scheduling: persistent, one CTA per SM (grid = the co-resident clusters)
 * over the units of (m units in use) x n_tiles, read off the tile table
 * moe_align wrote (*num_tiles, tile_expert) on the device, so nothing is
 * read back to the host. Unit order: groups of kGroupM m units, m fastest
 * inside a group, so that the CTAs running together share weight slices
 * and A rows in L2. Single CTAs given g.units_taken (gemm_configs.cuh
 * mx_sm90_deals_units) take their units from that counter as they come
 * free; otherwise, and CTA pairs always, cluster c walks units c,
 * c + clusters, ... (sm90_units.cuh says why and how). GEMM2 may
 * cut K into slices (g.k_splits > 1: at most that many; the count picked on
 * the device from the tiles in use, gemm_configs.cuh mx_sm90_down_split,
 * and written to *g.split_count for moe_sum): the units then repeat per
 * slice, slice slowest, each storing its float32 partial into y's slice
 * (bias on slice 0). The producer runs ahead across tile boundaries, so the
 * loads of the next tile overlap the epilogue of this one.
 * Epilogue: grouped_gemm_sm90_epilogue.cuh; the rows' pair indices and
 * routing weights are loaded when the tile starts (GEMM2: one unit ahead,
 * sm90_unit).
 *
 * The launcher guarantees: tile tables from moe_align with block_m =
 * Shape::kBlockM (128; ping-pong 64);
 * K, n_rows and the row strides multiples of 8 elements and A / W bases
 * 16-byte aligned (TMA); k slices only for sm90_takes_slices (y by pair),
 * at most kSm90DownMaxSplits, with split_count. */
#ifndef MOE_EXT_CUDA_GROUPED_GEMM_SM90_IMPL_CUH
#define MOE_EXT_CUDA_GROUPED_GEMM_SM90_IMPL_CUH

#include "gemm_configs.cuh"
#include "grouped_gemm_sm90.cuh"
#include "grouped_gemm_sm90_epilogue.cuh"
#include "sm90_common.cuh"
#include "sm90_units.cuh"

namespace {

/* ---- tile order and work units ---------------------------------------------------- */

/* The GEMMs that may run in k slices: GEMM2 per tensor and 16-bit on the
 * cooperative tiles (the block-scale GEMM2 does not: gemm_configs.cuh
 * mx_sm90_down_max_splits; ping-pong units do not: their warpgroups find
 * their ring slots from whole units of k blocks). */
template <typename Shape, int KIND, int QUANT> constexpr bool sm90_takes_slices()
{
    return KIND == MX_GEMM_DOWN && QUANT != MX_QUANT_FP8_BLOCK && !Shape::kPingPong;
}

/* Persistent work-unit index -> (m unit, n tile): groups of G m units (the
 * last group shorter), m fastest inside a group. An m unit is kClusterM
 * consecutive m tiles, one per CTA of the cluster. */
template <int G> __device__ __forceinline__ void sm90_unit_coords(int unit, int num_mu, int n_tiles, int &mu, int &nt)
{
    const int group = unit / (G * n_tiles);
    const int first = group * G;
    const int rows = num_mu - first < G ? num_mu - first : G;
    const int within = unit - group * G * n_tiles;
    mu = first + within % rows;
    nt = within / rows;
}

/* One work unit as a math thread sees it. GEMM2 without block scales loads
 * it in two steps, one unit ahead: sm90_unit_start (the sorted ids and the
 * tile's expert) before the mainloop of the unit before it,
 * sm90_unit_finish (what depends on those: routing weights, the expert's
 * per-tensor FP8 scale) before that unit's epilogue, so no math warp waits
 * on them. Loaded at the unit's own start (sm90_unit_now), that dependent
 * pair of L2 round trips stalled every math warp once per tile: 14% of the
 * warp samples of qwen3moe's FP8 GEMM2 at M = 4096, 5% of the bf16 one (ncu
 * source sampling). Loading ahead made that GEMM2 12% faster at M = 16384
 * (qwen3moe fp8_tensor, 789 -> 694 us) but GEMM1s slower (gpt-oss bf16 at
 * M = 4096 +13%, qwen3moe fp8_tensor +3%), as was the block-scale GEMM2 in
 * the two-step form even loading at its own start (DeepSeek-V3 +12%); those
 * keep sm90_unit_now (H100, 2026-11-25,
 * logs/2026-11-25-nvidia-h100-ab-unit-ahead.txt). */
struct sm90_unit {
    int nt, mt;       /* n tile, m tile */
    int split;        /* GEMM2's k slice */
    bool real;        /* mt < num_tiles (false: the phantom tile of an odd count) */
    int expert;       /* tile_expert[mt] (0 for a phantom tile) */
    float scale;      /* per-tensor FP8: a_scale * w_scale[expert]; else 1 */
    sm90_rows rows;
};

/* unit >= total (no unit): a phantom that loads nothing; G: m units per group */
template <typename Shape, int G>
__device__ __forceinline__ sm90_unit sm90_unit_start(int unit, int total, int num_mu, int n_tiles, int cm,
                                                     uint32_t rank, int num_m, int r_lo, const mx_gemm_args &g)
{
    sm90_unit u;
    int mu = num_mu;
    u.nt = 0;
    u.split = 0;
    if (unit < total) {
        const int per_split = num_mu * n_tiles;
        u.split = unit / per_split;
        sm90_unit_coords<G>(unit - u.split * per_split, num_mu, n_tiles, mu, u.nt);
    }
    u.mt = mu * cm + static_cast<int>(rank);
    u.real = unit < total && u.mt < num_m;
    u.expert = u.real ? g.tile_expert[u.mt] : 0;
    u.scale = 1.0f;
    u.rows.s_lo = static_cast<int64_t>(u.mt) * Shape::kBlockM + r_lo;
    u.rows.pair_lo = u.real ? g.sorted_ids[u.rows.s_lo] : -1;
    u.rows.pair_hi = u.real ? g.sorted_ids[u.rows.s_lo + 8] : -1;
    u.rows.w_lo = u.rows.w_hi = 1.0f;
    return u;
}

template <int KIND, int QUANT>
__device__ __forceinline__ void sm90_unit_finish(sm90_unit &u, const mx_gemm_args &g, const mx_sm90_scales &sc)
{
    if (!u.real)
        return;
    if (QUANT == MX_QUANT_FP8_TENSOR)
        u.scale = sc.a_scale[0] * sc.w_scale[u.expert];
    if (KIND == MX_GEMM_DOWN && g.scale_by_weight) {
        if (u.rows.pair_lo >= 0)
            u.rows.w_lo = g.topk_weights[u.rows.pair_lo];
        if (u.rows.pair_hi >= 0)
            u.rows.w_hi = g.topk_weights[u.rows.pair_hi];
    }
}

/* The unit loaded at its own start: the kinds that do not load ahead. The
 * same loads as sm90_unit_start + sm90_unit_finish, kept as the form those
 * kinds were measured with: composed from the two steps, their SASS differs
 * (reordered and dropped moves; cuobjdump, 2026-11-25), not yet timed. */
template <typename Shape, int KIND, int QUANT, int G>
__device__ __forceinline__ sm90_unit sm90_unit_now(int unit, int num_mu, int n_tiles, int cm, uint32_t rank,
                                                   int num_m, int r_lo, const mx_gemm_args &g,
                                                   const mx_sm90_scales &sc)
{
    sm90_unit u;
    int mu;
    const int per_split = num_mu * n_tiles;
    u.split = sm90_takes_slices<Shape, KIND, QUANT>() ? unit / per_split : 0;
    sm90_unit_coords<G>(unit - u.split * per_split, num_mu, n_tiles, mu, u.nt);
    u.mt = mu * cm + static_cast<int>(rank);
    u.real = u.mt < num_m;
    u.expert = 0;
    u.scale = 1.0f;
    if (u.real) {
        u.rows.s_lo = static_cast<int64_t>(u.mt) * Shape::kBlockM + r_lo;
        u.rows.pair_lo = g.sorted_ids[u.rows.s_lo];
        u.rows.pair_hi = g.sorted_ids[u.rows.s_lo + 8];
        u.rows.w_lo = u.rows.w_hi = 1.0f;
        if (KIND == MX_GEMM_DOWN && g.scale_by_weight) {
            if (u.rows.pair_lo >= 0)
                u.rows.w_lo = g.topk_weights[u.rows.pair_lo];
            if (u.rows.pair_hi >= 0)
                u.rows.w_hi = g.topk_weights[u.rows.pair_hi];
        }
        u.expert = g.tile_expert[u.mt];
        if (QUANT == MX_QUANT_FP8_TENSOR)
            u.scale = sc.a_scale[0] * sc.w_scale[u.expert];
    }
    return u;
}

/* ---- kernels ----------------------------------------------------------------------- */

/* TA: operand type (bfloat16 / float16, or float8_e4m3 with QUANT an FP8
 * mode); T: act / bias type. DEALT: the units come from g.units_taken
 * (single CTAs), else round robin (sm90_units.cuh); round robin keeps the
 * code it was measured with, so that a forward that does not deal runs as
 * before. A_BY_TOKEN (GEMM1 kinds only): the producer
 * warpgroup copies the A rows by token, x[pair / top_k] (16-bit: always) or
 * x_q's (FP8), with cp.async; else thread 0 TMA-loads them by sorted row
 * (FP8: rows the x quantizer wrote in sorted order; GEMM2: act). Measured
 * when FP8 still gathered its quantized rows with a kernel of their own,
 * the copies against that gather, H100 at 2026-11-25
 * (logs/2026-11-25-nvidia-h100-ab-rows-from-x.txt, two rounds): qwen3moe
 * bf16 forwards -8..-9% at M = 1024..16384, gpt-oss bf16 -11% at M = 4096
 * and -1.5% at 16384, Mixtral bf16 +0.8%; FP8 GEMM1 slowed 13-14%
 * (Mixtral fp8_tensor, DeepSeek-V3 fp8_block at M = 16384: forwards
 * +3..5%), so FP8 reads sorted rows from 128 rows per expert
 * (gemm_configs_fp8.cuh mx_fp8_sm90_gemm1_a_by_token has the rule and its
 * measurements). With 128x128 block scales (kBlockScales) each
 * k block (128 fp8 columns, one scale block) is accumulated on its own and
 * promoted in registers: acc += part * sa[row, kb] * sw[nb, kb],
 * the scales of the thread's two rows and of the tile's two weight boxes
 * (each box lies in one 128-row scale block: the launcher checks). That
 * promotion needs the k block's wgmmas retired. On 128-wide tiles
 * (kTwoSets) the products alternate between two sets of the whole tile
 * (`part`, `part_next`), so k block kb + 1's wgmmas are in flight while k
 * block kb is promoted (one set, waiting for each k block's wgmmas before
 * the next were issued, was 5-11% slower per GEMM: H100, 2026-11-25,
 * logs/2026-11-25-nvidia-h100-ab-block-promotion.txt). On 256-wide tiles two
 * such sets do not fit the registers: each weight box's k block goes into
 * one set of BN/4 (m64n128 wgmmas) and is promoted once retired, as the
 * per-tensor tiles promote (the other math warpgroup's wgmmas keep the
 * tensor cores busy meanwhile; on ping-pong units its epilogue runs). */
template <typename TA, typename T, typename Shape, int KIND, int QUANT, bool A_BY_TOKEN, bool DEALT>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap tma_a, /* A [rows, K], box 128 bytes x 128 */
                             const __grid_constant__ CUtensorMap tma_w, /* W [E, n_rows, K], box 128 bytes x kBlockN/2 x 1 */
                             const __grid_constant__ CUtensorMap tma_out, /* interleaved GEMM1: act [rows, out_cols],
                                                                            box 128 bytes x 64; GEMM2 by sorted row:
                                                                            y [rows, out_cols], box 128 bytes x 16 */
                             const mx_gemm_args g,                      /* sizes, tile table, epilogue operands */
                             const mx_sm90_scales sc,                      /* FP8 scales */
                             int n_tiles)                               /* n tiles per m tile */
{
#if MX_SM90_DEVICE_PASS
    constexpr int BM = Shape::kBlockM, BN = Shape::kBlockN, STAGES = Shape::kStages;
    constexpr int BK = Shape::kBlockKBytes / static_cast<int>(sizeof(TA)); /* k elements per stage */
    constexpr int KSTEPS = Shape::kBlockKBytes / 32;                       /* wgmmas of 32 bytes of k */
    constexpr int CM = Shape::kClusterM;
    constexpr uint32_t A_BYTES = Shape::kABytes, STAGE_BYTES = Shape::kStageBytes;
    constexpr uint32_t HALF_W_BYTES = (BN / 2) * Shape::kBlockKBytes; /* one weight box */
    constexpr bool kGated = KIND == MX_GEMM_GATE_UP;     /* box 0 = gate rows, box 1 = up rows */
    constexpr bool kBlockScales = QUANT == MX_QUANT_FP8_BLOCK;
    constexpr bool kTwoSets = kBlockScales && BN <= 128; /* two product sets of the whole tile fit */
    constexpr bool kPingPong = Shape::kPingPong;
    static_assert(!kPingPong || (!kTwoSets && KIND != MX_GEMM_GATE_UP_INTERLEAVED),
                  "ping-pong units: 256-wide, not the interleaved GEMM1");
    static_assert(!A_BY_TOKEN || KIND != MX_GEMM_DOWN, "GEMM2 reads act by sorted row");
    static_assert(!DEALT || Shape::kClusterM == 1, "pairs walk their units in lockstep, round robin");
    static_assert(A_BY_TOKEN || KIND == MX_GEMM_DOWN || sizeof(TA) == 1, "16-bit GEMM1 reads x by token");
    constexpr int G = DEALT ? kSm90DealtGroupM : Shape::kGroupM; /* m units per group of the unit order */

    extern __shared__ __align__(1024) unsigned char sm90_smem[];
    /* stage slots need 1024-byte alignment (the swizzle atom); the launch's bytes hold the slack */
    const uint32_t base = (mx_smem_addr(sm90_smem) + 1023u) & ~1023u;
    const uint32_t out_boxes = base + STAGES * STAGE_BYTES;   /* the epilogue's staging (sm90_out_bytes) */
    /* full[STAGES], empty[STAGES], ping-pong: turn[2] */
    const uint32_t bars = out_boxes + sm90_launch_out_bytes<Shape, KIND, QUANT>(g);
    auto full_bar = [&](uint32_t s) { return bars + 8u * s; };
    auto empty_bar = [&](uint32_t s) { return bars + 8u * (STAGES + s); };
    /* ping-pong: warpgroup w's mainloop of a unit has passed its last full
     * barrier (one arrival per warp); the other warpgroup's next unit waits
     * for it. Its first slot may be 2 or more ring turns ahead of what the
     * producer has filled, where a parity wait on the slot alone would pass
     * on an older phase; after that turn the producer is within one. */
    auto turn_bar = [&](int w) { return bars + 8u * (2 * STAGES + w); };
    /* the CTA's units: dealt from the counter, else round robin; made where
     * used, from the barriers' base and the kernel argument, so that no
     * register holds them across the producer's k loop */
    auto units = [&]() {
        return sm90_units<CM>{bars + 8u * (2 * STAGES) + (kPingPong ? 16u : 0u), DEALT ? g.units_taken : nullptr};
    };

    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < STAGES; ++s) {
            mbar_init(full_bar(s), A_BY_TOKEN ? 1 + 128 : 1); /* the TMA thread, and each producer thread's copies */
            /* every math warp of the cluster; ping-pong: of the one warpgroup that reads the slot */
            mbar_init(empty_bar(s), (kPingPong ? 4 : Shape::kMathWarps) * CM);
        }
        if (kPingPong) {
            mbar_init(turn_bar(0), 4);
            mbar_init(turn_bar(1), 4);
        }
        for (int j = 0; j < (DEALT ? kSm90UnitRing : 0); ++j) {
            mbar_init(units().full_bar(j), 1);
            /* the math warps that run the unit (ping-pong: one warpgroup, the
             * slot's parity), and the producer warps that copy A rows */
            mbar_init(units().empty_bar(j), (kPingPong ? 4 : Shape::kMathWarps) + (A_BY_TOKEN ? 4 : 0));
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        fence_proxy_async_smem();
    }
    if (CM > 1)
        cluster_sync(); /* the peer's barriers exist before anyone multicasts or arrives remotely */
    else
        __syncthreads();

    /* Work units: (m unit, n tile); the CTA of cluster rank r takes m tile
     * CM * mu + r. Both CTAs of a cluster walk the same units in lockstep
     * (they exchange weight halves every k block). */
    const uint32_t rank = CM > 1 ? cluster_cta_rank() : 0;
    const int clusters = gridDim.x / CM;
    const int num_m = *g.num_tiles;
    const int num_mu = (num_m + CM - 1) / CM;
    /* per-tensor FP8 promotes pairs of k blocks: an odd count gets one more,
     * past K, which the TMA zero-fills, so that no wgmma is conditional */
    constexpr bool kPromotePairs = QUANT == MX_QUANT_FP8_TENSOR;
    const int k_in_use = static_cast<int>((g.k + BK - 1) / BK);
    const int k_blocks = kPromotePairs ? (k_in_use + 1) & ~1 : k_in_use;
    /* GEMM2 in k slices of split.len k blocks (gemm_configs.cuh
     * mx_sm90_down_split, picked from the tiles in use), the slice slowest
     * in the unit order; the count goes to moe_sum through g.split_count */
    constexpr int kSplitAlign = kPromotePairs ? 2 : 1;
    mx_sm90_split split = {1, k_blocks};
    constexpr bool kSlices = sm90_takes_slices<Shape, KIND, QUANT>();
    if (kSlices && g.k_splits > 1) {
        split = g.split_exact ? mx_sm90_down_split_exact(k_blocks, g.k_splits, kSplitAlign)
                              : mx_sm90_down_split(num_mu * n_tiles, clusters, g.k_splits, k_blocks, kSplitAlign);
        if (blockIdx.x == 0 && threadIdx.x == 0)
            *g.split_count = split.count;
    }
    const int per_split = num_mu * n_tiles;
    const int total = per_split * split.count;
    /* a unit's slice and its k blocks (GEMM1 kinds: 0, the whole K) */
    auto slice_of = [&](int unit) { return kSlices ? unit / per_split : 0; };
    auto k_first = [&](int slice) { return kSlices ? slice * split.len : 0; };
    auto k_end = [&](int slice) {
        return kSlices && slice * split.len + split.len < k_blocks ? slice * split.len + split.len
                                                                                : k_blocks;
    };
    const int wg = threadIdx.x / 128;

    if (wg == Shape::kMathWarpgroups) {
        /* producer warpgroup: thread 0 issues the TMA loads; with A_BY_TOKEN
         * all 128 copy the A rows by token with cp.async, thread t the 16-byte
         * chunk t % 8 of rows t / 8 + 16 j (so a warp's copy covers 4 whole
         * 128-byte row segments) */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Shape::kProducerRegs));
        const int pt = threadIdx.x % 128;
        if (A_BY_TOKEN || pt == 0) {
            if (pt == 0) {
                if (!A_BY_TOKEN)
                    tma_prefetch_map(&tma_a);
                tma_prefetch_map(&tma_w);
            }
            const int64_t k_bytes = g.k * static_cast<int64_t>(sizeof(TA));
            uint32_t it = 0;
            for (int j = 0;; ++j) {
                /* the CTA's unit j: dealt as its loads start (by thread 0; with
                 * A_BY_TOKEN every producer warp reads it from the ring) */
                int unit = DEALT && pt == 0 ? units().deal(j, total) : units().walk(j);
                if (DEALT && A_BY_TOKEN)
                    unit = units().read(j);
                if (unit >= total)
                    break;
                int mu, nt;
                const int slice = slice_of(unit);
                sm90_unit_coords<G>(unit - slice * per_split, num_mu, n_tiles, mu, nt);
                const int mt = mu * CM + static_cast<int>(rank);
                /* a phantom m tile (odd count, last unit) still loads, so that the
                 * pair stays in lockstep; its epilogue is skipped */
                const int own = mt < num_m ? g.tile_expert[mt] : -1;
                int peer = -1;
                if (CM > 1) {
                    const int peer_mt = mu * CM + static_cast<int>(rank ^ 1u);
                    peer = peer_mt < num_m ? g.tile_expert[peer_mt] : -1;
                }
                const bool multicast = CM > 1 && own >= 0 && own == peer; /* same expert: share the weights */
                const int expert = own >= 0 ? own : peer;
                /* a phantom tile re-reads its partner's rows (TMA) or copies zeros */
                const int a_row = (own >= 0 ? mt : mt - 1) * BM;
                const int c = kGated ? nt * (BN / 2) : nt * BN;
                const int row0 = c, row1 = kGated ? static_cast<int>(g.out_cols) + c : c + BN / 2; /* box rows */
                /* A by token: the tokens of this thread's rows, -1 for padding and phantom rows */
                int32_t token[A_BY_TOKEN ? BM / 16 : 1];
#pragma unroll
                for (int j = 0; j < (A_BY_TOKEN ? BM / 16 : 1); ++j) {
                    const int64_t srow = static_cast<int64_t>(a_row) + pt / 8 + 16 * j;
                    const int32_t pair = A_BY_TOKEN && own >= 0 ? g.sorted_ids[srow] : -1;
                    token[j] = pair >= 0 ? pair / g.top_k : -1;
                }
                const int kb_end = k_end(slice);
                for (int kb = k_first(slice); kb < kb_end; ++kb, ++it) {
                    const uint32_t s = it % STAGES, phase = (it / STAGES) & 1u;
                    mbar_wait(empty_bar(s), phase ^ 1u); /* a fresh barrier passes parity 1 at once */
                    const uint32_t a_dst = base + s * STAGE_BYTES, w_dst = a_dst + A_BYTES;
                    if (pt == 0) {
                        mbar_arrive_expect_tx(full_bar(s), A_BY_TOKEN ? STAGE_BYTES - A_BYTES : STAGE_BYTES);
                        if (!A_BY_TOKEN)
                            tma_load_2d(a_dst, &tma_a, full_bar(s), kb * BK, a_row);
                        if (multicast) {
                            tma_load_w_multicast(w_dst + rank * HALF_W_BYTES, &tma_w, full_bar(s), kb, BK,
                                                 rank ? row1 : row0, expert, g.w_packed,
                                                 static_cast<uint16_t>((1u << CM) - 1u));
                        } else {
                            tma_load_w(w_dst, &tma_w, full_bar(s), kb, BK, row0, expert, g.w_packed);
                            tma_load_w(w_dst + HALF_W_BYTES, &tma_w, full_bar(s), kb, BK, row1, expert, g.w_packed);
                        }
                    }
                    if (A_BY_TOKEN) {
                        /* the TMA box's layout (sw128_offset); chunks past K and rows
                         * without a token zero-filled */
                        const int q = pt % 8;
                        const int64_t at = static_cast<int64_t>(kb) * 128 + 16 * q;
                        const bool in_k = at < k_bytes;
#pragma unroll
                        for (int j = 0; j < BM / 16; ++j) {
                            const int r = pt / 8 + 16 * j;
                            const bool live = in_k && token[j] >= 0;
                            const int64_t from =
                                live ? static_cast<int64_t>(token[j]) * g.lda * static_cast<int64_t>(sizeof(TA)) + at : 0;
                            mx_cp_async16(a_dst + sw128_offset(r, 16u * q), static_cast<const unsigned char *>(g.a) + from,
                                          live ? 16 : 0);
                        }
                        mbar_arrive_cp_async(full_bar(s));
                    }
                }
            }
        }
    } else {
        /* math warpgroups: rows [64 wg, 64 wg + 64) of every tile; ping-pong:
         * the 64 rows of every other unit, warpgroup wg from the CTA's unit wg */
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Shape::kMathRegs));
        const int lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x % 128) / 32;
        const int wg_row = kPingPong ? 0 : wg * 64; /* the warpgroup's first row of a unit */
        const int r_lo = wg_row + warp_in_wg * 16 + lane / 4;
        /* the CTA's units j, j + step, ... (ping-pong: warpgroup wg from j = wg) */
        const int step = kPingPong ? 2 : 1;
        int j = kPingPong ? wg : 0;
        /* the slot's wgmmas have retired: hand it back to the producer(s) */
        auto release = [&](uint32_t slot) {
            if (lane == 0) {
                mbar_arrive(empty_bar(slot));
                if (CM > 1)
                    mbar_arrive_cluster(empty_bar(slot), rank ^ 1u);
            }
        };
        float acc[BN / 2];
        /* two sets: the products of k blocks kb (one set) and kb + 1 (the other) */
        float part[kTwoSets ? BN / 2 : 1], part_next[kTwoSets ? BN / 2 : 1];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i)
            acc[i] = 0.0f;
        uint32_t it = 0;
        /* GEMM2 loads the next unit ahead (sm90_unit). Round robin: its first
         * step before this unit's mainloop, the second before its epilogue;
         * dealt: the first once the unit is known (cooperative: after this
         * unit's mainloop, when the producer has taken it; ping-pong: after
         * the epilogue), the second after this unit's epilogue */
        constexpr bool kAhead = KIND == MX_GEMM_DOWN && !kBlockScales;
        int unit = units().read(j);
        sm90_unit next =
            sm90_unit_start<Shape, G>(kAhead ? unit : total, total, num_mu, n_tiles, CM, rank, num_m, r_lo, g);
        sm90_unit_finish<KIND, QUANT>(next, g, sc);
        for (int following; unit < total; unit = following, j += step) {
            const sm90_unit cur = kAhead ? next
                                         : sm90_unit_now<Shape, KIND, QUANT, G>(unit, num_mu, n_tiles, CM, rank, num_m,
                                                                                 r_lo, g, sc);
            /* dealt: the CTA's next unit for these warps, and GEMM2's first
             * loads of it (a phantom past the end). Round robin keeps its own
             * lines below: through this lambda its GEMM2 scheduled differently
             * (nvdisasm, 2026-11-28) and it keeps the code it was measured with */
            auto read_dealt = [&]() {
                const int unit_after = units().read(j + step);
                if (kAhead)
                    next = sm90_unit_start<Shape, G>(unit_after, total, num_mu, n_tiles, CM, rank, num_m, r_lo, g);
                return unit_after;
            };
            if (!DEALT) {
                following = units().read(j + step);
                if (kAhead && following < total)
                    next = sm90_unit_start<Shape, G>(following, total, num_mu, n_tiles, CM, rank, num_m, r_lo, g);
            }
            /* ping-pong: the ring holds the CTA's units in turn, k_blocks
             * slots each (no k slices), so unit j's first slot is j times
             * that */
            if (kPingPong) {
                it = static_cast<uint32_t>(j) * static_cast<uint32_t>(k_blocks);
                if (j > 0) /* the other warpgroup's unit j - 1, its (j - 1) / 2-th */
                    mbar_wait(turn_bar(wg ^ 1), static_cast<uint32_t>((j - 1) / 2) & 1u);
            }
            const int nt = cur.nt, mt = cur.mt, expert = cur.expert;
            const int kb_lo = k_first(cur.split), kb_hi = k_end(cur.split);
            const sm90_rows &rows = cur.rows;
            /* block scales of the thread's rows and of the tile's weight boxes */
            const float *sa_lo = nullptr, *sa_hi = nullptr, *sw0 = nullptr, *sw1 = nullptr;
            if (kBlockScales && cur.real) {
                const bool down = KIND == MX_GEMM_DOWN;
                if (rows.pair_lo >= 0)
                    sa_lo = sc.a_scale + (down ? rows.s_lo : rows.pair_lo / g.top_k) * sc.a_ld;
                if (rows.pair_hi >= 0)
                    sa_hi = sc.a_scale + (down ? rows.s_lo + 8 : rows.pair_hi / g.top_k) * sc.a_ld;
                const int64_t c = kGated ? static_cast<int64_t>(nt) * (BN / 2) : static_cast<int64_t>(nt) * BN;
                sw0 = sm90_weight_block_scales(sc, expert, c);
                sw1 = sm90_weight_block_scales(sc, expert, kGated ? g.out_cols + c : c + BN / 2);
            }
            if constexpr (kTwoSets) {
                /* two sets of products: k block kb + 1's wgmmas are issued before
                 * k block kb is waited for and promoted */
                auto issue = [&](int kb, float(&p)[BN / 2]) {
                    const uint32_t n = it + (kb - kb_lo), s = n % STAGES;
                    mbar_wait(full_bar(s), (n / STAGES) & 1u);
                    if (A_BY_TOKEN)
                        fence_proxy_async_smem(); /* the cp.async rows, before wgmma reads them */
                    const uint32_t a_src = base + s * STAGE_BYTES + wg_row * 128, w_src = base + s * STAGE_BYTES + A_BYTES;
                    fence_acc(p);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < KSTEPS; ++kk)
                        sm90_wgmma<TA, BN>::run(p, sw128_desc(a_src + kk * 32), sw128_desc(w_src + kk * 32), kk != 0);
                    wgmma_commit();
                };
                /* pending: whether the next k block's wgmma group stays in flight
                 * (a constant at every call, so no branch remains) */
                auto promote = [&](int kb, float(&p)[BN / 2], bool pending) {
                    const float a_lo = sa_lo ? sa_lo[kb] : 0.0f, a_hi = sa_hi ? sa_hi[kb] : 0.0f;
                    const float w0 = sw0 ? sw0[kb] : 0.0f, w1 = sw1 ? sw1[kb] : 0.0f;
                    if (pending)
                        wgmma_wait<1>();
                    else
                        wgmma_wait<0>();
                    fence_acc(p);
                    release((it + (kb - kb_lo)) % STAGES);
                    const float lo0 = a_lo * w0, lo1 = a_lo * w1, hi0 = a_hi * w0, hi1 = a_hi * w1;
#pragma unroll
                    for (int i = 0; i < BN / 8; ++i) {
                        const bool box1 = i >= BN / 16;
                        acc[4 * i] = fmaf(p[4 * i], box1 ? lo1 : lo0, acc[4 * i]);
                        acc[4 * i + 1] = fmaf(p[4 * i + 1], box1 ? lo1 : lo0, acc[4 * i + 1]);
                        acc[4 * i + 2] = fmaf(p[4 * i + 2], box1 ? hi1 : hi0, acc[4 * i + 2]);
                        acc[4 * i + 3] = fmaf(p[4 * i + 3], box1 ? hi1 : hi0, acc[4 * i + 3]);
                    }
                };
                issue(kb_lo, part);
                int kb = kb_lo;
                for (; kb + 2 < kb_hi; kb += 2) {
                    issue(kb + 1, part_next);
                    promote(kb, part, true);
                    issue(kb + 2, part);
                    promote(kb + 1, part_next, true);
                }
                if (kb + 1 < kb_hi) {
                    issue(kb + 1, part_next);
                    promote(kb, part, true);
                    promote(kb + 1, part_next, false);
                } else {
                    promote(kb, part, false);
                }
                it += kb_hi - kb_lo;
            } else if constexpr (QUANT != MX_QUANT_NONE) {
                /* the tensor cores' FP8 accumulation keeps too few bits over a long
                 * K: each weight box's products go into part and are added to acc
                 * in float32, with block scales (256-wide tiles) every k block,
                 * promoted with its scales, per tensor every two k blocks (256
                 * fp8 columns), the two slots released together. Per tensor,
                 * half the promotion waits of one k block at a time: DeepSeek-V3
                 * fp8_tensor M = 4096 6129 -> 5444 us, 2048 4806 -> 4638,
                 * Mixtral M = 1024 / 16384 -1.6 / -1.9%, qwen3moe -1.0..+1.0%,
                 * test errors unchanged (H100, 2026-11-25). Two product sets of
                 * 64 columns alternating instead: Mixtral M = 16384 +26% (m64n64
                 * wgmmas read A twice as often: the shared memory bandwidth).
                 * k_blocks is even per tensor (an odd count padded with a zero
                 * block), so no wgmma is conditional: with the second block of a
                 * pair under a branch ptxas fenced the wgmmas (C7519); straight,
                 * DeepSeek-V3 M = 4096 forwards -0.7%, Mixtral M = 16384 -0.2%
                 * (H200, 2026-11-26); an odd last block on its own path spilled
                 * 500-900 bytes. */
                constexpr int KB = kBlockScales ? 1 : 2; /* k blocks per promotion */
                static_assert(STAGES >= KB, "a promotion holds KB slots");
                for (int kb = kb_lo; kb < kb_hi; kb += KB) {
                    /* block scales of this k block, loaded while the slot fills */
                    float lo[2] = {1.0f, 1.0f}, hi[2] = {1.0f, 1.0f};
                    if (kBlockScales) {
                        const float a_lo = sa_lo ? sa_lo[kb] : 0.0f, a_hi = sa_hi ? sa_hi[kb] : 0.0f;
                        const float w0 = sw0 ? sw0[kb] : 0.0f, w1 = sw1 ? sw1[kb] : 0.0f;
                        lo[0] = a_lo * w0;
                        lo[1] = a_lo * w1;
                        hi[0] = a_hi * w0;
                        hi[1] = a_hi * w1;
                    }
                    uint32_t slot[KB];
#pragma unroll
                    for (int j = 0; j < KB; ++j) {
                        slot[j] = (it + j) % STAGES;
                        mbar_wait(full_bar(slot[j]), ((it + j) / STAGES) & 1u);
                    }
                    if (A_BY_TOKEN)
                        fence_proxy_async_smem(); /* the cp.async rows, before wgmma reads them */
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float part[BN / 4];
                        fence_acc(part);
                        wgmma_fence();
#pragma unroll
                        for (int j = 0; j < KB; ++j) {
                            const uint32_t a_src = base + slot[j] * STAGE_BYTES + wg_row * 128,
                                           w_src = base + slot[j] * STAGE_BYTES + A_BYTES + h * HALF_W_BYTES;
#pragma unroll
                            for (int kk = 0; kk < KSTEPS; ++kk)
                                sm90_wgmma<TA, BN / 2>::run(part, sw128_desc(a_src + kk * 32), sw128_desc(w_src + kk * 32),
                                                            (j | kk) != 0);
                        }
                        wgmma_commit();
                        wgmma_wait<0>();
                        fence_acc(part);
                        if (kBlockScales) {
#pragma unroll
                            for (int j = 0; j < BN / 4; ++j)
                                acc[h * (BN / 4) + j] = fmaf(part[j], j % 4 < 2 ? lo[h] : hi[h], acc[h * (BN / 4) + j]);
                        } else {
#pragma unroll
                            for (int j = 0; j < BN / 4; ++j)
                                acc[h * (BN / 4) + j] += part[j];
                        }
                    }
#pragma unroll
                    for (int j = 0; j < KB; ++j)
                        release(slot[j]);
                    it += KB;
                }
            } else {
                uint32_t prev = 0;
                for (int kb = kb_lo; kb < kb_hi; ++kb, ++it) {
                    const uint32_t s = it % STAGES, phase = (it / STAGES) & 1u;
                    mbar_wait(full_bar(s), phase);
                    if (A_BY_TOKEN)
                        fence_proxy_async_smem(); /* the cp.async rows, before wgmma reads them */
                    const uint32_t a_src = base + s * STAGE_BYTES + wg_row * 128, w_src = base + s * STAGE_BYTES + A_BYTES;
                    fence_acc(acc);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < KSTEPS; ++kk)
                        sm90_wgmma<TA, BN>::run(acc, sw128_desc(a_src + kk * 32), sw128_desc(w_src + kk * 32),
                                                kb != kb_lo || kk != 0);
                    wgmma_commit();
                    fence_acc(acc);
                    if (kb > kb_lo) {
                        /* the previous k-block's wgmmas have retired: its slot is free */
                        wgmma_wait<1>();
                        fence_acc(acc);
                        release(prev);
                    }
                    prev = s;
                }
                wgmma_wait<0>();
                fence_acc(acc);
                release(prev);
            }
            if (kPingPong && lane == 0)
                mbar_arrive(turn_bar(wg));
            if (!DEALT && kAhead && following < total)
                sm90_unit_finish<KIND, QUANT>(next, g, sc);
            if (DEALT && !kPingPong)
                following = read_dealt();
            if (cur.real) {
                constexpr int kBoxes = BN / 128; /* staging boxes per warpgroup */
                const sm90_out_stage stage = {out_boxes + wg * kBoxes * Shape::kOutBoxBytes, r_lo - wg_row};
                if constexpr (sm90_staged_out<KIND>()) {
                    /* the boxes are free once the last tile's store has read them */
                    if (threadIdx.x % 128 == 0)
                        bulk_wait_read<0>();
                    named_barrier_sync(1 + wg, 128);
                }
                constexpr uint32_t kWarpBytes =
                    sm90_down_boxes<Shape, KIND, QUANT>() ? Shape::kDownStageBytes : Shape::kWarpStageBytes;
                unsigned char *warp_stage =
                    sm90_smem + (out_boxes - mx_smem_addr(sm90_smem)) + (threadIdx.x / 32) * kWarpBytes;
                sm90_epilogue<T, Shape, KIND, QUANT>(acc, rows, lane, nt, expert, cur.split, g, cur.scale, sc, stage,
                                                     warp_stage, &tma_out, mt * BM + wg_row + warp_in_wg * 16);
                if constexpr (sm90_staged_out<KIND>()) {
                    fence_proxy_async_smem(); /* the copy engine reads what these threads wrote */
                    named_barrier_sync(1 + wg, 128);
                    if (threadIdx.x % 128 == 0) {
#pragma unroll
                        for (int b = 0; b < kBoxes; ++b)
                            tma_store_2d(&tma_out, stage.base + b * Shape::kOutBoxBytes, nt * (BN / 2) + 64 * b,
                                         mt * BM + wg_row);
                        bulk_commit();
                    }
                }
            }
            if (DEALT && kPingPong)
                following = read_dealt();
            if (DEALT && kAhead)
                sm90_unit_finish<KIND, QUANT>(next, g, sc);
            if (QUANT != MX_QUANT_NONE) {
#pragma unroll
                for (int i = 0; i < BN / 2; ++i)
                    acc[i] = 0.0f;
            }
        }
        if ((sm90_staged_out<KIND>() && threadIdx.x % 128 == 0) ||
            (sm90_y_boxes<Shape, KIND, QUANT>(g) && lane == 0))
            bulk_wait_all<0>(); /* the boxes live in this CTA's shared memory */
    }
    if (CM > 1)
        cluster_sync(); /* no CTA leaves while its peer may still arrive on its barriers */
#else
    __trap(); /* launched only where mx_cuda_sm90_gemm_available() saw sm_90a code */
#endif
}

/* ---- host: launch ------------------------------------------------------------------ */

/* Clusters of cluster_m CTAs of `kernel` that fit on the device at once
 * (one CTA per SM): the persistent grid. Cached per tile shape and device
 * (the shape fixes threads and cluster size, every kernel of one shape takes
 * the same registers, and its kinds' shared memory, with or without the
 * staging boxes, leaves one CTA per SM). Falls back to SMs / cluster_m when
 * the occupancy query fails. */
template <typename Shape, typename Kernel>
int64_t sm90_max_clusters(Kernel kernel, int device, int cluster_m, int threads, int smem_bytes)
{
    static std::atomic<int> cached[64];
    const int slot = device & 63;
    int n = cached[slot].load(std::memory_order_relaxed);
    if (n > 0)
        return n;
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms < 1)
        sms = 1;
    n = sms / cluster_m;
    if (cluster_m > 1) {
        cudaLaunchConfig_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.gridDim = dim3(static_cast<unsigned>(cluster_m * n));
        cfg.blockDim = dim3(static_cast<unsigned>(threads));
        cfg.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim.x = cluster_m;
        attr.val.clusterDim.y = 1;
        attr.val.clusterDim.z = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int active = 0;
        if (cudaOccupancyMaxActiveClusters(&active, kernel, &cfg) == cudaSuccess && active > 0)
            n = active;
    }
    cudaGetLastError();
    if (n < 1)
        n = 1;
    cached[slot].store(n, std::memory_order_relaxed);
    return n;
}

/* One GEMM over g.a [rows, K] (stride g.lda elements of TA: by sorted
 * row, or with A_BY_TOKEN by token) and g.w, its units DEALT from
 * g.units_taken or round robin; the caller checked the TMA preconditions. */
template <typename TA, typename T, typename Shape, int KIND, int QUANT, bool A_BY_TOKEN, bool DEALT>
mx_status launch_sm90_walk(const mx_gemm_args &g, const mx_sm90_scales &sc, int64_t local_experts, int64_t m_tiles,
                           cudaStream_t stream)
{
    auto kernel = grouped_gemm_sm90_kernel<TA, T, Shape, KIND, QUANT, A_BY_TOKEN, DEALT>;
    constexpr int BN = Shape::kBlockN;
    const int64_t n_tiles = KIND == MX_GEMM_GATE_UP || KIND == MX_GEMM_GATE_UP_INTERLEAVED
                                ? mx_ceil_div(g.out_cols, BN / 2)
                                : mx_ceil_div(g.n_rows, BN);
    static const mx_kernel_name kernel_name("grouped_gemm_sm90_kernel<%s, %s, %dx%d, %s%s%s%s>",
                                            sm90_dtype<TA>::name(), sm90_dtype<T>::name(), Shape::kBlockM, BN,
                                            mx_gemm_kind_name(KIND), sm90_quant_names[QUANT],
                                            A_BY_TOKEN ? ", A by token" : "", DEALT ? ", dealt units" : "");
    const char *name = kernel_name.text;
    if (m_tiles * n_tiles * g.k_splits > 0x7fffffff || m_tiles * Shape::kBlockM > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "%s: %lld x %lld tiles exceed int32 indexing", name, (long long)m_tiles,
                              (long long)n_tiles);
    const bool boxes = sm90_y_boxes<Shape, KIND, QUANT>(g);
    if (g.k_splits < 1 || (g.k_splits > 1 && (!sm90_takes_slices<Shape, KIND, QUANT>() || boxes || !g.split_count ||
                                               g.k_splits > kSm90DownMaxSplits)))
        return mx_status_fail(MX_ERR_VALUE,
                              "%s: %d k slices (GEMM2 per tensor or 16-bit on 128-row tiles, by pair, at most %d, "
                              "with split_count)",
                              name, g.k_splits, kSm90DownMaxSplits);
    if (g.y_by_sorted_row && !boxes)
        return mx_status_fail(MX_ERR_VALUE, "%s: y by sorted row is not compiled here", name);
    constexpr bool kQuantAct = sm90_quantizes_act<Shape, KIND, QUANT>();
    if (kQuantAct != (sc.act_q != nullptr && sc.act_q_scale != nullptr))
        return mx_status_fail(MX_ERR_VALUE, "%s: act_q and act_q_scale %s", name,
                              kQuantAct ? "are required (the kernel quantizes act)" : "are not taken here");

    static std::atomic<unsigned long long> configured{0};
    constexpr size_t kSmem = sm90_smem_bytes<Shape, KIND, QUANT>();
    mx_status st = mx_opt_in_smem(kernel, kSmem, configured, name);
    if (st.code != MX_OK)
        return st;
    CUtensorMap map_a, map_w, map_out;
    if (!sm90_weight_map<TA>(g.w, g.k, g.n_rows, local_experts, BN / 2, g.w_packed, &map_w, &st))
        return st;
    if (A_BY_TOKEN)
        map_a = map_w; /* not read: the kernel copies its A rows by token */
    else if (!sm90_rows_map<TA>(g.a, g.lda, m_tiles * Shape::kBlockM, Shape::kBlockM, g.k, &map_a, &st))
        return st;
    if (boxes) {
        if (!sm90_rows_map<float>(g.out, g.ldo, m_tiles * Shape::kBlockM, 16, g.out_cols, &map_out, &st))
            return st;
    } else if (!sm90_staged_out<KIND>()) {
        map_out = map_a; /* not read */
    } else if (!sm90_rows_map<T>(g.out, g.ldo, m_tiles * Shape::kBlockM, 64, g.out_cols, &map_out, &st)) {
        return st;
    }
    const size_t smem = Shape::kSmemBytes + sm90_launch_out_bytes<Shape, KIND, QUANT>(g);
    int device = 0;
    st = mx_check_call(cudaGetDevice(&device), "cudaGetDevice");
    if (st.code != MX_OK)
        return st;

    constexpr int CM = Shape::kClusterM;
    const int64_t worst = mx_ceil_div(m_tiles, CM) * n_tiles * g.k_splits; /* work units */
    const int64_t clusters = sm90_max_clusters<Shape>(kernel, device, CM, Shape::kThreads, static_cast<int>(kSmem));
    const int64_t grid = CM * (worst < clusters ? worst : clusters);
    if (CM == 1) {
        kernel<<<static_cast<unsigned>(grid), Shape::kThreads, smem, stream>>>(map_a, map_w, map_out, g, sc,
                                                                                static_cast<int>(n_tiles));
        return mx_check_launch(name);
    }
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(Shape::kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = CM;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    st = mx_check_call(cudaLaunchKernelEx(&cfg, kernel, map_a, map_w, map_out, g, sc, static_cast<int>(n_tiles)), name);
    if (st.code != MX_OK)
        return st;
    return mx_check_launch(name);
}

/* launch_sm90_walk with the units dealt where the caller passed a counter
 * (single CTAs only), else round robin. */
template <typename TA, typename T, typename Shape, int KIND, int QUANT, bool A_BY_TOKEN>
mx_status launch_sm90(const mx_gemm_args &g, const mx_sm90_scales &sc, int64_t local_experts, int64_t m_tiles,
                      cudaStream_t stream)
{
    if constexpr (Shape::kClusterM == 1) {
        if (g.units_taken)
            return launch_sm90_walk<TA, T, Shape, KIND, QUANT, A_BY_TOKEN, true>(g, sc, local_experts, m_tiles,
                                                                                 stream);
    }
    return launch_sm90_walk<TA, T, Shape, KIND, QUANT, A_BY_TOKEN, false>(g, sc, local_experts, m_tiles, stream);
}

/* GEMM1 of KIND with its A rows by token (16-bit: always) or, FP8 without
 * a_by_token, by sorted row. */
template <typename TA, typename T, typename Shape, int KIND, int QUANT>
mx_status launch_sm90_gemm1(const mx_gemm_args &g, const mx_sm90_scales &sc, bool a_by_token, int64_t local_experts,
                            int64_t m_tiles, cudaStream_t stream)
{
    if constexpr (sizeof(TA) == 1) {
        if (!a_by_token)
            return launch_sm90<TA, T, Shape, KIND, QUANT, false>(g, sc, local_experts, m_tiles, stream);
    }
    return launch_sm90<TA, T, Shape, KIND, QUANT, true>(g, sc, local_experts, m_tiles, stream);
}

/* The GEMM of `kind` on Shape's tiles. GEMM1 kinds read A by token or
 * (FP8 without a_by_token) by sorted row (launch_sm90_gemm1); MX_GEMM_DOWN
 * reads act by sorted row. */
template <typename TA, typename T, typename Shape, int QUANT>
mx_status grouped_gemm_sm90_shape(const mx_gemm_args *g, const mx_sm90_scales &sc, mx_gemm_kind kind, bool a_by_token,
                                  int64_t local_experts, int64_t m_tiles, cudaStream_t stream)
{
    if (m_tiles <= 0)
        return mx_status_ok();
    switch (kind) {
    case MX_GEMM_GATE_UP:
        return launch_sm90_gemm1<TA, T, Shape, MX_GEMM_GATE_UP, QUANT>(*g, sc, a_by_token, local_experts, m_tiles,
                                                                       stream);
    case MX_GEMM_GATE_UP_INTERLEAVED:
        if constexpr (Shape::kPingPong)
            return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90: the interleaved GEMM1 has no ping-pong form "
                                                "(its staging boxes do not fit beside the ring)");
        else
            return launch_sm90_gemm1<TA, T, Shape, MX_GEMM_GATE_UP_INTERLEAVED, QUANT>(*g, sc, a_by_token,
                                                                                       local_experts, m_tiles, stream);
    case MX_GEMM_UP:
        return launch_sm90_gemm1<TA, T, Shape, MX_GEMM_UP, QUANT>(*g, sc, a_by_token, local_experts, m_tiles, stream);
    case MX_GEMM_DOWN:
        return launch_sm90<TA, T, Shape, MX_GEMM_DOWN, QUANT, false>(*g, sc, local_experts, m_tiles, stream);
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90: unknown kind %d", (int)kind);
}

/* Entry of the 16-bit instantiations (grouped_gemm_bf16_sm90.cu / _fp16_sm90.cu). */
template <typename T>
mx_status grouped_gemm_sm90(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config, int64_t local_experts,
                            int64_t m_tiles, cudaStream_t stream)
{
    mx_sm90_scales none;
    memset(&none, 0, sizeof none);
    switch (tile_config) {
    case MX_TILE_SM90:
        return grouped_gemm_sm90_shape<T, T, mx_tile_sm90, MX_QUANT_NONE>(g, none, kind, true, local_experts, m_tiles,
                                                                           stream);
    case MX_TILE_SM90_PAIR:
        return grouped_gemm_sm90_shape<T, T, mx_tile_sm90_pair, MX_QUANT_NONE>(g, none, kind, true, local_experts,
                                                                                m_tiles, stream);
    case MX_TILE_SM90_PP:
        return grouped_gemm_sm90_shape<T, T, mx_tile_sm90_pp, MX_QUANT_NONE>(g, none, kind, true, local_experts,
                                                                              m_tiles, stream);
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90: tile config %d is not an sm90 config", tile_config);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_GROUPED_GEMM_SM90_IMPL_CUH */
