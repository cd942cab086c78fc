/* Tile configurations of the FP8 grouped GEMMs and the rules that pick one:
 * the mma.sync kernel (grouped_gemm_fp8.cuh; sm_80 .. sm_90, on Hopper only
 * where TMA cannot take the operands), and on Hopper the wgmma kernels,
 * whose tile shapes live in gemm_configs.cuh with the 16-bit ones. Every
 * compiled config is listed here or there with its reason.
 *
 * kBlockK is 128 for all: one 128-byte row of float8 elements per tile row
 * (eight 16-byte chunks, XOR-swizzled by row % 8 exactly like the 16-bit
 * kernels' 64-element rows), and one 128-wide K block of the block scales,
 * so each k tile is one scale-promotion step. block_m is also the segment
 * padding of moe_align: GEMM1 and GEMM2 of a forward use one config. */
#ifndef MOE_EXT_CUDA_GEMM_CONFIGS_FP8_CUH
#define MOE_EXT_CUDA_GEMM_CONFIGS_FP8_CUH

#include <stddef.h>
#include <stdint.h>

#include "gemm_configs.cuh"

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int MIN_BLOCKS_TENSOR, int MIN_BLOCKS_BLOCK,
          int M_ON_X>
struct mx_fp8_tile_shape {
    static constexpr int kBlockM = BM;        /* rows (sorted pairs) per CTA */
    static constexpr int kBlockN = BN;        /* weight rows per CTA (gate + up halves for gated GEMM1) */
    static constexpr int kBlockK = 128;       /* bytes = elements; one scale block of K */
    static constexpr int kWarpsM = WARPS_M;
    static constexpr int kWarpsN = WARPS_N;
    static constexpr int kThreads = WARPS_M * WARPS_N * 32;
    static constexpr int kStages = STAGES;    /* cp.async pipeline depth */
    /* CTAs per SM we ask registers for: the block-scale kernels hold a second
     * accumulator set (the current k slice), so they may need more registers */
    static constexpr int kMinBlocksTensor = MIN_BLOCKS_TENSOR;
    static constexpr int kMinBlocksBlock = MIN_BLOCKS_BLOCK;
    static constexpr int kMOnX = M_ON_X;      /* 1: m tiles on grid x */
    static constexpr int kLdc = BN + 8;       /* float32 epilogue tile row (+8: conflict-free float2 stores) */
    static constexpr size_t kPipeBytes = size_t(STAGES) * (BM + BN) * 128;
    static constexpr size_t kScaleBytes = size_t(STAGES) * (BM + BN) * 4; /* block scales of each stage */
    static constexpr size_t kEpilogueBytes = size_t(BM) * kLdc * 4;
    static constexpr size_t kSmemBytes =
        kPipeBytes + kScaleBytes > kEpilogueBytes ? kPipeBytes + kScaleBytes : kEpilogueBytes;

    static_assert(BM % (16 * WARPS_M) == 0, "each warp covers whole 16-row mma fragments");
    static_assert(BN % (16 * WARPS_N) == 0, "each warp covers pairs of 8-column fragments (ldmatrix.x4)");
    static_assert((BM * 8) % kThreads == 0 && (BN * 8) % kThreads == 0,
                  "every thread loads the same number of 16-byte chunks per stage");
    static_assert(BN % 8 == 0, "gated tiles hold BN/2 gate and BN/2 up rows, in whole column quads");
    static_assert(kSmemBytes <= 227 * 1024, "fits the sm_90 shared-memory opt-in limit");
};

/* decode: few rows per expert; the layer streams weights. 16-row tiles
 * waste little on padding, 128-row weight slices of 16 KB per stage give
 * many CTAs; 3 stages x 3 CTAs keep ~100 KB of weights in flight per SM.
 * m tiles on grid x. 57 KB of shared memory. Measured against it (H200,
 * .cudatest/fp8_test stage breakdown, 2026-11-22): 16x128 with 5 stages at
 * 2 CTAs/SM streams GEMM1 faster when the grid is small (M = 1: Mixtral
 * 66 vs 87 us, 3.5 vs 2.7 TB/s; DeepSeek GEMM2 40 vs 51 us) but is 13-16%
 * slower at M = 64; 16x64 tiles are within +-10% either way. A rule for a
 * second decode config (e.g. pairs <= E_local) is the open next step. */
typedef mx_fp8_tile_shape<16, 128, 1, 4, 3, 3, 3, 1> mx_fp8_tile_decode;
/* mid: tens of rows per expert: 64x128 tiles, 4 warps of 32x64, 4 stages,
 * 101 KB, 2 CTAs/SM. Also the only config compiled for weights whose rows
 * do not allow 16-byte loads (K % 16 != 0). */
typedef mx_fp8_tile_shape<64, 128, 2, 2, 4, 2, 2, 0> mx_fp8_tile_mid;
/* large: hundreds of rows per expert: 128x128 tiles, 8 warps of 64x32,
 * 3 stages, 101 KB, 2 CTAs/SM with per-tensor scales (one accumulator set)
 * and 1 CTA/SM with block scales (two sets do not fit 128 registers).
 * Measured against it (H200, M = 16384): 128x256 and 256x128 tiles (64x64
 * warp tiles, 1 CTA/SM) within 2% on Mixtral and 20% slower on Qwen3-MoE
 * (TENSOR); 4 stages at 1 CTA/SM 11-32% slower with per-tensor scales and
 * 2-3% faster with block scales; with block scales mid (64x128) is 6%
 * faster on DeepSeek-V3 and equal on Mixtral. The mma.sync
 * path tops out near 400 TFLOP/s here (f16 HMMA + conversions, see
 * grouped_gemm_fp8.cuh); Hopper's FP8 rate needs wgmma. */
typedef mx_fp8_tile_shape<128, 128, 2, 4, 3, 2, 1, 0> mx_fp8_tile_large;

enum mx_fp8_tile_config {
    MX_FP8_TILE_DECODE = 0,
    MX_FP8_TILE_MID = 1,
    MX_FP8_TILE_LARGE = 2,
    /* Hopper wgmma (grouped_gemm_fp8_sm90.cu, tiles of gemm_configs.cuh):
     * per-tensor scales on mx_tile_sm90, block scales on mx_tile_sm90 or
     * mx_tile_sm90_n128 (mx_fp8_sm90_block_wide); 128-row m tiles */
    MX_FP8_TILE_SM90 = 3,
    /* Hopper decode kernel (grouped_gemm_sm90_decode.cuh), the 16-bit
     * configs of the same number: 16- / 32- / 48- / 64-token tiles */
    MX_FP8_TILE_SM90_DECODE = MX_TILE_SM90_DECODE,
    MX_FP8_TILE_SM90_MID = MX_TILE_SM90_MID,
    MX_FP8_TILE_SM90_DECODE32 = MX_TILE_SM90_DECODE32,
    MX_FP8_TILE_SM90_DECODE48 = MX_TILE_SM90_DECODE48,
    /* Hopper persistent kernel, ping-pong 64-row units (mx_tile_sm90_pp), either scales */
    MX_FP8_TILE_SM90_PP = MX_TILE_SM90_PP,
};

static inline int mx_fp8_tile_is_sm90_persistent(int config)
{
    return config == MX_FP8_TILE_SM90 || config == MX_FP8_TILE_SM90_PP;
}

/* The FP8 configs whose GEMM2 may run in k slices: the per-tensor 128-row
 * tiles (not block scales, not the ping-pong units). */
static inline int mx_fp8_sm90_takes_slices(int config, int quant)
{
    return config == MX_FP8_TILE_SM90 && quant != MX_QUANT_FP8_BLOCK;
}

static inline int mx_fp8_tile_is_sm90(int config)
{
    return mx_fp8_tile_is_sm90_persistent(config) || mx_tile_is_sm90_decode(config);
}

static inline int mx_fp8_tile_block_m(int config)
{
    return mx_tile_is_sm90_decode(config) || config == MX_FP8_TILE_SM90_PP ? mx_tile_block_m(config)
         : mx_fp8_tile_is_sm90(config)       ? kSm90BlockM
         : config == MX_FP8_TILE_LARGE ? mx_fp8_tile_large::kBlockM
         : config == MX_FP8_TILE_MID   ? mx_fp8_tile_mid::kBlockM
                                       : mx_fp8_tile_decode::kBlockM;
}

/* Rule: the expected rows per local expert, rows / E_local (routing close
 * to uniform), decides, with the thresholds of the 16-bit kernels (under
 * 32 rows: decode; under 96: mid; beyond: large). Weights that need the
 * byte-wise loader (aligned_w == 0) always get mid, the one config compiled
 * for them. The thresholds are the 16-bit kernels'; on H200 they picked the
 * fastest of decode / mid / large at every measured point (Qwen3-MoE and
 * DeepSeek-V3 at M = 1024: mid, 6-89% ahead of the others) except
 * DeepSeek-V3 with block scales at M = 16384 (mid 6% ahead of large). */
static inline int mx_fp8_select_tile_config(int64_t rows, int64_t local_experts, int aligned_w)
{
    const int64_t e = local_experts > 0 ? local_experts : 1;
    if (!aligned_w)
        return MX_FP8_TILE_MID;
    if (rows < 32 * e)
        return MX_FP8_TILE_DECODE;
    if (rows < 96 * e)
        return MX_FP8_TILE_MID;
    return MX_FP8_TILE_LARGE;
}

/* Rule for the Hopper path (the caller checked mx_cuda_sm90_gemm_available()
 * and a bfloat16 / float16 act dtype): the FP8 wgmma kernels run at
 * Hopper's FP8 rate, which the mma.sync configs cannot reach (they feed f16
 * HMMAs there). TMA needs 16-byte rows (H, I multiples of 16); with block
 * scales each 64-row weight box of the gated GEMM1 must lie in one 128-row
 * scale block (I a multiple of 64). Below kFp8Sm90MinRowsPerExpert rows per
 * expert the decode kernel (operands swapped, 16-, 32-, 48- or 64-token tiles,
 * mx_select_sm90_decode_config), from there the persistent kernel on
 * single CTAs. At 64 rows per expert the persistent kernel beat the decode
 * kernel's 64-token tiles (threshold 96 instead of 64, H100, 2026-11-25):
 * qwen3moe M = 1024 fp8_tensor 371 against 376 us, fp8_block 369 against
 * 469; Mixtral M = 256 573 against 606, 582 against 865. Re-measured with
 * the 16-bit rule at 33ffdaa (gemm_configs.cuh kSm90MinRowsPerExpert): 64
 * stays. FP8 takes no CTA pairs (the 16-bit path does from 1024 rows per
 * expert): pairs from 1024 / 2048 rows per expert against none, H100,
 * 2026-11-26 (logs/2026-11-26-nvidia-h100-bench-ab-fp8-pair-threshold.txt,
 * logs/2026-11-26-nvidia-h100-bench-ab-fp8-no-pairs.txt): Mixtral M = 4096
 * +4.0 / -0.4%, M = 16384 +4.8 / +4.8%, qwen3moe M = 16384 +1.9 / -0.2%,
 * DeepSeek-V3 within 0.5%; from 512 rows slower still. With block scales on
 * the 128x256 tiles (mx_fp8_sm90_block_wide) the persistent kernel from 32
 * rows per expert instead: DeepSeek-V3 M = 1024 +3.6%, gpt-oss +7.2%,
 * qwen3moe M = 512 +2.6%, Mixtral M = 128 -1.0% (H100, 2026-11-26,
 * logs/2026-11-26-nvidia-h100-bench-ab-block-wide-tiles.txt, call 105), so
 * 64 stays for both.
 * Returns an SM90 config or -1. */
constexpr int64_t kFp8Sm90MinRowsPerExpert = 64;
/* From kSm90PingPongMinRowsPerExpert rows per expert (24; from
 * kFp8Sm90PingPongMinRowsPerExpert with block scales or past short K) to
 * under kFp8Sm90PingPongMaxRowsPerExpert, with both GEMMs' K at most
 * kSm90PingPongMaxK or many experts (mx_sm90_ping_pong), the persistent
 * kernel runs ping-pong 64-row units (mx_tile_sm90_pp); with block scales
 * each k block of a weight box is promoted as on the 128x256 tiles, and the
 * gated GEMM1 needs I % 128 == 0 (its 128-row up box in one scale block).
 * Per tensor against the 128-row tiles (H200, 2026-11-27, two rounds each,
 * forwards): qwen3moe fp8_tensor M = 1024 (64 rows per expert; K 2048 /
 * 768) 269.5 -> 250.9 and 267.2 -> 245.0 us (-7 / -8%; GEMM1 131 -> 121,
 * GEMM2 85 -> 78), where the 128-row tiles are half padding and a unit of
 * 16 / 6 k blocks leaves the ring idle behind its epilogue; at 256 rows
 * (M = 4096) -2.0% (the 128-row tiles' own runs moved 1.1% between builds
 * of one binary) and at 1024 rows +5.4%, so the 128-row tiles keep those.
 * Against the decode kernel's 48-token tiles at 32 rows per expert
 * (M = 512): 217.1 -> 205.2 us (-5.5%); at 16 rows (M = 256) +1.6%, so per
 * tensor with short K starts at 24. Where K is long with few experts it
 * lost: Mixtral fp8_tensor M = 256 (K 4096 / 14336) +1.0% (GEMM2 128 ->
 * 151 us: 192 units of 112 k blocks on 132 SMs run two serial rounds where
 * 128 ran one). An expert of 65-127 rows takes two units, each loading the
 * weight tile (the second from L2 when both run together); the 16-bit
 * forms lost at 64 rows (gemm_configs.cuh), so only FP8 goes past 63.
 * Block scales and many experts with long K, H200, 2026-11-27, two rounds
 * each (logs/2026-11-27-nvidia-h200-ab-ping-pong-long-k-block-scales.txt):
 * DeepSeek-V3 (K 7168 / 2048) fp8_block M = 1024 (32 rows per expert)
 * 3327.4 -> 2725.5 us (-18.1%) and fp8_tensor 2913.4 -> 2651.8 (-9.0%)
 * against the decode kernel's 48-token tiles; at 16 rows (M = 512)
 * fp8_block 2563.2 -> 2293.5 (-10.5%), fp8_tensor 2361.3 -> 2231.1 (-5.5%);
 * qwen3moe fp8_block M = 256 / 512 (16 / 32 rows) -4.2 / -7.4%, M = 1024
 * (64 rows, against the 128x256 tiles) -2.7%. With block scales up to 255
 * rows DeepSeek-V3 M = 4096 (128 rows) lost 10.6%, so 128 bounds both. */
constexpr int64_t kFp8Sm90PingPongMinRowsPerExpert = 16;
constexpr int64_t kFp8Sm90PingPongMaxRowsPerExpert = 128;

/* Block scales on a 256-wide GEMM1 tile or unit: each 128-row weight box
 * lies in one 128-row scale block, which only the gated kind's up box can
 * miss (I % 128 != 0). */
static inline bool mx_fp8_sm90_block_wide_gemm1(bool gated, int64_t out_cols)
{
    return !gated || out_cols % 128 == 0;
}

static inline int mx_fp8_select_sm90_config(int64_t rows, int64_t local_experts, int64_t hidden, int64_t inter,
                                            int block_scales, int gated, int interleaved)
{
    const int64_t e = local_experts > 0 ? local_experts : 1;
    if (hidden % 16 != 0 || inter % 16 != 0 || (block_scales && gated && inter % 64 != 0))
        return -1;
    const int64_t min_rows = block_scales || !mx_sm90_short_k(hidden, inter) ? kFp8Sm90PingPongMinRowsPerExpert
                                                                             : kSm90PingPongMinRowsPerExpert;
    if ((!block_scales || mx_fp8_sm90_block_wide_gemm1(gated, inter)) &&
        mx_sm90_ping_pong(rows, e, min_rows, kFp8Sm90PingPongMaxRowsPerExpert, hidden, inter, interleaved))
        return MX_FP8_TILE_SM90_PP;
    if (rows < kFp8Sm90MinRowsPerExpert * e)
        return mx_select_sm90_decode_config(rows, e);
    return MX_FP8_TILE_SM90;
}

/* Where the persistent kernel's FP8 GEMM1 takes its A rows: below
 * kFp8Sm90SortedRowsMinRowsPerExpert rows per local expert by token
 * (x_q [M, H] as the quantizer writes it for the decode kernel, copied by
 * the producer warpgroup with cp.async, as the 16-bit GEMM1 copies x), from
 * there by sorted row (the quantizer writes each token's row to its pairs'
 * sorted rows, loaded by TMA). Below 128 rows an expert's rows fill one m
 * tile, about half of whose rows are padding: the sorted rows are twice the
 * bytes written and read, while the by-token rows (M H bytes) stay in L2.
 * Against sorted rows everywhere, two rounds (H100, 2026-11-27,
 * logs/2026-11-27-nvidia-h100-ab-fp8-gemm1-rows-by-token.txt): qwen3moe
 * fp8_tensor / fp8_block M = 1024 (64 rows per expert) -4.7 / -5.1%,
 * Mixtral M = 256 (64) -1.3 / -1.0%; at 128 rows DeepSeek-V3 M = 4096
 * +0.8 / -1.5%; from 256 rows slower where the tensor cores bound the
 * GEMM (Mixtral M = 1024 / 4096 / 16384 +3.5 / +7.9 / +10.0% per tensor,
 * DeepSeek-V3 M = 16384 +6.3%: the copies cannot feed the FP8 rate), only
 * qwen3moe fp8_tensor M = 4096 faster (-1.7%). */
constexpr int64_t kFp8Sm90SortedRowsMinRowsPerExpert = 128;

static inline bool mx_fp8_sm90_gemm1_a_by_token(int64_t pairs, int64_t local_experts)
{
    return pairs < kFp8Sm90SortedRowsMinRowsPerExpert * (local_experts > 0 ? local_experts : 1);
}

/* Block scales on the persistent kernel: the 128x256 tiles (mx_tile_sm90,
 * 128-row weight boxes, each k block promoted per box) or the 128x128
 * tiles (mx_tile_sm90_n128, 64-row boxes, two product sets of the whole
 * tile alternating). A box must lie in one 128-row scale block, so the
 * gated GEMM1 (MX_GEMM_GATE_UP) with I % 128 != 0 keeps 128x128; GEMM2
 * (down) takes 128x256 from kFp8Sm90BlockWideDownRowsPerExpert rows per
 * expert. H100, 2026-11-26 (logs/2026-11-26-nvidia-h100-bench-ab-block-wide-tiles.txt):
 * per GEMM (profiles) GEMM1 on 128x256 -13..-20% at qwen3moe / DeepSeek-V3
 * M = 16384, -5..-16% elsewhere from 128 rows per expert, flat at 64;
 * GEMM2 on 128x256 -10% at 512 rows per expert (gpt-oss M = 16384), ahead
 * at Mixtral's 1024 and 4096 (forwards 4% faster than with GEMM2 on
 * 128x128), but +8% at 128 rows (gpt-oss, DeepSeek-V3 M = 4096) and +9% at
 * 64 (qwen3moe M = 1024). This rule against 128x128 everywhere, forwards,
 * three rounds: DeepSeek-V3 M = 4096 / 16384 -5.5 / -8.7%, Mixtral M = 1024
 * / 4096 / 16384 -6.2 / -10.2 / -12.3%, qwen3moe M = 4096 / 16384 -3.7 /
 * -4.9%, gpt-oss -2.8 / -1.5%, qwen3moe M = 1024 +0.8%. */
constexpr int64_t kFp8Sm90BlockWideDownRowsPerExpert = 512;
static inline bool mx_fp8_sm90_block_wide(bool gated, bool down, int64_t out_cols, int64_t pairs,
                                          int64_t local_experts)
{
    if (down)
        return pairs >= kFp8Sm90BlockWideDownRowsPerExpert * (local_experts > 0 ? local_experts : 1);
    return mx_fp8_sm90_block_wide_gemm1(gated, out_cols);
}

/* Where the persistent kernel's GEMM2 with block scales puts y: on the
 * 128-row tiles (not the ping-pong units, which have no room for the
 * boxes: grouped_gemm_sm90_epilogue.cuh sm90_down_boxes) by sorted row,
 * y [rows_max, H], each math warp's 16 rows x 32 columns leaving by one
 * TMA store from shared memory while the warp goes on (moe_sum finds a
 * pair's row through moe_align's pair_rows), where its K (I) is at most
 * kFp8Sm90DownBoxesMaxK; else by pair, y [M k, H], stored from the fragments.
 * H100, 2026-11-26 (logs/2026-11-26-nvidia-h100-bench-ab-y-by-sorted-row.txt,
 * three rounds): qwen3moe fp8_block (I = 768) -3.7% at M = 4096 and 16384,
 * DeepSeek-V3 (2048) -1.1% at 16384, gpt-oss (2880) -1.7% at 16384;
 * Mixtral (14336) +2.6 / +4.6% (its long mainloop keeps little epilogue
 * to hide, and the 32 KB of boxes come out of the L1 the promotion reads
 * its scales from). The 16-bit and per-tensor GEMM2s, whose warp-staged
 * stores already write whole lines, gained nothing that way (within 0.5%,
 * gpt-oss M = 4096 +2..+4%), so they keep y by pair. */
constexpr int64_t kFp8Sm90DownBoxesMaxK = 4096;
static inline bool mx_fp8_sm90_down_by_sorted_row(int config, int quant, int64_t k)
{
    return config == MX_FP8_TILE_SM90 && quant == MX_QUANT_FP8_BLOCK && k <= kFp8Sm90DownBoxesMaxK;
}

/* Whether the block-scale GEMM1 of `config` quantizes act in its epilogue
 * (no act group quantizer launch): the Hopper decode kernel's small tiles
 * (mx_tile_sm90_decode_quantizes_act) and the persistent kernel's gated
 * 256-wide tiles and ping-pong units (grouped_gemm_sm90_epilogue.cuh
 * sm90_quantizes_act), whose 128 act columns per row are one 128-column
 * group. */
static inline bool mx_fp8_sm90_block_gemm1_quantizes_act(int config, bool gated, int64_t inter)
{
    if (mx_tile_is_sm90_decode(config))
        return mx_tile_sm90_decode_quantizes_act(config);
    return mx_fp8_tile_is_sm90_persistent(config) && gated && mx_fp8_sm90_block_wide_gemm1(true, inter);
}

/* Split-K of GEMM2: with few experts the decode grids have too few CTAs
 * to stream the weights (Mixtral at M = 1: 2 experts x 32 n tiles), so K is
 * cut into slices whose float32 partials moe_sum adds. mma.sync decode
 * config: add slices while the worst-case grid has under 256 CTAs, up to 8,
 * each of at least 3 k tiles (384 columns). Returns the slice count;
 * *split_len gets the slice length (a multiple of 128: whole scale blocks).
 * The persistent Hopper config returns the most slices its kernel may pick
 * (gemm_configs.cuh mx_sm90_down_max_splits: per tensor only; *split_len =
 * inter, unused). */
static inline int mx_fp8_select_down_splits(int config, int64_t m_tiles, int64_t hidden, int64_t inter,
                                            int quant, int64_t *split_len)
{
    if (config == MX_FP8_TILE_SM90_DECODE || config == MX_FP8_TILE_SM90_DECODE32)
        return mx_select_sm90_decode_splits(m_tiles, hidden, inter, 1, split_len);
    if (mx_fp8_tile_is_sm90_persistent(config)) {
        *split_len = inter;
        return mx_fp8_sm90_takes_slices(config, quant) ? mx_sm90_down_max_splits(m_tiles, hidden, (inter + 127) / 128)
                                                       : 1;
    }
    const int64_t k_tiles = (inter + 127) / 128;
    int64_t splits = 1;
    if (config == MX_FP8_TILE_DECODE) {
        const int64_t ctas = m_tiles * ((hidden + mx_fp8_tile_decode::kBlockN - 1) / mx_fp8_tile_decode::kBlockN);
        while (splits < 8 && ctas * splits < 256 && k_tiles / (splits + 1) >= 3)
            ++splits;
    }
    const int64_t tiles_per_split = (k_tiles + splits - 1) / splits;
    *split_len = tiles_per_split * 128;
    return static_cast<int>((k_tiles + tiles_per_split - 1) / tiles_per_split);
}

#endif /* MOE_EXT_CUDA_GEMM_CONFIGS_FP8_CUH */
