/* The epilogue of the Hopper persistent grouped GEMM
 * (grouped_gemm_sm90_impl.cuh): what a math warpgroup's threads store from
 * their wgmma accumulators once a tile's k loop has ended, and the shared
 * memory that takes (the staging rules the kernel and its launcher size
 * their shared memory by).
 * wgmma's accumulator layout gives each thread rows r, r+8 and column pairs
 * (8i + 2q, +1); GEMM1 adds w13_bias, applies the activation and stores act
 * dtype pairs (the interleaved kind first swaps values with the
 * neighbouring lane to form pairs); GEMM2 adds w2_bias, multiplies by the
 * routing weight and stores float32 y[pair]; both through shared memory or
 * from the fragments (sm90_warp_staged, sm90_staged_out say which), or,
 * GEMM2 with block scales and g.y_by_sorted_row, y by sorted row through TMA
 * boxes (sm90_store_down_boxes). Padding rows (sorted id -1), columns past
 * out_cols and the phantom tile of an odd tile count are not stored (the
 * boxes: only their warps of 16 padding rows). */
#ifndef MOE_EXT_CUDA_GROUPED_GEMM_SM90_EPILOGUE_CUH
#define MOE_EXT_CUDA_GROUPED_GEMM_SM90_EPILOGUE_CUH

#include "gemm_configs.cuh"
#include "grouped_gemm_sm90.cuh"
#include "sm90_common.cuh"

namespace {

/* Accumulator fragment of one thread (wgmma m64nN, f32): acc[4i + e] is row
 * r_lo + 8 * (e / 2), column 8i + 2q + (e % 2), q = lane % 4. */
/* What the epilogue needs of the thread's two rows. */
struct sm90_rows {
    int64_t s_lo;           /* sorted row of the thread's first row; the second is s_lo + 8 */
    int32_t pair_lo, pair_hi; /* pair index, -1 = padding */
    float w_lo, w_hi;       /* GEMM2 routing weights (1 when not scaling) */
};

/* The bias pairs (bias[c], bias[c + 1]) of a thread's N epilogue columns c = first + i * step
 * (c even), packed as mx_pack2 packs; zero past `limit` or without a bias. All are loaded before
 * the epilogue's first store: the compiler cannot tell the bias from the output, so a load
 * inside the store loop would wait for every store before it (gpt-oss GEMM1 at M = 16384: 4510
 * -> 4134 us with the loads first; H100, 2026-11-25). One 4-byte load per pair, or two 2-byte
 * loads where the bias view starts at an odd element. */
template <typename T, int N>
__device__ __forceinline__ void sm90_load_bias_pairs(const T *bias, int64_t first, int step, int64_t limit,
                                                     uint32_t (&pairs)[N])
{
    const bool words = (reinterpret_cast<uintptr_t>(bias) & 3u) == 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int64_t c = first + static_cast<int64_t>(i) * step;
        const uint16_t *half = reinterpret_cast<const uint16_t *>(bias + c);
        pairs[i] = !bias || c >= limit ? 0u
                   : words             ? *reinterpret_cast<const uint32_t *>(half)
                                       : half[0] | static_cast<uint32_t>(half[1]) << 16;
    }
}

/* The expert's bias row (null without a bias). */
template <typename T> __device__ __forceinline__ const T *sm90_expert_bias(const mx_gemm_args &g, int expert)
{
    return g.bias ? static_cast<const T *>(g.bias) + static_cast<int64_t>(expert) * g.n_rows : nullptr;
}

/* GEMM2's y slice `split` (split-K: gemm_configs.cuh mx_sm90_down_split)
 * and the bias row that slice adds: the expert's on slice 0, else none. */
__device__ __forceinline__ float *sm90_down_y(const mx_gemm_args &g, int split)
{
    return static_cast<float *>(g.out) + split * g.out_split_stride;
}
template <typename T> __device__ __forceinline__ const T *sm90_down_bias(const mx_gemm_args &g, int expert, int split)
{
    return split == 0 ? sm90_expert_bias<T>(g, expert) : nullptr;
}

/* GEMM2: y[pair, col] = (acc * sc + w2_bias[col]) * routing weight, float32
 * (sc: the per-tensor FP8 scales, else 1), into y's slice `split` (the bias
 * on slice 0 only: sm90_down_bias), stored from the fragments (the
 * block-scale kernels: sm90_warp_staged). Stores are 16 bytes: lanes q and
 * q ^ 1 swap a pair, so that the even lane holds 4 columns of row lo and the
 * odd lane the same 4 of row hi (out_cols is a multiple of 8: the launcher's
 * TMA rule for n_rows, so a quad's 8 columns are all in or all out). Half
 * the store instructions of 8-byte stores: qwen3moe fp8_tensor GEMM2 at
 * M = 4096 227 -> 221 us, bf16 1-3% (H100, logs/2026-11-25-nvidia-h100-ab-unit-ahead.txt). */
template <typename T, typename Shape>
__device__ __forceinline__ void sm90_store_down_direct(const float (&acc)[Shape::kBlockN / 2], const sm90_rows &rows, int q,
                                                       int nt, int expert, int split, const mx_gemm_args &g, float sc)
{
    constexpr int BN = Shape::kBlockN;
    const T *bias = sm90_down_bias<T>(g, expert, split);
    const bool even = (q & 1) == 0;
    const int32_t pair = even ? rows.pair_lo : rows.pair_hi;
    float *y_row = sm90_down_y(g, split) + static_cast<int64_t>(pair) * g.ldo;
    /* column group i: the quad's columns tile_col + 8i + [0, 8); the thread's
     * pair at + 2q, its 16-byte store at + 2 (q & ~1) */
    const int64_t tile_col = static_cast<int64_t>(nt) * BN;
    /* bias pairs by chunks of 8 columns: all BN / 8 at once would spill (128 accumulators live) */
    constexpr int CHUNK = 8;
    uint32_t bias_pairs[CHUNK];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
        if (i % CHUNK == 0)
            sm90_load_bias_pairs(bias, tile_col + 2 * q + 8 * i, 8, g.out_cols, bias_pairs);
        if (tile_col + 8 * i >= g.out_cols) /* the same for the whole warp */
            continue;
        const float2 b = mx_unpack2<T>(bias_pairs[i % CHUNK]);
        const float2 lo = make_float2((acc[4 * i] * sc + b.x) * rows.w_lo, (acc[4 * i + 1] * sc + b.y) * rows.w_lo);
        const float2 hi = make_float2((acc[4 * i + 2] * sc + b.x) * rows.w_hi, (acc[4 * i + 3] * sc + b.y) * rows.w_hi);
        const float2 give = even ? hi : lo;
        const float2 got = make_float2(__shfl_xor_sync(0xffffffffu, give.x, 1), __shfl_xor_sync(0xffffffffu, give.y, 1));
        if (pair >= 0)
            *reinterpret_cast<float4 *>(y_row + tile_col + 8 * i + 2 * (q & ~1)) =
                even ? make_float4(lo.x, lo.y, got.x, got.y) : make_float4(got.x, got.y, hi.x, hi.y);
    }
}

/* The pair (-1: padding) of row lane / 8 + 4 j of the warp's 16, the rows
 * whose whole-line stores lane makes in sm90_store_down_staged and
 * sm90_store_act: lane 4 (row % 8) holds it, as its row lo for j < 2. */
__device__ __forceinline__ int32_t sm90_line_row_pair(const sm90_rows &rows, int lane, int j)
{
    const int row = lane / 8 + 4 * j;
    return __shfl_sync(0xffffffffu, j < 2 ? rows.pair_lo : rows.pair_hi, 4 * (row % 8));
}

/* sm90_store_down_direct's y through the warp's shared memory (`stage`):
 * 16 rows x 32 columns at a time, each thread puts its pairs of rows lo and
 * hi there, then lane l stores the 16 bytes l % 8 of row l / 8 + 4 j, so one
 * store instruction writes whole 128-byte lines of four rows (the fragments
 * themselves give 16 rows x 32 bytes per instruction). The 16-byte units of
 * a row are XOR-swizzled by 2 (row % 4), so that neither the 8-byte writes
 * (rows r..r+3 of a half warp) nor the 16-byte reads conflict. Each 16-byte
 * store is all in or all out (out_cols is a multiple of 8). The tile's bias
 * row is loaded once, 8 columns per lane, into the stage's last BN x 2
 * bytes: loaded chunk by chunk, each load waited behind the stores before
 * it (gpt-oss GEMM2 at M = 4096 +3%, H200 2026-11-26). */
template <typename T, typename Shape>
__device__ __forceinline__ void sm90_store_down_staged(const float (&acc)[Shape::kBlockN / 2], const sm90_rows &rows, int lane,
                                                       int nt, int expert, int split, const mx_gemm_args &g, float sc,
                                                       float *stage)
{
    constexpr int BN = Shape::kBlockN;
    const int q = lane % 4, r = lane / 4;
    const T *bias = sm90_down_bias<T>(g, expert, split);
    const int64_t tile_col = static_cast<int64_t>(nt) * BN;
    /* the y row of each row this lane stores, null for padding */
    float *y_row[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int32_t pair = sm90_line_row_pair(rows, lane, j);
        y_row[j] = pair >= 0 ? sm90_down_y(g, split) + static_cast<int64_t>(pair) * g.ldo + tile_col : nullptr;
    }
    /* the bias pairs of tile columns (2p, 2p + 1) at bias_pairs[p] */
    uint32_t *bias_pairs = reinterpret_cast<uint32_t *>(stage + 16 * 32);
    if (bias) {
        uint32_t mine[4];
        sm90_load_bias_pairs(bias, tile_col + 8 * (lane % (BN / 8)), 2, g.out_cols, mine);
        if (lane < BN / 8)
            *reinterpret_cast<uint4 *>(bias_pairs + 4 * lane) = make_uint4(mine[0], mine[1], mine[2], mine[3]);
    }
    auto at = [&](int row, int unit) { return stage + row * 32 + 4 * (unit ^ (2 * (row % 4))); };
#pragma unroll
    for (int c = 0; c < BN / 32; ++c) {
        if (tile_col + 32 * c >= g.out_cols) /* the same for the whole warp */
            break;
        __syncwarp(); /* the bias is in; the previous chunk has been read */
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = 4 * c + u;
            const float2 b = bias ? mx_unpack2<T>(bias_pairs[4 * i + q]) : make_float2(0.0f, 0.0f);
            const int unit = 2 * u + q / 2, half = 2 * (q % 2);
            *reinterpret_cast<float2 *>(at(r, unit) + half) =
                make_float2((acc[4 * i] * sc + b.x) * rows.w_lo, (acc[4 * i + 1] * sc + b.y) * rows.w_lo);
            *reinterpret_cast<float2 *>(at(r + 8, unit) + half) =
                make_float2((acc[4 * i + 2] * sc + b.x) * rows.w_hi, (acc[4 * i + 3] * sc + b.y) * rows.w_hi);
        }
        __syncwarp();
        const int64_t col = 32 * c + 4 * (lane % 8);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float4 v = *reinterpret_cast<const float4 *>(at(lane / 8 + 4 * j, lane % 8));
            if (y_row[j] && tile_col + col < g.out_cols)
                *reinterpret_cast<float4 *>(y_row[j] + col) = v;
        }
    }
    __syncwarp(); /* the bias pairs are read before the next tile writes them */
}

/* GEMM2 by sorted row (block scales, gemm_configs_fp8.cuh
 * mx_fp8_sm90_down_by_sorted_row): y[s, col] = (acc * sc + w2_bias[col]) *
 * routing weight, float32, for the warp's 16 sorted rows from row0, 32
 * columns at a time: each thread puts its pairs of rows lo and hi into one
 * of the warp's two boxes (16 rows x 128 bytes, 128B-swizzled as the y map
 * reads them: the 8-byte writes fill all 32 banks twice), then lane 0
 * TMA-stores the box, and the warp goes on (to the next chunk, then the
 * next tile's mainloop) while the copy engine writes. A box is refilled
 * once the store before the last has read it (bulk groups are lane 0's).
 * A warp of 16 padding rows stores nothing; padding rows beside real ones
 * go out too (moe_sum never reads them); the map clips columns past
 * out_cols and rows past rows_max. Each chunk's bias pairs are loaded with
 * the chunk before: nothing orders them behind the stores, which are the
 * copy engine's. */
template <typename T, typename Shape>
__device__ __forceinline__ void sm90_store_down_boxes(const float (&acc)[Shape::kBlockN / 2], const sm90_rows &rows,
                                                      int lane, int nt, int expert, const mx_gemm_args &g, float sc,
                                                      uint32_t boxes, const CUtensorMap *map_y, int row0)
{
    constexpr int BN = Shape::kBlockN;
    if (!__any_sync(0xffffffffu, rows.pair_lo >= 0 || rows.pair_hi >= 0))
        return;
    const int q = lane % 4, r = lane / 4;
    const T *bias = sm90_expert_bias<T>(g, expert);
    const int64_t tile_col = static_cast<int64_t>(nt) * BN;
    /* the bias pairs of columns 8u + 2q of this chunk and of the next */
    uint32_t bias_now[4], bias_next[4];
    sm90_load_bias_pairs(bias, tile_col + 2 * q, 8, g.out_cols, bias_next);
#pragma unroll
    for (int c = 0; c < BN / 32; ++c) {
        if (tile_col + 32 * c >= g.out_cols) /* the same for the whole warp */
            break;
#pragma unroll
        for (int u = 0; u < 4; ++u)
            bias_now[u] = bias_next[u];
        if (c + 1 < BN / 32)
            sm90_load_bias_pairs(bias, tile_col + 32 * (c + 1) + 2 * q, 8, g.out_cols, bias_next);
        const uint32_t box = boxes + (c % 2) * Shape::kDownBoxBytes;
        if (lane == 0)
            bulk_wait_read<1>(); /* this box's last store has read it */
        __syncwarp();
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int i = 4 * c + u;
            const float2 b = mx_unpack2<T>(bias_now[u]);
            const uint32_t half = 8u * static_cast<uint32_t>(q % 2);
            const uint32_t byte = 16u * static_cast<uint32_t>(2 * u + q / 2) + half;
            st_shared_f32x2(box + sw128_offset(r, byte), (acc[4 * i] * sc + b.x) * rows.w_lo,
                            (acc[4 * i + 1] * sc + b.y) * rows.w_lo);
            st_shared_f32x2(box + sw128_offset(r + 8, byte), (acc[4 * i + 2] * sc + b.x) * rows.w_hi,
                            (acc[4 * i + 3] * sc + b.y) * rows.w_hi);
        }
        fence_proxy_async_smem(); /* the copy engine reads what the warp wrote */
        __syncwarp();
        if (lane == 0) {
            tma_store_2d(map_y, box, static_cast<int>(tile_col) + 32 * c, row0);
            bulk_commit();
        }
    }
}

/* Interleaved (swigluoai) GEMM1 tiles leave through shared memory: each
 * math warpgroup puts its 64 x BN/2 act values into its own BN/128 boxes of
 * 64 rows x 128 bytes (128B-swizzled, as the store map reads them) and one
 * thread TMA-stores them, so the warpgroup goes on to the next tile while
 * the copy engine writes. Padding rows go out too (whatever the boxes
 * held): nothing reads them. Measured on H100 (2026-11-25, two rounds,
 * logs/2026-11-25-nvidia-h100-ab-tma-store.txt): gpt-oss GEMM1 at M = 16384
 * 4370 -> 3965 us (its direct stores pair lanes across rows lo / hi); the
 * plain gated kind was 1-3% slower through the boxes (Mixtral bf16 11170
 * -> 11465, qwen3moe 1282 -> 1300), so it goes through its warps' own
 * staging (sm90_warp_staged), which needs no barrier across the warpgroup. */
template <int KIND> constexpr bool sm90_staged_out() { return KIND == MX_GEMM_GATE_UP_INTERLEAVED; }

/* The other kinds' outputs leave through each math warp's own shared
 * memory (sm90_store_down_staged, sm90_store_act), whole 128-byte lines
 * per store instruction, except in the block-scale kernels on the
 * cooperative tiles, which store from the fragments: staged, their
 * forwards were 0.9% slower (DeepSeek-V3 fp8_block M = 4096 5820 -> 5872
 * us; the shared memory taken from L1, where the promotion reads its
 * scales every k block). On ping-pong units (whose GEMM2 has no y boxes)
 * the block-scale kernels stage too: qwen3moe fp8_block M = 256 / 512 /
 * 1024 -0.9 / -1.0 / -0.6%, DeepSeek-V3 M = 512 / 1024 -1.0 / -1.6% (H100,
 * 2026-11-27, two rounds, logs/2026-11-27-nvidia-h100-ab-ping-pong-follow-ups.txt;
 * the units' GEMM2 also lost its 20 bytes of spills). Staged against
 * direct, forwards on an H200 (2026-11-26, three rounds each,
 * logs/2026-11-26-nvidia-h200-ab-warp-staged-stores.txt, with the
 * per-tensor pairs below): qwen3moe bf16 / fp8_tensor M = 16384 -2.3 /
 * -3.2% (GEMM2 -6..-9%), Mixtral fp8_tensor M = 16384 -2.1%, DeepSeek-V3
 * fp8_tensor M = 4096 -2.8%, gpt-oss bf16 M = 4096 / 16384 -2.3%, Mixtral
 * bf16 within 1%, qwen3moe M = 1024 within 0.5%. */
template <typename Shape, int KIND, int QUANT> constexpr bool sm90_warp_staged()
{
    return !sm90_staged_out<KIND>() && (QUANT != MX_QUANT_FP8_BLOCK || Shape::kPingPong);
}

/* GEMM2 with block scales on the cooperative tiles stores y by sorted row
 * through each math warp's two TMA boxes (sm90_store_down_boxes) where
 * g.y_by_sorted_row, else by pair from the fragments; launched without the
 * boxes' shared memory then. Ping-pong units have no boxes (they do not fit
 * beside that ring) and store by pair. sm90_down_boxes: the kernel has the
 * boxes; sm90_y_boxes: this launch uses them. */
template <typename Shape, int KIND, int QUANT> constexpr bool sm90_down_boxes()
{
    return KIND == MX_GEMM_DOWN && QUANT == MX_QUANT_FP8_BLOCK && !Shape::kPingPong;
}
template <typename Shape, int KIND, int QUANT>
__host__ __device__ __forceinline__ bool sm90_y_boxes(const mx_gemm_args &g)
{
    return sm90_down_boxes<Shape, KIND, QUANT>() && g.y_by_sorted_row;
}

/* Shared memory of one kernel past the ring: its epilogue's staging. */
template <typename Shape, int KIND, int QUANT> constexpr uint32_t sm90_out_bytes()
{
    return sm90_staged_out<KIND>()            ? Shape::kOutBytes
           : sm90_warp_staged<Shape, KIND, QUANT>() ? Shape::kMathWarps * Shape::kWarpStageBytes
           : sm90_down_boxes<Shape, KIND, QUANT>() ? Shape::kMathWarps * Shape::kDownStageBytes
                                             : 0;
}
template <typename Shape, int KIND, int QUANT> constexpr size_t sm90_smem_bytes()
{
    return Shape::kSmemBytes + sm90_out_bytes<Shape, KIND, QUANT>();
}
/* The staging one launch has (and the kernel's barriers after it): a
 * block-scale GEMM2 by pair runs without its boxes, so that their shared
 * memory stays L1. */
template <typename Shape, int KIND, int QUANT>
__host__ __device__ __forceinline__ uint32_t sm90_launch_out_bytes(const mx_gemm_args &g)
{
    return sm90_down_boxes<Shape, KIND, QUANT>() && !g.y_by_sorted_row ? 0u : sm90_out_bytes<Shape, KIND, QUANT>();
}

/* The staging boxes of the thread's warpgroup and the thread's first row in them. */
struct sm90_out_stage {
    uint32_t base; /* shared address of box 0 */
    int row;       /* rows row and row + 8 of the warpgroup's 64 */
};

/* The gated kind's act pair (columns 8i + 2q, + 1 of the tile) of the
 * thread's row lo (hi: its row hi), packed in the act dtype: gate from
 * fragment group i, up from group i + BN / 16 (the up box), plus their
 * bias pairs bg, bu. */
template <typename T, typename Shape, int ACT>
__device__ __forceinline__ uint32_t sm90_gated_pair(const float (&acc)[Shape::kBlockN / 2], int i, bool hi, float sc,
                                                    float2 bg, float2 bu, float alpha, float limit)
{
    const int g = 4 * i + (hi ? 2 : 0), u = 4 * (i + Shape::kBlockN / 16) + (hi ? 2 : 0);
    return mx_pack2<T>(mx_act_gated(ACT, acc[g] * sc + bg.x, acc[u] * sc + bu.x, alpha, limit),
                       mx_act_gated(ACT, acc[g + 1] * sc + bg.y, acc[u + 1] * sc + bu.y, alpha, limit));
}

/* GEMM1: act[s, col] = ACT(acc * sc + w13_bias) in act dtype; with kAmax
 * also the running amax of the stored values. The interleaved kind goes
 * into its warpgroup's staging boxes (TMA store); with kWarpStaged the
 * others through the warp's 2 KB of shared memory (`warp_stage`, 16 rows x
 * 64 columns in the 128B swizzle, so the 4-byte writes of 8 rows do not
 * conflict), 64 columns at a time: lane l then stores the 16 bytes l % 8 of
 * row l / 8 + 4 j, whole 128-byte lines of four rows per instruction
 * instead of 16 bytes of 8 rows; without, straight from the fragments.
 * ACT is a compile-time mx_activation, so each instantiation is one
 * straight run of code with no per-element branch on the activation. */
template <typename T, typename Shape, int KIND, int ACT, bool kAmax, bool kWarpStaged>
__device__ __forceinline__ void sm90_store_act(const float (&acc)[Shape::kBlockN / 2], const sm90_rows &rows, int lane,
                                               int nt, int expert, const mx_gemm_args &g, float sc, float &amax,
                                               const sm90_out_stage &stage, unsigned char *warp_stage)
{
    constexpr int BN = Shape::kBlockN;
    const int q = lane % 4;
    const int64_t oc = g.out_cols;
    const float alpha = g.swiglu_alpha, limit = g.swiglu_limit;
    const T *bias = sm90_expert_bias<T>(g, expert);
    const bool lo = rows.pair_lo >= 0, hi = rows.pair_hi >= 0;
    const int64_t tile_col = static_cast<int64_t>(nt) * (KIND == MX_GEMM_UP ? BN : BN / 2);
    T *act_lo = static_cast<T *>(g.out) + rows.s_lo * g.ldo; /* direct stores */
    T *act_hi = act_lo + 8 * g.ldo;
    /* the pair (col, col + 1) of the thread's row lo (second: row hi) */
    auto store = [&](bool second, int64_t col, uint32_t packed) {
        const uint32_t byte = 2u * static_cast<uint32_t>(col - tile_col);
        if constexpr (sm90_staged_out<KIND>())
            st_shared_u32(stage.base + (byte / 128) * Shape::kOutBoxBytes + sw128_offset(stage.row + (second ? 8 : 0), byte % 128),
                          packed);
        else if constexpr (kWarpStaged)
            *reinterpret_cast<uint32_t *>(warp_stage + sw128_offset(lane / 4 + (second ? 8 : 0), byte % 128)) = packed;
        else
            *reinterpret_cast<uint32_t *>((second ? act_hi : act_lo) + col) = packed;
        if (kAmax)
            amax = sm90_amax2<T>(amax, packed);
    };
    /* the act row of each row this lane stores (rows lane / 8 + 4 j of the warp's 16), null for padding */
    T *act_row[4] = {};
#pragma unroll
    for (int j = 0; j < (kWarpStaged ? 4 : 0); ++j) {
        const int64_t s = rows.s_lo - lane / 4 + lane / 8 + 4 * j; /* sorted row lane / 8 + 4 j of the warp's */
        act_row[j] = sm90_line_row_pair(rows, lane, j) >= 0 ? static_cast<T *>(g.out) + s * g.ldo + tile_col : nullptr;
    }
    /* the staged 64 columns from tile column c0 out to the act rows */
    auto flush = [&](int c0) {
        if (!kWarpStaged)
            return;
        __syncwarp();
        const int64_t col = c0 + 8 * (lane % 8);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint4 v = *reinterpret_cast<const uint4 *>(warp_stage + sw128_offset(lane / 8 + 4 * j, 16u * (lane % 8)));
            if (act_row[j] && tile_col + col < oc)
                *reinterpret_cast<uint4 *>(act_row[j] + col) = v;
        }
        __syncwarp(); /* read before the next chunk is written */
    };
    if (KIND == MX_GEMM_GATE_UP) {
        const int64_t col0 = tile_col + 2 * q;
        uint32_t gate_bias[BN / 16], up_bias[BN / 16];
        sm90_load_bias_pairs(bias, col0, 8, oc, gate_bias);
        sm90_load_bias_pairs(bias ? bias + oc : nullptr, col0, 8, oc, up_bias);
#pragma unroll
        for (int c = 0; c < BN / 128; ++c) {
            if (tile_col + 64 * c >= oc) /* the same for the whole warp */
                break;
#pragma unroll
            for (int i = 8 * c; i < 8 * c + 8; ++i) {
                const int64_t col = col0 + 8 * i;
                if (col >= oc)
                    continue;
                const float2 bg = mx_unpack2<T>(gate_bias[i]), bu = mx_unpack2<T>(up_bias[i]);
                if (lo)
                    store(false, col, sm90_gated_pair<T, Shape, ACT>(acc, i, false, sc, bg, bu, alpha, limit));
                if (hi)
                    store(true, col, sm90_gated_pair<T, Shape, ACT>(acc, i, true, sc, bg, bu, alpha, limit));
            }
            flush(64 * c);
        }
    } else if (KIND == MX_GEMM_GATE_UP_INTERLEAVED) {
        /* the thread's output column o = 4i + q; lanes q and q^1 swap so that
         * the even lane stores row lo and the odd lane row hi, two columns each */
        const bool even = (q & 1) == 0;
        const int64_t o0 = tile_col + q;
        uint32_t gate_up_bias[BN / 8]; /* (gate, up) of output column o at bias[2o], bias[2o + 1] */
        sm90_load_bias_pairs(bias, 2 * o0, 8, 2 * oc, gate_up_bias);
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            const int64_t o = o0 + 4 * i;
            const float2 b = mx_unpack2<T>(gate_up_bias[i]);
            const float v_lo = mx_act_gated(ACT, acc[4 * i] * sc + b.x, acc[4 * i + 1] * sc + b.y, alpha, limit);
            const float v_hi = mx_act_gated(ACT, acc[4 * i + 2] * sc + b.x, acc[4 * i + 3] * sc + b.y, alpha, limit);
            const float other = __shfl_xor_sync(0xffffffffu, even ? v_hi : v_lo, 1);
            const int64_t col = even ? o : o - 1;
            if (col >= oc || !(even ? lo : hi))
                continue;
            store(!even, col, even ? mx_pack2<T>(v_lo, other) : mx_pack2<T>(other, v_hi));
        }
    } else {
        const int64_t col0 = tile_col + 2 * q;
        /* staged: by chunks (all BN / 8 with the act rows would spill), the
         * next one's before this one's stores, which it would wait for
         * (sm90_load_bias_pairs); direct: all before the first store */
        constexpr int kBiasPairs = kWarpStaged ? 8 : BN / 8;
        uint32_t bias_pairs[kBiasPairs];
        sm90_load_bias_pairs(bias, col0, 8, oc, bias_pairs);
#pragma unroll
        for (int c = 0; c < BN / 64; ++c) {
            if (tile_col + 64 * c >= oc)
                break;
#pragma unroll
            for (int i = 8 * c; i < 8 * c + 8; ++i) {
                const int64_t col = col0 + 8 * i;
                if (col >= oc)
                    continue;
                const float2 b = mx_unpack2<T>(bias_pairs[i % kBiasPairs]);
                if (lo)
                    store(false, col, mx_pack2<T>(mx_act_plain(ACT, acc[4 * i] * sc + b.x),
                                                  mx_act_plain(ACT, acc[4 * i + 1] * sc + b.y)));
                if (hi)
                    store(true, col, mx_pack2<T>(mx_act_plain(ACT, acc[4 * i + 2] * sc + b.x),
                                                 mx_act_plain(ACT, acc[4 * i + 3] * sc + b.y)));
            }
            if (kWarpStaged && c + 1 < BN / 64)
                sm90_load_bias_pairs(bias, col0 + 64 * (c + 1), 8, oc, bias_pairs);
            flush(64 * c);
        }
    }
}

/* Whether GEMM1 quantizes act itself (sc.act_q): the block-scale gated
 * kind on 256-wide tiles, whose 128 act columns per row are one 128-column
 * group (the tile's n index is the group's), so that the group quantizer's
 * launch and act's 16-bit round trip are not needed. Against that
 * quantizer (H100, 2026-11-26, logs/2026-11-26-nvidia-h100-bench-ab-act-q-in-gemm1.txt,
 * three rounds; forwards bit-identical): qwen3moe fp8_block M = 1024 / 4096
 * / 16384 -5.0 / -3.7 / -3.2%, DeepSeek-V3 M = 4096 -3.5%, Mixtral M = 256
 * / 1024 -2.7 / -3.4%, but DeepSeek-V3 M = 16384 +0.7..+1.8% (GEMM1 8196
 * -> 8509 us there, the quantizer's 398 us gone). The epilogue takes ~2 us
 * more per tile (~700 more instructions per warp while the tensor cores
 * wait), but ncu on that GEMM1 (logs/2026-11-26-nvidia-h100-e688790-ncu-deepseek-gemm1-act-q.txt)
 * puts its loss in L2 reuse: hit rate 62.7 -> 50.9%, 7.8 GB more DRAM
 * traffic. The fp8 rows staged through each warp's shared memory for
 * whole-line stores instead: DeepSeek-V3 M = 16384 +1.6% more, the rest
 * within noise (not kept). */
template <typename Shape, int KIND, int QUANT> __host__ __device__ constexpr bool sm90_quantizes_act()
{
    return KIND == MX_GEMM_GATE_UP && QUANT == MX_QUANT_FP8_BLOCK && Shape::kBlockN == 256;
}

/* sm90_quantizes_act's epilogue: act values as sm90_store_act forms them,
 * rounded to the act dtype, then each row's group scale from the maximum
 * over its 128 columns (the four lanes of a quad hold them) and the fp8
 * values, with the group quantizer's formulas, so the same bits. Lanes q
 * and q ^ 1 swap a pair, so that the even lane stores 4 bytes of row lo and
 * the odd lane the same 4 of row hi; lanes 0 and 1 store the rows' scales. */
template <typename T, typename Shape, int ACT>
__device__ __forceinline__ void sm90_store_act_q(const float (&acc)[Shape::kBlockN / 2], const sm90_rows &rows, int lane,
                                                 int nt, int expert, const mx_gemm_args &g, float sc,
                                                 const mx_sm90_scales &scales)
{
    constexpr int BN = Shape::kBlockN, GROUPS = BN / 16; /* fragment groups of 8 act columns */
    static_assert(BN / 2 == kFp8Block, "one act group per tile row");
    const int q = lane % 4;
    const int64_t oc = g.out_cols;
    const float alpha = g.swiglu_alpha, limit = g.swiglu_limit;
    const T *bias = sm90_expert_bias<T>(g, expert);
    const int64_t tile_col = static_cast<int64_t>(nt) * (BN / 2), col0 = tile_col + 2 * q;
    uint32_t gate_bias[GROUPS], up_bias[GROUPS];
    sm90_load_bias_pairs(bias, col0, 8, oc, gate_bias);
    sm90_load_bias_pairs(bias ? bias + oc : nullptr, col0, 8, oc, up_bias);
    /* the act pairs (col0 + 8i, + 1) of rows lo and hi, rounded */
    uint32_t act_lo[GROUPS], act_hi[GROUPS];
    float max_lo = 0.0f, max_hi = 0.0f;
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) {
        const float2 bg = mx_unpack2<T>(gate_bias[i]), bu = mx_unpack2<T>(up_bias[i]);
        act_lo[i] = sm90_gated_pair<T, Shape, ACT>(acc, i, false, sc, bg, bu, alpha, limit);
        act_hi[i] = sm90_gated_pair<T, Shape, ACT>(acc, i, true, sc, bg, bu, alpha, limit);
        const float2 lo = mx_unpack2<T>(act_lo[i]), hi = mx_unpack2<T>(act_hi[i]);
        max_lo = mx_amax_step(mx_amax_step(max_lo, lo.x), lo.y);
        max_hi = mx_amax_step(mx_amax_step(max_hi, hi.x), hi.y);
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        max_lo = mx_max_nan(max_lo, __shfl_xor_sync(0xffffffffu, max_lo, off));
        max_hi = mx_max_nan(max_hi, __shfl_xor_sync(0xffffffffu, max_hi, off));
    }
    const float s_lo = mx_fp8_group_scale(max_lo), s_hi = mx_fp8_group_scale(max_hi);
    const float r_lo = mx_fp8_div_recip(s_lo), r_hi = mx_fp8_div_recip(s_hi);
    const bool even = (q & 1) == 0;
    const int32_t pair = even ? rows.pair_lo : rows.pair_hi;
    const int64_t s_row = rows.s_lo + (even ? 0 : 8);
    uint8_t *q_row = scales.act_q + s_row * scales.act_q_ld + tile_col + 2 * (q & ~1);
    if (q < 2 && pair >= 0)
        scales.act_q_scale[s_row * scales.act_q_scale_ld + nt] = even ? s_lo : s_hi;
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) {
        const float2 lo = mx_unpack2<T>(act_lo[i]), hi = mx_unpack2<T>(act_hi[i]);
        const uint32_t q_lo = mx_fp8_encode2_divided(lo.x, lo.y, s_lo, r_lo);
        const uint32_t q_hi = mx_fp8_encode2_divided(hi.x, hi.y, s_hi, r_hi);
        const uint32_t got = __shfl_xor_sync(0xffffffffu, even ? q_hi : q_lo, 1);
        if (pair >= 0)
            *reinterpret_cast<uint32_t *>(q_row + 8 * i) = even ? q_lo | got << 16 : got | q_hi << 16;
    }
}

/* The epilogue of one tile, dispatched once per tile on the activation
 * (only the pairs check_problem allows are instantiated: swigluoai with the
 * interleaved kind, silu / gelu gated, relu2 / silu / gelu plain). GEMM1
 * with per-tensor FP8 scales ends with one atomic amax per warp. */
template <typename T, typename Shape, int KIND, int QUANT>
__device__ __forceinline__ void sm90_epilogue(const float (&acc)[Shape::kBlockN / 2], const sm90_rows &rows, int lane,
                                              int nt, int expert, int split, const mx_gemm_args &g, float sc,
                                              const mx_sm90_scales &scales, const sm90_out_stage &stage,
                                              unsigned char *warp_stage, const CUtensorMap *map_out, int warp_row0)
{
    constexpr bool kAmax = QUANT == MX_QUANT_FP8_TENSOR && KIND != MX_GEMM_DOWN;
    float amax = 0.0f;
    constexpr bool kWarpStaged = sm90_warp_staged<Shape, KIND, QUANT>();
    if constexpr (sm90_quantizes_act<Shape, KIND, QUANT>()) {
        if (g.activation == MX_ACT_GELU)
            sm90_store_act_q<T, Shape, MX_ACT_GELU>(acc, rows, lane, nt, expert, g, sc, scales);
        else
            sm90_store_act_q<T, Shape, MX_ACT_SILU>(acc, rows, lane, nt, expert, g, sc, scales);
    } else if (sm90_y_boxes<Shape, KIND, QUANT>(g)) {
        sm90_store_down_boxes<T, Shape>(acc, rows, lane, nt, expert, g, sc, mx_smem_addr(warp_stage), map_out,
                                        warp_row0);
    } else if (KIND == MX_GEMM_DOWN && kWarpStaged) {
        sm90_store_down_staged<T, Shape>(acc, rows, lane, nt, expert, split, g, sc,
                                         reinterpret_cast<float *>(warp_stage));
    } else if (KIND == MX_GEMM_DOWN) {
        sm90_store_down_direct<T, Shape>(acc, rows, lane % 4, nt, expert, split, g, sc);
    } else if (KIND == MX_GEMM_GATE_UP_INTERLEAVED) {
        sm90_store_act<T, Shape, KIND, MX_ACT_SWIGLUOAI, kAmax, kWarpStaged>(acc, rows, lane, nt, expert, g, sc, amax, stage,
                                                                              warp_stage);
    } else if (g.activation == MX_ACT_GELU) {
        sm90_store_act<T, Shape, KIND, MX_ACT_GELU, kAmax, kWarpStaged>(acc, rows, lane, nt, expert, g, sc, amax, stage,
                                                                              warp_stage);
    } else if (KIND == MX_GEMM_UP && g.activation == MX_ACT_RELU2) {
        sm90_store_act<T, Shape, KIND, MX_ACT_RELU2, kAmax, kWarpStaged>(acc, rows, lane, nt, expert, g, sc, amax, stage,
                                                                              warp_stage);
    } else {
        sm90_store_act<T, Shape, KIND, MX_ACT_SILU, kAmax, kWarpStaged>(acc, rows, lane, nt, expert, g, sc, amax, stage,
                                                                              warp_stage);
    }
    if (kAmax) {
        amax = mx_warp_max(amax);
        if (threadIdx.x % 32 == 0 && !(amax <= 0.0f)) /* > 0 or NaN */
            mx_atomic_amax(scales.amax, amax);
    }
}

} /* namespace */

#endif /* MOE_EXT_CUDA_GROUPED_GEMM_SM90_EPILOGUE_CUH */
