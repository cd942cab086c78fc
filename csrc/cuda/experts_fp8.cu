/* The FP8 w8a8 expert pipeline (mx_cuda_experts with quant != NONE;
 * numerics.md "FP8", abi.h mx_experts_problem).
 *
 * Operands: x [M, H] and biases in the act dtype (bfloat16 / float16 /
 * float32); w13 fp8 [E_local, N1, H], w2 fp8 [E_local, H, I];
 *   FP8_TENSOR  w13_scale / w2_scale f32 [E_local]; activations per tensor
 *   FP8_BLOCK   w13_scale f32 [E_local, N1/128, H/128], w2_scale [E_local,
 *               H/128, I/128] (ceil); activations per token and 128 columns
 * topk_weights f32 [M, k], topk_ids i32 [M, k], expert_map -> out [M, H].
 *
 * At one token with gated weights in whole 128-wide blocks one launch does
 * it all where it fits (decode_fused.cu). Otherwise
 * launches, in stream order (no host synchronization, no allocation):
 *   0. route_kernel             only when the engine routes (p->routing) and M > 16
 *   1. moe_align_kernel         pairs -> expert segments padded to block_m, tile table
 *                               (route_align_kernel: routing and this in one launch, M <= 16)
 *   2. moe_scale_input_kernel   only with apply_router_weight_on_input
 *   3. x -> x_q                 TENSOR: rows_amax_kernel (block maxima over the
 *                               rows of tokens with a local expert; also zeroes
 *                               act_amax) + rows_quant_tensor_kernel;
 *                               BLOCK: group_quant_kernel (x_scale [M, H/128]);
 *                               Hopper persistent configs from 128 rows per
 *                               expert: each token's q row goes to the sorted
 *                               rows of its local pairs (by pair_rows), GEMM1's
 *                               A for its TMA loads
 *   4. GEMM1 (fp8)              act = act(x_q[token] @ w13[e].T * scales + b13),
 *                               (the persistent kernel from 128 rows per expert
 *                               reads x_q rows in sorted order, below that and
 *                               the decode kernel by token)
 *                               rounded to the act dtype; TENSOR: atomic amax of act
 *   5. act -> act_q             TENSOR: rows_quant_tensor_kernel with the scale
 *                               from act_amax; BLOCK: group_quant_kernel
 *                               (act_scale [rows, I/128]); valid sorted rows only.
 *                               BLOCK on the Hopper decode kernel's 16- and
 *                               32-token tiles and on the persistent kernel's
 *                               gated 128x256 tiles: no launch, GEMM1's
 *                               epilogue quantizes act the same way
 *   6. GEMM2 (fp8)              y = (act_q @ w2[e].T * scales + b2) * w, float32, by
 *                               pair (split-K slices at decode), or by sorted row
 *                               (the persistent kernel with block scales and a
 *                               short I)
 *   7. moe_sum_kernel           out[t] = sum_j y[t, j], rounded once
 * Grids are sized from the worst case and surplus CTAs exit after reading
 * num_tiles. Quantization covers exactly the rows of local experts, so the
 * per-tensor scales match a reference that quantizes those rows only.
 *
 * Workspace (each piece 256-byte aligned), tiles_max = floor(M k / block_m)
 * + min(E_local, M k), rows_max = tiles_max * block_m:
 *   align            int32 [max(2, chunks) E_local]  moe_align's counters (moe_align.cu)
 *   num_tiles        int32 [2]                    tiles in use; the persistent Hopper GEMMs' unit counter
 *   scalars          act_amax (u32 bits), x_scale, act_scale (TENSOR)
 *   partials         f32 [mx_fp8_amax_parts(M)]   TENSOR: amax of x per block
 *   tile_expert      int32 [tiles_max]
 *   sorted_ids       int32 [rows_max]
 *   pair_rows        int32 [M k]                  a_sorted or y_sorted: each pair's sorted row
 *   x_scaled         act [M, H]                   only with apply_router_weight_on_input
 *   x_q              fp8 [M, ld_xq]               ld_xq = H rounded up to 16; a_sorted:
 *                                                 [rows_max, ld_xq], rows in sorted order
 *   x_scale          f32 [M, H/128]               BLOCK
 *   act              act [rows_max, ld_act]       ld_act = I rounded up to 8
 *   act_q            fp8 [rows_max, ld_aq]        ld_aq = I rounded up to 16
 *   act_scale        f32 [rows_max, I/128]        BLOCK
 *   y                f32 [down_splits, y_rows, H]     y_rows = M k (by pair), rows_max
 *                                                 where GEMM2 writes by sorted row
 *                                                 (gemm_configs_fp8.cuh mx_fp8_sm90_down_by_sorted_row);
 *                                                 the persistent Hopper GEMM2 picks up to down_splits
 *   split_count      int32 [1]                    that pick (only then)
 * The workspace is sized for the larger of the shape-selected tile config
 * and mid (taken when the weight pointers do not allow 16-byte loads). */
#include <string.h>

#include "common.cuh"
#include "experts.cuh"
#include "fp8.cuh"
#include "gemm_configs_fp8.cuh"
#include "grouped_gemm_sm90.cuh"

namespace {

/* The per-tensor act quantizer lets GEMM2 launch before it waits for GEMM1
 * (fp8.cuh mx_fp8_row_filter.early_dependents) where GEMM2 is the Hopper
 * decode kernel, the one GEMM2 launched dependent (the persistent and
 * mma.sync kernels are launched plainly, so the trigger would start nothing),
 * up to this many pairs: GEMM2's first weight stages then load during
 * GEMM1's tail. Against waiting first,
 * H200, two rounds (logs/2026-11-27-nvidia-h200-ab-act-quant-early-
 * dependents.txt, call 6): qwen3moe fp8_tensor M = 8 / 32 / 64 -3.3 / -2.9 /
 * -1.3%, Mixtral M = 1 / 8 / 32 -3.6 / -1.4 / -0.8%, DeepSeek-V3 M = 1 / 8
 * -1.3 / -0.7%. Past it the quantizer's own rows lose more to that traffic
 * than the head start gains: without the limit (call 5) qwen3moe M = 128 /
 * 256 / 512 +0.7 / +0.2 / +0.4%. */
constexpr int64_t kActQuantEarlyDependentsMaxPairs = 512;

typedef struct fp8_plan {
    int tile_config; /* mx_fp8_tile_config */
    int block_m;
    int64_t pairs, tiles_max, rows_max;
    int64_t ld_xq, ld_act, ld_aq, x_blocks, act_blocks;
    int down_splits;          /* the persistent Hopper GEMM2: at most (it picks on the device) */
    int64_t down_split_len;
    int split_exact;          /* ... exactly (mx_cuda_set_sm90_down_splits) */
    bool a_sorted; /* x quantized into GEMM1's sorted rows (mx_fp8_sm90_gemm1_a_by_token) */
    bool y_sorted; /* GEMM2 writes y by sorted row (moe_sum reads it through pair_rows) */
    int64_t y_rows;
    size_t off_align, off_num_tiles, off_scalars, off_partials, off_tile_expert, off_sorted_ids, off_pair_rows,
        off_x_scaled, off_x_q, off_x_scale, off_act, off_act_q, off_act_scale, off_y, off_split_count;
    size_t total_bytes;
} fp8_plan;

/* the persistent Hopper GEMM2 picks its slice count on the device (moe_sum reads it) */
inline bool plan_picks_splits(const fp8_plan &plan)
{
    return plan.tile_config == MX_FP8_TILE_SM90 && plan.down_splits > 1;
}

/* moe_align writes pair_rows for the x quantizer's sorted rows or for moe_sum's y by sorted row */
inline bool plan_has_pair_rows(const fp8_plan &plan) { return plan.a_sorted || plan.y_sorted; }

/* shapes allow 16-byte weight loads (the pointers are checked at launch) */
int shapes_aligned(const mx_experts_problem *p) { return p->hidden_size % 16 == 0 && p->intermediate_size % 16 == 0; }

void make_plan(const mx_experts_problem *p, int tile_config, fp8_plan *plan)
{
    const int64_t M = p->num_tokens, H = p->hidden_size, I = p->intermediate_size;
    const int64_t local = p->num_local_experts;
    const bool block = p->quant == MX_QUANT_FP8_BLOCK;
    const size_t es = p->act_dtype == MX_F32 ? 4 : 2;
    plan->tile_config = tile_config;
    plan->block_m = mx_fp8_tile_block_m(tile_config);
    plan->pairs = M * p->top_k;
    plan->tiles_max = plan->pairs / plan->block_m + (local < plan->pairs ? local : plan->pairs);
    plan->rows_max = plan->tiles_max * plan->block_m;
    plan->ld_xq = (H + 15) / 16 * 16;
    plan->ld_act = (I + 7) / 8 * 8;
    plan->ld_aq = (I + 15) / 16 * 16;
    plan->x_blocks = mx_ceil_div(H, kFp8Block);
    plan->act_blocks = mx_ceil_div(I, kFp8Block);
    plan->down_splits =
        mx_fp8_select_down_splits(tile_config, plan->tiles_max, H, I, p->quant, &plan->down_split_len);
    const bool persistent = mx_fp8_tile_is_sm90_persistent(tile_config);
    plan->split_exact = 0;
    if (mx_fp8_sm90_takes_slices(tile_config, p->quant)) {
        /* the kernel promotes pairs of k blocks (an even count) */
        const int64_t k_blocks = mx_ceil_div(I, 128);
        mx_sm90_down_splits_setting(&plan->down_splits, &plan->split_exact, (k_blocks + 1) & ~1, 2);
    }
    plan->a_sorted = persistent && !mx_fp8_sm90_gemm1_a_by_token(plan->pairs, local);
    plan->y_sorted = mx_fp8_sm90_down_by_sorted_row(tile_config, p->quant, I);
    plan->y_rows = plan->y_sorted ? plan->rows_max : plan->pairs;
    size_t at = 0;
    plan->off_align = mx_ws_take(&at, mx_moe_align_workspace_bytes(plan->pairs, local));
    plan->off_num_tiles = mx_ws_take(&at, MX_MOE_ALIGN_NUM_TILES_BYTES);
    plan->off_scalars = mx_ws_take(&at, 3 * sizeof(float));
    plan->off_partials = mx_ws_take(&at, block ? 0 : sizeof(float) * mx_fp8_amax_parts(M));
    plan->off_tile_expert = mx_ws_take(&at, sizeof(int32_t) * plan->tiles_max);
    plan->off_sorted_ids = mx_ws_take(&at, sizeof(int32_t) * plan->rows_max);
    plan->off_pair_rows = mx_ws_take(&at, plan_has_pair_rows(*plan) ? sizeof(int32_t) * plan->pairs : 0);
    plan->off_x_scaled = mx_ws_take(&at, p->apply_router_weight_on_input ? es * M * H : 0);
    plan->off_x_q = mx_ws_take(&at, static_cast<size_t>((plan->a_sorted ? plan->rows_max : M) * plan->ld_xq));
    plan->off_x_scale = mx_ws_take(&at, block ? sizeof(float) * M * plan->x_blocks : 0);
    plan->off_act = mx_ws_take(&at, es * plan->rows_max * plan->ld_act);
    plan->off_act_q = mx_ws_take(&at, static_cast<size_t>(plan->rows_max * plan->ld_aq));
    plan->off_act_scale = mx_ws_take(&at, block ? sizeof(float) * plan->rows_max * plan->act_blocks : 0);
    plan->off_y = mx_ws_take(&at, sizeof(float) * plan->down_splits * plan->y_rows * H);
    plan->off_split_count = mx_ws_take(&at, plan_picks_splits(*plan) ? sizeof(int32_t) : 0);
    plan->total_bytes = at;
}

/* aligned: shapes (and, at run time, weight pointers) allow 16-byte loads */
int select_config(const mx_experts_problem *p, int aligned)
{
    const int64_t rows = p->num_tokens * p->top_k;
    if (aligned && (p->act_dtype == MX_BF16 || p->act_dtype == MX_F16) && mx_cuda_sm90_gemm_available()) {
        const int sm90 = mx_fp8_select_sm90_config(rows, p->num_local_experts, p->hidden_size, p->intermediate_size,
                                                   p->quant == MX_QUANT_FP8_BLOCK,
                                                   p->is_act_and_mul && p->activation != MX_ACT_SWIGLUOAI,
                                                   p->is_act_and_mul && p->activation == MX_ACT_SWIGLUOAI);
        if (sm90 >= 0)
            return sm90;
    }
    return mx_fp8_select_tile_config(rows, p->num_local_experts, aligned);
}

} /* namespace */

extern "C" size_t mx_cuda_experts_fp8_workspace_bytes(const mx_experts_problem *p)
{
    if (p->num_tokens <= 0 || p->top_k < 1 || p->num_local_experts < 1)
        return 0;
    fp8_plan chosen, mid;
    make_plan(p, select_config(p, shapes_aligned(p)), &chosen);
    make_plan(p, MX_FP8_TILE_MID, &mid);
    return chosen.total_bytes > mid.total_bytes ? chosen.total_bytes : mid.total_bytes;
}

extern "C" mx_status mx_cuda_experts_fp8(const mx_experts_problem *p, void *workspace, cudaStream_t stream)
{
    if (p->quant != MX_QUANT_FP8_TENSOR && p->quant != MX_QUANT_FP8_BLOCK)
        return mx_status_fail(MX_ERR_VALUE, "experts (CUDA): unknown quant %d", (int)p->quant);
    if (!p->w13_scale || !p->w2_scale)
        return mx_status_fail(MX_ERR_VALUE, "experts (CUDA): FP8 weights need w13_scale and w2_scale");
    mx_status st;
    if (mx_cuda_decode_fused(p, workspace, stream, &st))
        return st;
    const int64_t M = p->num_tokens, H = p->hidden_size, I = p->intermediate_size;
    const bool block = p->quant == MX_QUANT_FP8_BLOCK;
    const int aligned1 = H % 16 == 0 && mx_aligned16(p->w13);
    const int aligned2 = I % 16 == 0 && mx_aligned16(p->w2);
    fp8_plan plan;
    make_plan(p, select_config(p, aligned1 && aligned2), &plan);
    if (plan.rows_max > 0x7fffffff || plan.pairs > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "experts (CUDA): M * top_k = %lld pairs exceed int32 indexing",
                              (long long)plan.pairs);

    unsigned char *ws = static_cast<unsigned char *>(workspace);
    int32_t *align_ws = reinterpret_cast<int32_t *>(ws + plan.off_align);
    int32_t *num_tiles = reinterpret_cast<int32_t *>(ws + plan.off_num_tiles);
    uint32_t *act_amax = reinterpret_cast<uint32_t *>(ws + plan.off_scalars);
    float *x_tensor_scale = reinterpret_cast<float *>(ws + plan.off_scalars) + 1;
    float *act_tensor_scale = reinterpret_cast<float *>(ws + plan.off_scalars) + 2;
    float *partials = reinterpret_cast<float *>(ws + plan.off_partials);
    int32_t *tile_expert = reinterpret_cast<int32_t *>(ws + plan.off_tile_expert);
    int32_t *sorted_ids = reinterpret_cast<int32_t *>(ws + plan.off_sorted_ids);
    int32_t *pair_rows = plan_has_pair_rows(plan) ? reinterpret_cast<int32_t *>(ws + plan.off_pair_rows) : nullptr;
    void *x_scaled = ws + plan.off_x_scaled;
    uint8_t *x_q = ws + plan.off_x_q;
    float *x_scale = reinterpret_cast<float *>(ws + plan.off_x_scale);
    void *act = ws + plan.off_act;
    uint8_t *act_q = ws + plan.off_act_q;
    float *act_scale = reinterpret_cast<float *>(ws + plan.off_act_scale);
    float *y = reinterpret_cast<float *>(ws + plan.off_y);

    st = mx_cuda_route_and_align(p, plan.block_m, align_ws, sorted_ids, tile_expert, num_tiles, pair_rows,
                                 stream);
    if (st.code != MX_OK)
        return st;

    const void *x = p->hidden_states;
    if (p->apply_router_weight_on_input) {
        st = mx_cuda_moe_scale_input(x, p->topk_weights, M, H, p->top_k, p->act_dtype, x_scaled, stream);
        if (st.code != MX_OK)
            return st;
        x = x_scaled;
    }

    mx_fp8_row_filter routed;
    memset(&routed, 0, sizeof routed);
    routed.mode = MX_FP8_ROWS_ROUTED;
    routed.topk_ids = p->topk_ids;
    routed.expert_map = p->expert_map;
    routed.top_k = p->top_k;
    routed.global_experts = p->global_num_experts;
    routed.local_experts = p->num_local_experts;
    routed.dest_rows = plan.a_sorted ? pair_rows : nullptr;
    st = mx_cuda_fp8_quant_a(x, p->act_dtype, M, H, H, &routed, p->quant, partials, act_amax, x_q, plan.ld_xq,
                             block ? x_scale : x_tensor_scale, plan.x_blocks, stream);
    if (st.code != MX_OK)
        return st;

    mx_fp8_gemm_args g1;
    memset(&g1, 0, sizeof g1);
    g1.a = x_q;
    g1.lda = plan.ld_xq;
    g1.a_sorted = plan.a_sorted;
    g1.a_scale = block ? x_scale : x_tensor_scale;
    g1.a_scale_ld = plan.x_blocks;
    g1.w = static_cast<const uint8_t *>(p->w13);
    g1.w_packed = p->weights_packed;
    g1.w_scale = p->w13_scale;
    g1.bias = p->w13_bias;
    g1.n_rows = p->is_act_and_mul ? 2 * I : I;
    g1.k = H;
    g1.out_cols = I;
    g1.sorted_ids = sorted_ids;
    g1.tile_expert = tile_expert;
    g1.num_tiles = num_tiles;
    g1.units_taken = mx_sm90_units_counter(num_tiles, plan.pairs, p->num_local_experts, block);
    g1.topk_weights = p->topk_weights;
    g1.top_k = p->top_k;
    g1.pairs = plan.pairs;
    g1.activation = p->activation;
    g1.swiglu_alpha = p->swiglu_alpha;
    g1.swiglu_limit = p->swiglu_limit;
    g1.out_dtype = p->act_dtype;
    g1.out = act;
    g1.ldo = plan.ld_act;
    g1.vec_out = 1; /* act rows: 8-element multiples, 256-byte aligned base */
    g1.amax = act_amax;
    g1.k_splits = 1;
    g1.k_split_len = H;
    const mx_gemm_kind kind1 = !p->is_act_and_mul                  ? MX_GEMM_UP
                                 : p->activation == MX_ACT_SWIGLUOAI ? MX_GEMM_GATE_UP_INTERLEAVED
                                                                     : MX_GEMM_GATE_UP;
    const bool sm90 = mx_fp8_tile_is_sm90(plan.tile_config);
    /* no act round trip, one launch less */
    const bool act_in_gemm1 =
        block && mx_fp8_sm90_block_gemm1_quantizes_act(plan.tile_config, kind1 == MX_GEMM_GATE_UP, I);
    if (act_in_gemm1) {
        g1.act_q = act_q;
        g1.act_q_ld = plan.ld_aq;
        g1.act_q_scale = act_scale;
        g1.act_q_scale_ld = plan.act_blocks;
    }
    /* right after the x quantizer: the decode kernel reads the tile table
     * before waiting for the kernel ahead (grouped_gemm_sm90_decode.cuh) */
    st = sm90 ? mx_cuda_grouped_gemm_fp8_sm90(&g1, kind1, p->quant, plan.tile_config, p->num_local_experts,
                                              plan.tiles_max, stream)
              : mx_cuda_grouped_gemm_fp8(&g1, kind1, p->quant, plan.tile_config, aligned1, plan.tiles_max, stream);
    if (st.code != MX_OK)
        return st;

    if (!act_in_gemm1) {
        mx_fp8_row_filter sorted;
        memset(&sorted, 0, sizeof sorted);
        sorted.mode = MX_FP8_ROWS_SORTED;
        sorted.sorted_ids = sorted_ids;
        sorted.num_tiles = num_tiles;
        sorted.block_m = plan.block_m;
        sorted.early_dependents =
            !block && mx_tile_is_sm90_decode(plan.tile_config) && plan.pairs <= kActQuantEarlyDependentsMaxPairs;
        if (block)
            st = mx_cuda_fp8_rows_quant_group(act, p->act_dtype, plan.rows_max, I, plan.ld_act, kFp8Block, &sorted,
                                              act_q, plan.ld_aq, act_scale, plan.act_blocks, stream);
        else
            st = mx_cuda_fp8_rows_quant_tensor(act, p->act_dtype, plan.rows_max, I, plan.ld_act, &sorted, nullptr,
                                               act_amax, act_q, plan.ld_aq, act_tensor_scale, stream);
        if (st.code != MX_OK)
            return st;
    }

    mx_fp8_gemm_args g2 = g1;
    g2.act_q = nullptr;
    g2.act_q_scale = nullptr;
    g2.a = act_q;
    g2.lda = plan.ld_aq;
    g2.a_sorted = 0;
    g2.a_scale = block ? act_scale : act_tensor_scale;
    g2.a_scale_ld = plan.act_blocks;
    g2.w = static_cast<const uint8_t *>(p->w2);
    g2.w_scale = p->w2_scale;
    g2.bias = p->w2_bias;
    g2.n_rows = H;
    g2.k = I;
    g2.out_cols = H;
    g2.scale_by_weight = !p->apply_router_weight_on_input;
    g2.out = y;
    g2.ldo = H;
    g2.vec_out = H % 4 == 0;
    g2.amax = nullptr;
    g2.k_splits = plan.down_splits;
    g2.k_split_len = plan.down_split_len;
    g2.out_split_stride = plan.y_rows * H;
    g2.y_by_sorted_row = plan.y_sorted;
    int32_t *split_count =
        plan_picks_splits(plan) ? reinterpret_cast<int32_t *>(ws + plan.off_split_count) : nullptr;
    g2.split_count = split_count;
    g2.split_exact = plan.split_exact;
    st = sm90 ? mx_cuda_grouped_gemm_fp8_sm90(&g2, MX_GEMM_DOWN, p->quant, plan.tile_config, p->num_local_experts,
                                              plan.tiles_max, stream)
              : mx_cuda_grouped_gemm_fp8(&g2, MX_GEMM_DOWN, p->quant, plan.tile_config, aligned2, plan.tiles_max,
                                         stream);
    if (st.code != MX_OK)
        return st;

    return mx_cuda_moe_sum(y, plan.y_sorted ? pair_rows : nullptr, plan.down_splits, split_count, plan.y_rows * H,
                           p->topk_ids,
                           p->expert_map, M, p->top_k, H, p->global_num_experts, p->num_local_experts, p->act_dtype,
                           p->output, stream);
}
