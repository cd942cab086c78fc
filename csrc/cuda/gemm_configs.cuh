/* Tile configurations of the grouped GEMMs (sm_80 .. sm_90), and the rules
 * that pick one. Every compiled config is listed here with its reason.
 *
 * block_m is also the padding of the expert segments built by moe_align, so
 * GEMM1 and GEMM2 of one forward use the same config. */
#ifndef MOE_EXT_CUDA_GEMM_CONFIGS_CUH
#define MOE_EXT_CUDA_GEMM_CONFIGS_CUH

#include <stddef.h>
#include <stdint.h>

#include "moe_ext/abi.h"

/* kBlockK is 64 for all: one 128-byte row of 16-bit elements per tile row,
 * eight 16-byte chunks, XOR-swizzled by (row % 8) so that ldmatrix and
 * cp.async are free of bank conflicts. */
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int MIN_BLOCKS, int M_ON_X>
struct mx_tile_shape {
    static constexpr int kBlockM = BM;          /* rows (sorted pairs) per CTA */
    static constexpr int kBlockN = BN;          /* weight rows per CTA (gate + up for gated GEMM1) */
    static constexpr int kBlockK = 64;
    static constexpr int kWarpsM = WARPS_M;
    static constexpr int kWarpsN = WARPS_N;
    static constexpr int kThreads = WARPS_M * WARPS_N * 32;
    static constexpr int kStages = STAGES;      /* cp.async pipeline depth */
    static constexpr int kMinBlocks = MIN_BLOCKS; /* CTAs per SM we ask registers for */
    static constexpr int kMOnX = M_ON_X;        /* 1: neighbouring CTAs share a weight slice */
    static constexpr int kLdc = BN + 8;         /* float32 epilogue tile row; +8 keeps float2 stores conflict-free */
    static constexpr size_t kPipeBytes = size_t(STAGES) * (BM + BN) * 64 * 2;
    static constexpr size_t kEpilogueBytes = size_t(BM) * kLdc * 4;
    static constexpr size_t kSmemBytes = kPipeBytes > kEpilogueBytes ? kPipeBytes : kEpilogueBytes;

    static_assert(BM % (16 * WARPS_M) == 0, "each warp covers whole 16-row mma fragments");
    static_assert(BN % (16 * WARPS_N) == 0, "each warp covers pairs of 8-column fragments (ldmatrix.x4)");
    static_assert((BM * 8) % kThreads == 0 && (BN * 8) % kThreads == 0,
                  "every thread loads the same number of 16-byte chunks per stage");
    static_assert(BN % 2 == 0, "gated tiles hold BN/2 gate and BN/2 up rows");
    static_assert(kSmemBytes <= 227 * 1024, "fits the sm_90 shared-memory opt-in limit");
};

/* decode: few rows per expert. 16-row tiles waste little on padding; narrow
 * 64-row weight slices give many CTAs, and 6 stages keep ~40 KB of weights
 * in flight per CTA, so the weights stream at bandwidth; m tiles on grid x
 * so the m tiles of one expert that share a weight slice run side by side
 * and hit L2. 60 KB of shared memory, 3 CTAs per SM. */
typedef mx_tile_shape<16, 64, 1, 4, 6, 3, 1> mx_tile_decode;
/* mid: tens of rows per expert (prefill of a few hundred to a few thousand
 * tokens over many experts): 64x128 tiles, 4 warps of 32x64, 72 KB, 3 CTAs/SM. */
typedef mx_tile_shape<64, 128, 2, 2, 3, 3, 0> mx_tile_mid;
/* large: hundreds of rows per expert: 128x128 tiles, 8 warps of 64x32,
 * 96 KB, 2 CTAs/SM; n tiles on grid x so that the CTAs of one m tile run
 * together and the gathered rows stay in L2. */
typedef mx_tile_shape<128, 128, 2, 4, 3, 2, 0> mx_tile_large;

/* ---- sm_90a (Hopper) wgmma path, grouped_gemm_sm90_impl.cuh ---------------- */

constexpr int kSm90BlockM = 128; /* also moe_align's block_m for this path */
/* slots of the ring that hands a CTA its dealt work units (sm90_units.cuh) */
constexpr int kSm90UnitRing = 4;
/* m units per group of the unit order where the units are dealt (round
 * robin: the shape's kGroupM, also 8). Larger groups lose on the dealt
 * walk: against 8, two rounds over 27 points of qwen3moe, DeepSeek-V3 and
 * gpt-oss at M = 1024 / 4096 / 16384 (H100, 2026-11-28,
 * logs/2026-11-28-nvidia-h100-ab-dealt-group-size.txt), 16: 1.0061
 * (DeepSeek-V3 bf16 M = 4096 +6.4%, gpt-oss bf16 M = 4096 +2.5%), 32:
 * 1.0268 (+14.1%, +11.9%): fewer groups split an expert's m tiles, but
 * the group's A rows outgrow what L2 keeps beside the weight stream.
 * Smaller groups are flat: on an H200, 4: 0.9996, 2: 1.0016 over the same
 * points (logs/2026-11-28-nvidia-h200-ab-dealt-group-4-2.txt). */
constexpr int kSm90DealtGroupM = 8;

/* PING_PONG: each math warpgroup takes whole units of its own, 64 rows x BN
 * (moe_align's block_m 64), the two in turn on the one ring, so that one's
 * epilogue runs while the other's wgmmas drain the ring. */
template <int BN, int STAGES, int CLUSTER_M, int GROUP_M, bool PING_PONG = false>
struct mx_sm90_shape {
    static constexpr bool kPingPong = PING_PONG;
    static constexpr int kBlockM = PING_PONG ? 64 : kSm90BlockM; /* rows of a unit: a tile of the tile table */
    static constexpr int kBlockN = BN;      /* wgmma n; weight rows per tile, loaded as two boxes of BN/2 */
    static constexpr int kBlockKBytes = 128; /* the 128B swizzle span: 64 16-bit or 128 fp8 elements */
    static constexpr int kStages = STAGES;  /* TMA ring depth */
    static constexpr int kClusterM = CLUSTER_M; /* CTAs per cluster, on consecutive m tiles */
    static constexpr int kGroupM = GROUP_M; /* tile order: m units per group, m fastest */
    static constexpr int kMathWarpgroups = 2;
    static constexpr int kMathWarps = 4 * kMathWarpgroups;
    static constexpr int kThreads = 128 * (kMathWarpgroups + 1);
    static constexpr int kMathRegs = 232;   /* setmaxnreg: BN/2 accumulators + epilogue */
    static constexpr int kProducerRegs = 40;
    static constexpr uint32_t kABytes = kBlockM * kBlockKBytes;
    static constexpr uint32_t kWBytes = BN * kBlockKBytes;
    static constexpr uint32_t kStageBytes = kABytes + kWBytes;
    /* 1024 bytes of slack to align the slots to the swizzle atom, then the
     * slots, then full and empty barriers (8 bytes each; ping-pong: and the
     * two warpgroups' turn barriers), then the unit ring (full and empty
     * barriers, int32 slots: sm90_units.cuh) */
    static constexpr size_t kUnitRingBytes = 20 * kSm90UnitRing;
    static constexpr size_t kSmemBytes =
        1024 + size_t(STAGES) * kStageBytes + 2 * 8 * STAGES + (PING_PONG ? 16 : 0) + kUnitRingBytes;
    /* interleaved GEMM1's act tile on its way out (TMA store), between the
     * slots and the barriers of that kind's kernel: per math warpgroup 64
     * rows x BN/2 16-bit columns, as BN/128 boxes of 64 x 64 (8 KB) */
    static constexpr uint32_t kOutBoxBytes = 64 * 128;
    static constexpr uint32_t kOutBytes = kMathWarpgroups * (BN / 128) * kOutBoxBytes;
    /* the other kinds' output on its way out: per math warp 16 rows x 128
     * bytes (32 float32 y or 64 act columns), so that each store
     * instruction writes whole lines of four rows; then GEMM2's bias row of
     * the tile (BN 16-bit values) */
    static constexpr uint32_t kWarpStageBytes = 16 * 128 + BN * 2;
    /* GEMM2's y by sorted row on its way out (TMA stores, block scales):
     * per math warp two boxes of 16 rows x 32 float32 columns, filled in
     * turn */
    static constexpr uint32_t kDownBoxBytes = 16 * 128;
    static constexpr uint32_t kDownStageBytes = 2 * kDownBoxBytes;

    static_assert(BN % 128 == 0 && BN <= 256, "wgmma n up to 256; interleaved GEMM1 tiles stage whole 64-column boxes");
    static_assert(kStageBytes % 1024 == 0 && kWBytes % 2048 == 0, "slots and weight boxes start on 1024-byte atoms");
    /* (ping-pong units stage only by warp: neither the interleaved GEMM1's
     * boxes nor the block-scale GEMM2's y boxes run on them) */
    static_assert(kSmemBytes + kMathWarps * kWarpStageBytes <= 227 * 1024 &&
                      (PING_PONG || (kSmemBytes + kOutBytes <= 227 * 1024 &&
                                     kSmemBytes + kMathWarps * kDownStageBytes <= 227 * 1024)),
                  "fits the sm_90 shared-memory opt-in limit, staging included");
    static_assert(kMathRegs * 128 * kMathWarpgroups + kProducerRegs * 128 <= 65536, "register file of one SM");
    static_assert(kMathRegs % 8 == 0 && kProducerRegs % 8 == 0, "setmaxnreg takes multiples of 8");
    static_assert(CLUSTER_M == 1 || CLUSTER_M == 2, "pairs of CTAs at most (the multicast mask covers the pair)");
    static_assert(!PING_PONG || CLUSTER_M == 1, "ping-pong units on single CTAs");
    static_assert(GROUP_M >= 1, "at least one m unit per group");
};

/* 128x256x64, 4 stages (193 KB, 1 CTA/SM): m64n256 wgmma per math
 * warpgroup, the largest n (fewest shared-memory bytes per MAC) with 128
 * accumulators per thread; tile order in groups of 8 m tiles (1024 rows).
 * 128x128 tiles (6 stages) were 1-4% slower at M >= 4096 and within 2% at
 * M = 1024; groups of 16 m units were up to 8% slower than 8 except once
 * (Mixtral M=4096, 2% faster); 4 and 8 equal (H200, 2026-11-22). */
typedef mx_sm90_shape<256, 4, 1, 8> mx_tile_sm90;
/* The same tile in clusters of 2 CTAs on neighbouring m tiles of one expert,
 * the weight tile multicast (32 instead of 48 KB per k block from L2 per
 * CTA): +4% on both GEMMs of Mixtral at 4096 rows per expert, but 4-7%
 * slower with a few m tiles per expert (pairs straddle experts, and the
 * pair runs in lockstep). */
typedef mx_sm90_shape<256, 4, 2, 8> mx_tile_sm90_pair;
/* Ping-pong units of 64 rows x 256 (mx_sm90_shape PING_PONG) at a few tens
 * of rows per expert, with short K or many experts (mx_sm90_ping_pong): the
 * 128-row tiles there are mostly padding, and the cooperative tile's
 * epilogue leaves the ring idle. 5 stages of 40 KB (221 KB with the warps'
 * staging; the interleaved kind's 32 KB of boxes do not fit, so it keeps
 * mx_tile_sm90). */
typedef mx_sm90_shape<256, 5, 1, 8, true> mx_tile_sm90_pp;
/* FP8 with 128x128 block scales where 128x256 tiles cannot or should not
 * take them (gemm_configs_fp8.cuh mx_fp8_sm90_block_wide): every k block's
 * products land in one of two more accumulator sets (alternating) that is
 * promoted with the block's scales, so the tile holds 3 x BN/2
 * accumulators per thread; BN = 128 keeps them under the 232 registers. 6
 * stages of 32 KB (193 KB, 1 CTA/SM). In 2-CTA clusters with the weight
 * boxes multicast (24 instead of 32 KB per k block from L2 per CTA) it was
 * not faster: -4..+12% per GEMM (H100, 2026-11-25). */
typedef mx_sm90_shape<128, 6, 1, 8> mx_tile_sm90_n128;

/* Split-K of the persistent kernel's GEMM2 (grouped_gemm_sm90_impl.cuh).
 * Its units (m unit, n tile) go to a fixed grid of one CTA per SM, so a
 * GEMM2 of few long units runs in whole rounds: Mixtral at M = 512 has ~12
 * m tiles x 16 n tiles = 192 units of 112 fp8 k blocks on 132 SMs, two
 * rounds where 1.45 would do (GEMM2 191 us against a 107 us weight stream,
 * H200). Cut into s slices along K (slice slowest, each a float32 partial
 * y that moe_sum adds), the same work takes ceil(s u / c) rounds of 1 / s
 * the length. The kernel picks s on the device, from the tiles in use:
 * the s <= max_splits with the fewest k blocks per CTA, counting each unit
 * kSm90DownSplitUnitCost k blocks more, and s > 1 only where that is at
 * least 10% fewer than one slice's. len: k blocks per slice, a multiple of
 * align (per-tensor FP8 promotes pairs), every slice non-empty and at
 * least kSm90DownSplitMinKBlocks long.
 * Measured (profile_layer, H200, 2026-11-27, two rounds; slices against
 * none): Mixtral GEMM2 bf16 M = 512 352 -> 288 us, M = 1024 527 -> 458,
 * fp8_tensor M = 512 192 -> 165, M = 1024 251 -> 233, while moe_sum reads
 * a slice more (+2.5 us at M = 512, +12 at 1024). Per round those fit
 * ~0.7 us per k block plus 8-16 us per unit (its epilogue, y, the round's
 * ramp): the unit cost below. The 128x128 block-scale GEMM2 at M = 1024,
 * which a 2-block cost split, lost (321 -> 339 us). */
constexpr int kSm90DownMaxSplits = 4;
constexpr int kSm90DownSplitMinKBlocks = 16;
constexpr int kSm90DownSplitUnitCost = 12;
/* slices are allowed where the worst-case grid has at most this many units
 * (4 rounds of 132 SMs: past that a slice saves at most 1 / 8 of a round's
 * length, and y grows by a slice per split); more than two only up to
 * kSm90DownSplitManyMaxUnits (3 or 4 slices gain over 2 only where a third
 * of the SMs or fewer have a unit) */
constexpr int64_t kSm90DownSplitMaxUnits = 528;
constexpr int64_t kSm90DownSplitManyMaxUnits = 264;

struct mx_sm90_split {
    int count, len;
};

/* k blocks per slice of k_blocks in s slices: the even share rounded up
 * to align, or 0 where that would leave the last slice empty */
__host__ __device__ inline int mx_sm90_slice_len(int k_blocks, int s, int align)
{
    const int len = ((k_blocks + s - 1) / s + align - 1) / align * align;
    return (s - 1) * len < k_blocks ? len : 0;
}

__host__ __device__ inline mx_sm90_split mx_sm90_down_split(int units, int slots, int max_splits, int k_blocks,
                                                             int align)
{
    mx_sm90_split best = {1, k_blocks};
    if (units < 1 || slots < 1)
        return best;
    /* int32 divisions (the launcher keeps units x slices in range): the
     * kernel's every thread evaluates this before its loop */
    const int64_t whole = static_cast<int64_t>((units + slots - 1) / slots) * (k_blocks + kSm90DownSplitUnitCost);
    int64_t best_cost = whole;
    for (int s = 2; s <= max_splits; ++s) {
        const int len = mx_sm90_slice_len(k_blocks, s, align);
        if (len < kSm90DownSplitMinKBlocks)
            break;
        const int64_t cost = static_cast<int64_t>((s * units + slots - 1) / slots) * (len + kSm90DownSplitUnitCost);
        if (cost < best_cost && 10 * cost <= 9 * whole) {
            best.count = s;
            best.len = len;
            best_cost = cost;
        }
    }
    return best;
}

/* Exactly n slices (a test setting, mx_cuda_set_sm90_down_splits), or the
 * most below n whose slices are all non-empty. */
__host__ __device__ inline mx_sm90_split mx_sm90_down_split_exact(int k_blocks, int n, int align)
{
    for (; n > 1; --n) {
        const int len = mx_sm90_slice_len(k_blocks, n, align);
        if (len > 0)
            return mx_sm90_split{n, len};
    }
    return mx_sm90_split{1, k_blocks};
}

/* The most slices the plan makes room for (y [max, rows, H]): 1 where K
 * is short or where the worst case has many units (kSm90DownSplitMaxUnits;
 * 256-wide n tiles). k_blocks: 128-byte k blocks of GEMM2. (The block-scale
 * GEMM2 takes none: its 128x128 tiles already make ~2x the units, and the
 * one measured split lost, above.) */
static inline int mx_sm90_down_max_splits(int64_t m_tiles, int64_t hidden, int64_t k_blocks)
{
    const int64_t units = m_tiles * ((hidden + 255) / 256);
    if (units > kSm90DownSplitMaxUnits)
        return 1;
    const int64_t most = units > kSm90DownSplitManyMaxUnits ? 2 : kSm90DownMaxSplits;
    const int64_t by_k = k_blocks / kSm90DownSplitMinKBlocks;
    return static_cast<int>(by_k < 1 ? 1 : by_k < most ? by_k : most);
}

/* Hopper decode kernel (grouped_gemm_sm90_decode.cuh): one warpgroup per
 * CTA, 128 weight rows (wgmma m, two boxes of 64) x BT tokens (wgmma n) x
 * 128 bytes of K per stage. The float32 epilogue tile [128][BT + 1] reuses
 * the drained ring. PAIRED: the weight boxes of two k blocks (two slots)
 * are issued together, so each weight row's 256 contiguous bytes are
 * requested at once, with L2 promotion 128B; slots are then refilled two
 * at a time (mx_sm90_decode_paired). */
template <int BT, int STAGES, bool PAIRED = false>
struct mx_sm90_decode_shape {
    static constexpr int kBlockT = BT;         /* tokens (sorted rows) per tile: moe_align's block_m */
    static constexpr int kStages = STAGES;
    static constexpr bool kPairedLoads = PAIRED;
    static constexpr int kThreads = 128;
    static constexpr uint32_t kWBytes = 128 * 128;
    static constexpr uint32_t kABytes = BT * 128;
    static constexpr uint32_t kStageBytes = kWBytes + kABytes;
    static constexpr int kLdd = BT + 1;
    static constexpr size_t kSmemBytes = 1024 + size_t(STAGES) * kStageBytes + 8 * STAGES;

    static_assert(BT == 16 || BT == 32 || BT == 48 || BT == 64, "wgmma n of the compiled forms");
    static_assert(kStageBytes % 1024 == 0, "slots start on 1024-byte swizzle atoms");
    static_assert(size_t(128) * kLdd * 4 <= size_t(STAGES) * kStageBytes, "the epilogue tile fits the ring");
    static_assert(!PAIRED || STAGES % 2 == 0, "paired loads refill pairs of slots");
};
/* 16 tokens, 6 stages of 18 KB (110 KB): 2 CTAs per SM keep up to 12 k
 * blocks (192 KB of weights) in flight per SM. */
typedef mx_sm90_decode_shape<16, 6> mx_tile_sm90_decode;
/* 32 tokens, 5 stages of 20 KB (101 KB), 2 CTAs per SM. */
typedef mx_sm90_decode_shape<32, 5> mx_tile_sm90_decode32;
/* 48 tokens, 5 stages of 22 KB (111 KB), 2 CTAs per SM: one stage more in
 * flight than 64-token tiles. */
typedef mx_sm90_decode_shape<48, 5> mx_tile_sm90_decode48;
/* 64 tokens, 4 stages of 24 KB (97 KB), 2 CTAs per SM. */
typedef mx_sm90_decode_shape<64, 4> mx_tile_sm90_mid;
/* GEMM1 kinds run the same tiles with fewer stages: 4 of 18 KB for 16
 * tokens, else 3 (63-75 KB), so 3 CTAs share an SM (where the registers
 * allow: not FP8 block scales at 48 / 64 tokens) and one CTA's epilogue and
 * first loads overlap two others' streams, at about the same bytes in flight
 * per SM. GEMM1 shares against the shapes above (H200, 517d5fd): qwen3moe
 * fp8_tensor M = 512 139.6 -> 126.2 us, fp8_block 158.9 -> 154.9, bf16
 * 220.8 -> 214.1; Mixtral bf16 M = 8 / 128 287.9 -> 280.1 / 481.3 -> 473.4;
 * qwen3moe bf16 M = 1 / 64 22.3 -> 22.1 / 194.8 -> 196.9. GEMM2 keeps the
 * deeper rings but over short K (kSm90DecodeDownShallowKBlocks): on the
 * shallow ring Mixtral's (8 experts, split-K at M = 1) lost 7-12% (bf16
 * M = 128 226.7 -> 253.4 us), qwen3moe's bf16 at M = 1 4.1 -> 5.9. */
template <typename Shape>
using mx_sm90_decode_gemm1_shape = mx_sm90_decode_shape<Shape::kBlockT, Shape::kBlockT == 16 ? 4 : 3>;
/* Paired weight loads (mx_sm90_decode_shape PAIRED) on 16-token tiles
 * where the grid likely fills every CTA slot of its ring at least once
 * (grouped_gemm_sm90_decode.cu). A TMA read probe
 * (benchmarks/tma_stream_probe.cu, no math) streamed 4.36-4.62 TB/s with
 * each row's 256 bytes requested together and promotion 128B against
 * 4.04-4.34 for the decode kernel's one k block at a time with 256B. In the
 * layer, bench_moe A/B on the grid's routing (two rounds, H200,
 * 2026-11-26), every 16-token kernel paired: -1.7% over 36 points (qwen3moe
 * bf16 M = 8..64 -3.3..-4.2%, DeepSeek-V3 fp8 M = 8..64 -2.8..-3.9%,
 * gpt-oss bf16 M = 8..64 -2.2..-2.8%, Mixtral bf16 M = 1 / 32 -5.5 /
 * -4.0%), but the grids of under one wave lost: qwen3moe bf16 M = 1 +7.7%
 * (GEMM1: 96 CTAs on 132 SMs), qwen3moe fp8 M = 1 +2..+3%, gpt-oss M = 1
 * +1.1%; there the 256B promotion's read-ahead and the one-slot refills
 * keep more bytes in flight per CTA. With the fill rule (two rounds,
 * another H200): -1.2% over the same 36 points, none slower by more than
 * 0.4%, those M = 1 points unchanged (benchmarks/results/logs/
 * 2026-11-26-nvidia-h200-bench-ab-paired-loads.txt; on every tile size,
 * aed6b1c, one round was mixed). (Stages of two k blocks instead, with
 * one barrier per stage, lost where the 16-bit lag held one of two stages:
 * benchmarks/NOTES.md, "Two k blocks per decode stage".) */
template <typename Shape>
using mx_sm90_decode_paired = mx_sm90_decode_shape<Shape::kBlockT, Shape::kStages, true>;
/* GEMM2's weight maps on 16-token tiles take L2 promotion 128B instead of
 * 256B: the FP8 decode_down at any row length, the 16-bit decode kernel
 * over rows shorter than kSm90DecodeDownShortRowBytes. bench_moe A/B (the
 * grid's routing, two rounds, H200, 2026-11-26): qwen3moe bf16 M = 8 129.3
 * -> 127.0 us, gpt-oss bf16 M = 64 1315 -> 1297, Mixtral fp8_block M = 8
 * 277.7 -> 274.9, DeepSeek-V3 fp8_tensor M = 1 105.2 -> 103.9; -0.3..-1.8%
 * at every affected point. Mixtral bf16 GEMM2 (28 KB rows) lost 1.7% at
 * M = 32 (profile_layer). Elsewhere one k block at a time keeps 256B: its
 * read-ahead of each row's next 128 bytes keeps bytes in flight (promotion
 * 128B on every map: GEMM1 +2..+5%). */
constexpr int64_t kSm90DecodeDownShortRowBytes = 8192;
/* GEMM2 in the decode kernel without split-K and of at most this many k
 * blocks (128 bytes of K) a CTA takes GEMM1's shallow ring too
 * (mx_sm90_decode_gemm1_shape: 3 CTAs per SM; 16-token tiles paired where
 * the grid fills it): a short CTA's ring fill and epilogue then overlap two
 * others' streams. bench_moe A/B, two rounds each (H200, 2026-11-26):
 * 32- to 64-token tiles DeepSeek-V3 fp8_block M = 512 / 1024 2486 -> 2440
 * / 3277 -> 3187 us, fp8_tensor 2355 -> 2330 / 2878 -> 2819, qwen3moe
 * bf16 M = 256 / 512 -0.5 / -0.6%; 16-token tiles DeepSeek-V3 fp8_block
 * M = 32 / 128 -1.0 / -1.8%, fp8_tensor -0.7 / -1.2%, qwen3moe bf16 M = 8
 * -0.4%, its M = 1 (split-K: deep ring kept) and other points within
 * 0.2% (benchmarks/results/logs/2026-11-26-nvidia-h200-bench-ab-down-
 * shallow-ring.txt). At 48 k blocks (gpt-oss bf16: 45) gpt-oss M = 64..256
 * lost 0.4-0.6%; the deep ring stays for long K (Mixtral lost 7-12% on the
 * shallow ring). */
constexpr int64_t kSm90DecodeDownShallowKBlocks = 16;

enum mx_tile_config {
    MX_TILE_DECODE = 0,
    MX_TILE_MID = 1,
    MX_TILE_LARGE = 2,
    MX_TILE_SM90 = 3,        /* Hopper wgmma path; its mma.sync fallback is MX_TILE_LARGE (same block_m) */
    MX_TILE_SM90_PAIR = 4,   /* the same with 2-CTA clusters and weight multicast; same fallback */
    MX_TILE_SM90_DECODE = 5,   /* Hopper decode kernel, 16-token tiles */
    MX_TILE_SM90_MID = 6,      /* Hopper decode kernel, 64-token tiles */
    MX_TILE_SM90_DECODE32 = 7, /* Hopper decode kernel, 32-token tiles */
    MX_TILE_SM90_DECODE48 = 8, /* Hopper decode kernel, 48-token tiles */
    MX_TILE_SM90_PP = 9,       /* Hopper persistent kernel, ping-pong 64-row units (mx_tile_sm90_pp) */
};

static inline int mx_tile_is_sm90_decode(int config)
{
    return config == MX_TILE_SM90_DECODE || config == MX_TILE_SM90_DECODE32 || config == MX_TILE_SM90_DECODE48 ||
           config == MX_TILE_SM90_MID;
}

static inline int mx_tile_is_sm90_persistent(int config)
{
    return config == MX_TILE_SM90 || config == MX_TILE_SM90_PAIR || config == MX_TILE_SM90_PP;
}

/* The persistent configs whose GEMM2 may run in k slices (16-bit): the
 * 128-row tiles, not the ping-pong units (grouped_gemm_sm90_impl.cuh
 * sm90_takes_slices). */
static inline int mx_tile_sm90_takes_slices(int config)
{
    return config == MX_TILE_SM90 || config == MX_TILE_SM90_PAIR;
}

static inline int mx_tile_is_sm90(int config)
{
    return mx_tile_is_sm90_persistent(config) || mx_tile_is_sm90_decode(config);
}

/* The SIMT float32 path's tile rows (grouped_gemm_f32.cu). */
#define MX_F32_BLOCK_M 16

static inline int mx_tile_block_m(int config)
{
    return config == MX_TILE_SM90_DECODE   ? mx_tile_sm90_decode::kBlockT
         : config == MX_TILE_SM90_DECODE32 ? mx_tile_sm90_decode32::kBlockT
         : config == MX_TILE_SM90_DECODE48 ? mx_tile_sm90_decode48::kBlockT
         : config == MX_TILE_SM90_MID      ? mx_tile_sm90_mid::kBlockT
         : config == MX_TILE_SM90_PP       ? mx_tile_sm90_pp::kBlockM
         : mx_tile_is_sm90(config)         ? kSm90BlockM
         : config == MX_TILE_LARGE         ? mx_tile_large::kBlockM
         : config == MX_TILE_MID           ? mx_tile_mid::kBlockM
                                           : mx_tile_decode::kBlockM;
}

/* Rule: the expected rows per local expert, pairs / E_local (routing is
 * close to uniform), decides. Under 32 rows 16-row tiles (the layer is
 * weight-bandwidth bound; on an H200, Mixtral at 16 rows/expert: 774 us
 * against 808 us with 64-row tiles); under 96 rows 64x128 tiles (qwen3moe /
 * gptoss at 64 / 32 rows: 542 / 1805 us against 1032 / 2949 us with 16-row
 * and 590 / 2799 us with 128-row tiles); beyond, 128x128 tiles. 128x256 and
 * 256x128 tiles (64x64 warp tiles, 1 CTA/SM) were measured too: within 6%
 * of 128x128 for Mixtral, 10-20% slower for qwen3moe and gptoss at M=16384.
 * (.cudatest figures of 2026-11-22, bf16.) */
static inline int mx_select_tile_config(int64_t pairs, int64_t local_experts)
{
    const int64_t e = local_experts > 0 ? local_experts : 1;
    if (pairs < 32 * e)
        return MX_TILE_DECODE;
    if (pairs < 96 * e)
        return MX_TILE_MID;
    return MX_TILE_LARGE;
}

/* Below kSm90MinRowsPerExpert rows per expert the Hopper path runs the
 * decode kernel (operands swapped: weight rows are wgmma's m). The tile
 * should hold the fullest expert's rows, not the mean: with uniform routing
 * an expert's count spreads about sqrt(mean) around it, so at 16 rows per
 * expert (Mixtral M = 64) many experts took two 16-token tiles and the
 * layer streamed at 3.5 TB/s against 4.2 at M = 32 (c627e2a). So: under 12
 * expected rows per expert 16-token tiles, under 24 32-token tiles, under
 * 36 48-token tiles, else 64-token tiles. (At 8 rows per expert 16-token
 * tiles beat 377dba6's 32-token tiles by 2-12% at all 9 points: Mixtral
 * M = 32, qwen3moe M = 128, gptoss M = 256, every dtype; H200, 16f4b97.)
 * (Before: 16 under 32 rows, else 64: the mma.sync rule's thresholds.) The kernel streams weights at the
 * rate its loads in flight allow (ncu, qwen3moe bf16: 16-token tiles 82% of
 * DRAM peak, 64-token tiles 55%, their stages hold a third activations), so
 * the smallest tile that holds the fullest expert wins: at 32 rows per
 * expert 48-token tiles beat 64-token tiles by 3-12% (Mixtral M = 128,
 * qwen3moe M = 512, gptoss / DeepSeek-V3 M = 1024, every dtype), and
 * 32-token tiles (two tiles for many experts) lost 3-10% (H200,
 * 2026-11-22, 955e9de / 2ba20ab). Against the mma.sync decode / mid tiles it
 * replaced (bf16, H200, full grid fa9c6f5 against a01c967): 0.99-1.15x at
 * M = 8..1024 except Mixtral M = 64 (0.84x, two 16-token tiles per expert,
 * since helped by the grid order of grouped_gemm_sm90_decode.cuh) and M = 1
 * (0.85-0.87x on qwen3moe / gptoss: the extra gather launch). FP8: the
 * mma.sync path had no FP8 tensor cores on Hopper; 1.0-1.2x. Shared by
 * the 16-bit and the FP8 rules. */
static inline int mx_select_sm90_decode_config(int64_t rows, int64_t local_experts)
{
    return rows < 12 * local_experts   ? MX_TILE_SM90_DECODE
         : rows < 24 * local_experts ? MX_TILE_SM90_DECODE32
         : rows < 36 * local_experts ? MX_TILE_SM90_DECODE48
                                     : MX_TILE_SM90_MID;
}

/* Block-scaled FP8 GEMM1 on the decode kernel quantizes act in its epilogue
 * (grouped_gemm_sm90_decode.cuh) on tiles of up to this many tokens; larger
 * tiles leave it to the group quantizer. H100, 2026-11-25, against the
 * quantizer's launch: 16-token tiles 1.02-1.04x (DeepSeek-V3 M = 1 141 ->
 * 135 us), 32-token tiles 1.00-1.01x, 48-token tiles 0.91-0.96x (qwen3moe
 * M = 512 294 -> 323 us; 2 CTAs per SM at 186 registers, 315 us at 3 with
 * spills), so the rows of a 48- or 64-token tile cost more in the epilogue,
 * and in the wait for the cluster partner, than the quantizer's pass. */
constexpr int kSm90DecodeQuantActMaxTokens = 32;

static inline int mx_tile_sm90_decode_quantizes_act(int config)
{
    return mx_tile_is_sm90_decode(config) && mx_tile_block_m(config) <= kSm90DecodeQuantActMaxTokens;
}

/* Split-K of GEMM2 in the Hopper decode kernel: slices while the
 * worst-case grid (m tiles x 128-row n tiles) stays within two CTAs per SM
 * of an H100/H200 (264: one wave), up to 8, each of at least 4 k blocks of
 * 128 bytes. (Until 2026-11-22 the test let the grid pass 264 by one slice:
 * qwen3moe at M = 1 ran 384 CTAs, 1.45 waves.)
 * elem_bytes: 2 (16-bit) or 1 (fp8). Returns the slice count; *split_len
 * gets its length in elements (whole k blocks, so every slice is non-empty
 * and the count is exact). */
static inline int mx_select_sm90_decode_splits(int64_t m_tiles, int64_t hidden, int64_t inter, int elem_bytes,
                                               int64_t *split_len)
{
    const int64_t bk = 128 / elem_bytes;
    const int64_t k_blocks = (inter + bk - 1) / bk;
    const int64_t ctas = m_tiles * ((hidden + 127) / 128);
    int64_t splits = 1;
    while (splits < 8 && ctas * (splits + 1) <= 264 && k_blocks / (splits + 1) >= 4)
        ++splits;
    const int64_t per_split = (k_blocks + splits - 1) / splits;
    *split_len = per_split * bk;
    return static_cast<int>((k_blocks + per_split - 1) / per_split);
}

/* Rule for the Hopper path (taken only where mx_cuda_sm90_gemm_available()):
 * TMA needs 16-byte row strides, so H and I must be multiples of 8. Below
 * kSm90MinRowsPerExpert expected rows per local expert the layer is weight-
 * bandwidth bound and 128-row tiles pad too much (gptoss at 32 rows per
 * expert 1705 us with 64-row tiles against 1992 us, qwen3moe at 64 rows 459
 * against 534 us, Mixtral at 64 rows 792 against 1242 us; stage totals, H200,
 * 2026-11-22): the decode kernel takes them (mx_select_sm90_decode_config);
 * at 64 rows the persistent kernel still wins (decode up to 96 rows, H100,
 * 2026-11-25: qwen3moe M = 1024 559 against 531 us, Mixtral M = 256 1052
 * against 1003). Both ways again at 33ffdaa (bench_moe, three rounds, H100,
 * 2026-11-26, logs/2026-11-26-nvidia-h100-bench-ab-persistent-threshold.txt,
 * 16-bit and FP8 together): the decode kernel at 64 rows +5..+75% (qwen3moe
 * bf16 M = 1024 +5.1%, Mixtral fp8_block M = 256 +75%), the persistent
 * kernel at 32 rows +1.3..+11.6% (Mixtral fp8_block M = 128, qwen3moe
 * fp8_tensor M = 512).
 * From kSm90PairMinRowsPerExpert rows (8 m tiles per expert,
 * so m tile pairs rarely straddle two experts) the cluster config wins in
 * every run: Mixtral M=16384 18.2-18.6 against 18.9-19.1 ms, M=4096 4.4-4.7
 * against 4.8-5.1 ms, qwen3moe M=16384 equal; at 128-256 rows it loses 4-9%;
 * gptoss at 512 rows moved either way between runs. Again on an H100
 * (2026-11-26, logs/2026-11-26-nvidia-h100-bench-ab-bf16-pair-threshold.txt):
 * never pairing +3.0% at Mixtral M = 16384, from 2048 rows within noise.
 * FP8 takes no pairs (gemm_configs_fp8.cuh).
 * Returns an SM90 config, or -1 for the mma.sync rule. */
constexpr int64_t kSm90MinRowsPerExpert = 64;
constexpr int64_t kSm90PairMinRowsPerExpert = 1024;
/* Ping-pong 64-row units (mx_tile_sm90_pp) from min_rows rows per expert
 * (kSm90PingPongMinRowsPerExpert; FP8 from fewer, gemm_configs_fp8.cuh)
 * to under max_rows (16-bit kSm90PingPongMaxRowsPerExpert; FP8
 * kFp8Sm90PingPongMaxRowsPerExpert, gemm_configs_fp8.cuh, which has the
 * measurements), where both GEMMs' K is at most kSm90PingPongMaxK or there
 * are kSm90PingPongLongKMinExperts local experts or more, not for the
 * interleaved GEMM1: its staging boxes do not fit beside that ring, and
 * with its act stored from the fragments instead it lost (gpt-oss bf16
 * M = 1024 +2.5%, fp8_block +2.4%; H100, 2026-11-27,
 * logs/2026-11-27-nvidia-h100-ab-ping-pong-follow-ups.txt).
 * 16-bit against the decode kernel's 48-token tiles (H200, 2026-11-27, two
 * rounds): qwen3moe bf16 M = 512 (32 rows per expert) 351.7 -> 340.3 us
 * (-3.2%); against the 128-row tiles at 64 rows (M = 1024) +1.9% (GEMM1
 * 216 -> 229 us) and Mixtral bf16 M = 256 (K 4096 / 14336) +6.5%; from 16
 * rows qwen3moe bf16 M = 256 +2.5% and gpt-oss M = 512 (its interleaved
 * GEMM1 on units too) +3.0% against the 32-token tiles (H100, same log).
 * Long K lost at Mixtral's 8 experts because its few long units ran in
 * serial rounds (gemm_configs_fp8.cuh); with 256 experts there are
 * thousands of units: DeepSeek-V3 (K 7168 / 2048) at 32 rows per expert
 * (M = 1024), H200, 2026-11-27, two rounds each
 * (logs/2026-11-27-nvidia-h200-ab-ping-pong-long-k-block-scales.txt):
 * fp8_tensor 2913.4 -> 2651.8 us (-9.0%), bf16 5315.0 -> 5305.3 (-0.2%). */
constexpr int64_t kSm90PingPongMinRowsPerExpert = 24;
constexpr int64_t kSm90PingPongMaxRowsPerExpert = 64;
constexpr int64_t kSm90PingPongMaxK = 2048;
constexpr int64_t kSm90PingPongLongKMinExperts = 32;

static inline bool mx_sm90_short_k(int64_t hidden, int64_t inter)
{
    return hidden <= kSm90PingPongMaxK && inter <= kSm90PingPongMaxK;
}

static inline bool mx_sm90_ping_pong(int64_t rows, int64_t e, int64_t min_rows, int64_t max_rows, int64_t hidden,
                                     int64_t inter, int interleaved)
{
    return rows >= min_rows * e && rows < max_rows * e &&
           (mx_sm90_short_k(hidden, inter) || e >= kSm90PingPongLongKMinExperts) && !interleaved;
}

static inline int mx_select_sm90_config(int64_t pairs, int64_t local_experts, int64_t hidden, int64_t inter,
                                        int interleaved)
{
    const int64_t e = local_experts > 0 ? local_experts : 1;
    if (hidden % 8 != 0 || inter % 8 != 0)
        return -1;
    if (mx_sm90_ping_pong(pairs, e, kSm90PingPongMinRowsPerExpert, kSm90PingPongMaxRowsPerExpert, hidden, inter,
                          interleaved))
        return MX_TILE_SM90_PP;
    if (pairs < kSm90MinRowsPerExpert * e)
        return mx_select_sm90_decode_config(pairs, e);
    return pairs >= kSm90PairMinRowsPerExpert * e ? MX_TILE_SM90_PAIR : MX_TILE_SM90;
}

/* The persistent kernel on single CTAs takes its units from a counter
 * (sm90_units.cuh) below kSm90DealMaxRowsPerExpert rows per local expert
 * (fewer than two 128-row m tiles on average), round robin from there.
 * Dealing every such GEMM against round robin, forwards, H100, 2026-11-28,
 * two calls of two rounds (logs/2026-11-28-nvidia-h100-ab-dealt-units.txt):
 * at ~128 rows per expert -7..-16% (gpt-oss bf16 M = 4096 -14%,
 * DeepSeek-V3 fp8_block M = 1024 -16%, Mixtral bf16 M = 512 -8%), on
 * ping-pong units -5..-10% (qwen3moe FP8 M = 1024); at 256 rows
 * +0.3..+3.4% (qwen3moe M = 4096, Mixtral M = 1024); at 512 and more
 * 0..+4.6% per tensor and 16-bit (gpt-oss bf16, DeepSeek-V3 fp8_tensor
 * M = 16384), -4..-7% with block scales. With this rule, one round over
 * M = 1024 / 4096 / 16384: 0.979 of round robin's time (geometric mean of
 * 33 forwards). With 128x128 block scales and at least
 * kSm90DealBlockMinExperts local experts, the units are dealt below
 * kSm90DealBlockMaxRowsPerExpert instead. Against the rule above, fp8_block
 * forwards at M = 1024 / 2048 / 4096 / 16384, three rounds (H100,
 * 2026-11-28, logs/2026-11-28-nvidia-h100-ab-block-dealt.txt): DeepSeek-V3
 * and gpt-oss M = 16384 (512 rows per expert) -8.7 / -10.3%, qwen3moe
 * M = 4096 (256 rows) -0.2%; but Mixtral (8 experts) at 512 rows
 * (M = 2048) +2.6%, and dealing at any row count put Mixtral
 * M = 1024..16384 at +1.4..+3.8% while qwen3moe M = 16384 (1024 rows) gained
 * 1.1%. 32 experts sits between the 8 measured to lose and the 128 and 256
 * measured to gain. */
constexpr int64_t kSm90DealMaxRowsPerExpert = 2 * kSm90BlockM;
constexpr int64_t kSm90DealBlockMaxRowsPerExpert = 8 * kSm90BlockM;
constexpr int64_t kSm90DealBlockMinExperts = 32;

static inline bool mx_sm90_deals_units(int64_t pairs, int64_t local_experts, bool block_scales)
{
    const int64_t e = local_experts > 0 ? local_experts : 1;
    const int64_t max_rows = block_scales && e >= kSm90DealBlockMinExperts ? kSm90DealBlockMaxRowsPerExpert
                                                                          : kSm90DealMaxRowsPerExpert;
    return pairs < max_rows * e;
}

/* The GEMMs' units_taken (mx_gemm_args): the counter moe_align zeroed after
 * the tile count (num_tiles[1]) where the rule deals, else NULL. */
static inline int32_t *mx_sm90_units_counter(int32_t *num_tiles, int64_t pairs, int64_t local_experts,
                                             bool block_scales)
{
    return mx_sm90_deals_units(pairs, local_experts, block_scales) ? num_tiles + 1 : nullptr;
}

/* Split-K of GEMM2 (the down projection): with few experts (Mixtral: 2 at
 * M = 1) the decode grids have too few CTAs to keep enough loads in
 * flight, so K is cut into slices, each CTA of a slice writing its own
 * float32 partial (summed later by moe_sum). mma.sync decode config: add
 * slices while the worst-case grid has under 200 CTAs, up to 4, each at
 * least 8 k tiles. Returns the slice count; *split_len gets the slice
 * length (a multiple of 64, so every slice is non-empty). The persistent
 * Hopper configs return the most slices their kernel may pick
 * (mx_sm90_down_max_splits; *split_len = inter, unused). */
static inline int mx_select_down_splits(int config, int64_t m_tiles, int64_t hidden, int64_t inter,
                                        int64_t *split_len)
{
    if (config == MX_TILE_SM90_DECODE || config == MX_TILE_SM90_DECODE32)
        return mx_select_sm90_decode_splits(m_tiles, hidden, inter, 2, split_len);
    if (mx_tile_is_sm90_persistent(config)) {
        *split_len = inter;
        return mx_tile_sm90_takes_slices(config) ? mx_sm90_down_max_splits(m_tiles, hidden, (inter + 63) / 64) : 1;
    }
    const int64_t k_tiles = (inter + 63) / 64;
    int64_t splits = 1;
    if (config == MX_TILE_DECODE) {
        const int64_t ctas = m_tiles * ((hidden + mx_tile_decode::kBlockN - 1) / mx_tile_decode::kBlockN);
        while (splits < 4 && ctas * splits < 200 && k_tiles / (splits + 1) >= 8)
            ++splits;
    }
    const int64_t tiles_per_split = (k_tiles + splits - 1) / splits;
    *split_len = tiles_per_split * 64;
    return static_cast<int>((k_tiles + tiles_per_split - 1) / tiles_per_split);
}

#endif /* MOE_EXT_CUDA_GEMM_CONFIGS_CUH */
