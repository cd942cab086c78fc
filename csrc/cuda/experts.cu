/* mx_cuda_experts: the fused-MoE expert computation on the GPU
 * (numerics.md "Experts"; pipeline overview in experts.cuh).
 *
 * Operands (abi.h mx_experts_problem, contiguous row-major, act dtype =
 * bfloat16 / float16 on tensor cores, float32 on the SIMT path):
 *   x [M, H], w13 [E_local, N1, H] (N1 = 2I gated, I not), w2 [E_local, H, I],
 *   w13_bias [E_local, N1], w2_bias [E_local, H], topk_weights f32 [M, k],
 *   topk_ids i32 [M, k], expert_map i32 [E_global] -> out [M, H].
 *
 * At one or two tokens one launch does it all where it fits
 * (decode_fused.cu; FP8 tries it in mx_cuda_experts_fp8). Otherwise
 * launches, in stream order (no host synchronization, no allocation):
 *   0. route_kernel            only when the engine routes (p->routing) and M > 16
 *   1. moe_align_kernel        pairs -> expert segments padded to block_m, tile table
 *                              (route_align_kernel: routing and this in one launch, M <= 16)
 *   2. moe_scale_input_kernel  only with apply_router_weight_on_input
 *   3. GEMM1 over (m tiles, n tiles of I): act = act(x[token] @ w13[e].T + b13) in act dtype
 *      (the Hopper kernels read x[token] themselves)
 *   4. GEMM2 over (m tiles, n tiles of H[, k slices]): y[pair] = (act @ w2[e].T + b2) * w, float32
 *   5. moe_sum_kernel          out[t] = sum_j y[t, j], rounded once
 * Grids are sized from the worst case (tiles_max below) and surplus CTAs exit
 * after reading num_tiles, so nothing is read back to the host.
 *
 * Workspace (each piece 256-byte aligned), rows_max = tiles_max * block_m,
 * tiles_max = floor(M k / block_m) + min(E_local, M k):
 *   align            int32 [max(2, chunks) E_local]  moe_align's counters (moe_align.cu)
 *   num_tiles        int32 [2]           tiles in use; the persistent Hopper GEMMs' unit counter
 *   tile_expert      int32 [tiles_max]
 *   sorted_ids       int32 [rows_max]
 *   x_scaled         act   [M, H]        only with apply_router_weight_on_input
 *   act              act   [rows_max, ld_act], ld_act = I rounded up to 8 (16-byte rows)
 *   y                f32   [down_splits, M k, H]   (down_splits > 1: split-K; the persistent
 *                                                     Hopper GEMM2 picks up to down_splits)
 *   split_count      int32 [1]           that pick (only then)
 * A worked size: M=16384, k=8, H=2048, I=768, E=128 (bf16): y 1 GiB, act 226 MiB. */
#include <algorithm>
#include <atomic>

#include "common.cuh"
#include "experts.cuh"
#include "gemm_configs.cuh"
#include "grouped_gemm_sm90.cuh"

namespace {

typedef struct experts_plan {
    int tile_config; /* mx_tile_config; ignored for float32 */
    int block_m;
    int64_t pairs, tiles_max, rows_max, ld_act;
    int down_splits;          /* GEMM2 split-K slices (1 = none; the persistent Hopper kernel: at most) */
    int64_t down_split_len;
    int split_exact;          /* the persistent kernel takes exactly down_splits (mx_cuda_set_sm90_down_splits) */
    size_t off_align, off_num_tiles, off_tile_expert, off_sorted_ids, off_x_scaled, off_act, off_y, off_split_count;
    size_t total_bytes;
} experts_plan;

/* the persistent Hopper GEMM2 picks its slice count on the device (moe_sum reads it) */
inline bool plan_picks_splits(const experts_plan &plan)
{
    return mx_tile_sm90_takes_slices(plan.tile_config) && plan.down_splits > 1;
}

/* x copied to the workspace: packed weights take the Hopper kernels only,
 * whose TMA loads need x 16-byte aligned */
bool x_copied(const mx_experts_problem *p)
{
    return p->weights_packed && !p->apply_router_weight_on_input && !mx_aligned16(p->hidden_states);
}

/* x scaled by the router weight, or copied, into the workspace */
bool x_staged(const mx_experts_problem *p)
{
    return p->apply_router_weight_on_input || x_copied(p);
}

/* tma: the operands allow the Hopper kernels' TMA loads (see tma_usable) */
void make_plan(const mx_experts_problem *p, int tma, experts_plan *plan)
{
    const int64_t pairs = p->num_tokens * p->top_k;
    const int64_t local = p->num_local_experts;
    plan->tile_config = mx_select_tile_config(pairs, local);
    const int sm90 = mx_select_sm90_config(pairs, local, p->hidden_size, p->intermediate_size,
                                           p->is_act_and_mul && p->activation == MX_ACT_SWIGLUOAI);
    if (p->act_dtype != MX_F32 && sm90 >= 0 && tma && mx_cuda_sm90_gemm_available())
        plan->tile_config = sm90;
    plan->block_m = p->act_dtype == MX_F32 ? MX_F32_BLOCK_M : mx_tile_block_m(plan->tile_config);
    plan->pairs = pairs;
    plan->tiles_max = pairs / plan->block_m + (local < pairs ? local : pairs);
    plan->rows_max = plan->tiles_max * plan->block_m;
    plan->ld_act = (p->intermediate_size + 7) / 8 * 8;
    plan->split_exact = 0;
    if (p->act_dtype == MX_F32) {
        plan->down_splits = 1;
        plan->down_split_len = p->intermediate_size;
    } else {
        plan->down_splits = mx_select_down_splits(plan->tile_config, plan->tiles_max, p->hidden_size,
                                                  p->intermediate_size, &plan->down_split_len);
        if (mx_tile_sm90_takes_slices(plan->tile_config))
            mx_sm90_down_splits_setting(&plan->down_splits, &plan->split_exact, (p->intermediate_size + 63) / 64, 1);
    }
    const size_t es = mx_dtype_size(p->act_dtype);
    size_t at = 0;
    plan->off_align = mx_ws_take(&at, mx_moe_align_workspace_bytes(pairs, local));
    plan->off_num_tiles = mx_ws_take(&at, MX_MOE_ALIGN_NUM_TILES_BYTES);
    plan->off_tile_expert = mx_ws_take(&at, sizeof(int32_t) * plan->tiles_max);
    plan->off_sorted_ids = mx_ws_take(&at, sizeof(int32_t) * plan->rows_max);
    plan->off_x_scaled = mx_ws_take(&at, x_staged(p) ? es * p->num_tokens * p->hidden_size : 0);
    plan->off_act = mx_ws_take(&at, es * plan->rows_max * plan->ld_act);
    plan->off_y = mx_ws_take(&at, sizeof(float) * plan->down_splits * pairs * p->hidden_size);
    plan->off_split_count = mx_ws_take(&at, plan_picks_splits(*plan) ? sizeof(int32_t) : 0);
    plan->total_bytes = at;
}

/* TMA needs 16-byte row strides and bases: x (or its copy in the
 * workspace, x_staged), the weights and the workspace (act and y are
 * 256-byte aligned pieces of it). Otherwise the plan takes the mma.sync
 * configs. */
int tma_usable(const mx_experts_problem *p, const void *workspace)
{
    return p->hidden_size % 8 == 0 && p->intermediate_size % 8 == 0 &&
           (mx_aligned16(p->hidden_states) || x_staged(p)) && mx_aligned16(p->w13) && mx_aligned16(p->w2) &&
           mx_aligned16(workspace);
}

/* 0 => the problem is usable (st untouched); else st holds the error. */
int check_problem(const mx_experts_problem *p, const void *workspace, mx_status *st)
{
    if (p->act_dtype != MX_BF16 && p->act_dtype != MX_F16 && p->act_dtype != MX_F32) {
        *st = mx_status_fail(MX_ERR_NOT_IMPLEMENTED, "experts (CUDA): act_dtype %s; supported: bfloat16, "
                             "float16, float32", mx_dtype_name(p->act_dtype));
        return 1;
    }
    if (p->num_tokens < 0 || p->hidden_size < 1 || p->intermediate_size < 1 || p->num_local_experts < 1 ||
        p->global_num_experts < 1 || p->top_k < 1) {
        *st = mx_status_fail(MX_ERR_VALUE, "experts (CUDA): need M >= 0 and H, I, E_local, E_global, top_k >= 1 "
                             "(M=%lld H=%lld I=%lld E_local=%lld E_global=%lld k=%d)",
                             (long long)p->num_tokens, (long long)p->hidden_size, (long long)p->intermediate_size,
                             (long long)p->num_local_experts, (long long)p->global_num_experts, p->top_k);
        return 1;
    }
    if (p->is_act_and_mul ? p->activation == MX_ACT_RELU2 : p->activation == MX_ACT_SWIGLUOAI) {
        *st = mx_status_fail(MX_ERR_VALUE, "experts (CUDA): activation %d is not available with is_act_and_mul=%d",
                             (int)p->activation, p->is_act_and_mul);
        return 1;
    }
    if (p->activation < MX_ACT_SILU || p->activation > MX_ACT_RELU2) {
        *st = mx_status_fail(MX_ERR_VALUE, "experts (CUDA): unknown activation %d", (int)p->activation);
        return 1;
    }
    if (p->apply_router_weight_on_input && p->top_k != 1) {
        *st = mx_status_fail(MX_ERR_VALUE, "experts (CUDA): apply_router_weight_on_input needs top_k == 1, got %d",
                             p->top_k);
        return 1;
    }
    if (!p->hidden_states || !p->w13 || !p->w2 || !p->topk_weights || !p->topk_ids || !p->output || !workspace) {
        *st = mx_status_fail(MX_ERR_VALUE, "experts (CUDA): a required pointer (x, w13, w2, topk_weights, topk_ids, "
                             "output, workspace) is NULL");
        return 1;
    }
    if (p->weights_packed && !mx_cuda_sm90_gemm_available()) {
        *st = mx_status_fail(MX_ERR_NOT_IMPLEMENTED, "experts (CUDA): weights in the packed Hopper layout need a "
                             "device that runs the sm_90a kernels (call the layer's "
                             "process_weights_after_loading() on the device it runs on)");
        return 1;
    }
    if (p->weights_packed && (!mx_aligned16(p->w13) || !mx_aligned16(p->w2) || p->act_dtype == MX_F32)) {
        *st = mx_status_fail(MX_ERR_VALUE, "experts (CUDA): packed weights need 16-byte aligned w13 / w2 and "
                             "16-bit activations");
        return 1;
    }
    return 0;
}

} /* namespace */

/* 0: the persistent Hopper GEMM2 picks its slices; n >= 1: exactly n where it can (tests) */
static std::atomic<int> sm90_down_splits_set{0};

extern "C" int mx_cuda_set_sm90_down_splits(int n)
{
    return sm90_down_splits_set.exchange(n > 0 ? n : 0);
}

extern "C" void mx_cuda_sm90_down_split_rule(int units, int slots, int max_splits, int k_blocks, int align, int *count,
                                             int *len)
{
    const mx_sm90_split split = mx_sm90_down_split(units, slots, max_splits, k_blocks, align);
    *count = split.count;
    *len = split.len;
}

extern "C" void mx_sm90_down_splits_setting(int *splits, int *exact, int64_t k_blocks, int align)
{
    const int n = sm90_down_splits_set.load(std::memory_order_relaxed);
    if (n < 1)
        return;
    *splits = mx_sm90_down_split_exact(static_cast<int>(k_blocks), n < kSm90DownMaxSplits ? n : kSm90DownMaxSplits,
                                       align).count;
    *exact = *splits > 1;
}

extern "C" size_t mx_cuda_experts_workspace_bytes(const mx_experts_problem *p)
{
    if (p->num_tokens <= 0 || p->top_k < 1 || p->num_local_experts < 1)
        return 0;
    const size_t fused = mx_cuda_decode_fused_workspace_bytes(p);
    if (p->quant != MX_QUANT_NONE)
        return std::max(fused, mx_cuda_experts_fp8_workspace_bytes(p));
    experts_plan with_tma, without;
    make_plan(p, 1, &with_tma);
    make_plan(p, 0, &without);
    return std::max({fused, with_tma.total_bytes, without.total_bytes});
}

extern "C" mx_status mx_cuda_experts(const mx_experts_problem *p, void *workspace, void *stream_ptr)
{
    if (p->num_tokens == 0)
        return mx_status_ok();
    mx_status st;
    if (check_problem(p, workspace, &st))
        return st;
    if (p->quant != MX_QUANT_NONE)
        return mx_cuda_experts_fp8(p, workspace, static_cast<cudaStream_t>(stream_ptr));
    if (mx_cuda_decode_fused(p, workspace, static_cast<cudaStream_t>(stream_ptr), &st))
        return st;

    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    experts_plan plan;
    make_plan(p, tma_usable(p, workspace), &plan);
    if (plan.rows_max > 0x7fffffff || plan.pairs > 0x7fffffff) /* the FP8 pipeline checks its own plan */
        return mx_status_fail(MX_ERR_VALUE, "experts (CUDA): M * top_k = %lld pairs exceed int32 indexing",
                              (long long)plan.pairs);
    unsigned char *ws = static_cast<unsigned char *>(workspace);
    int32_t *align_ws = reinterpret_cast<int32_t *>(ws + plan.off_align);
    int32_t *num_tiles = reinterpret_cast<int32_t *>(ws + plan.off_num_tiles);
    int32_t *tile_expert = reinterpret_cast<int32_t *>(ws + plan.off_tile_expert);
    int32_t *sorted_ids = reinterpret_cast<int32_t *>(ws + plan.off_sorted_ids);
    void *x_scaled = ws + plan.off_x_scaled;
    void *act = ws + plan.off_act;
    float *y = reinterpret_cast<float *>(ws + plan.off_y);
    const int64_t H = p->hidden_size, I = p->intermediate_size;

    st = mx_cuda_route_and_align(p, plan.block_m, align_ws, sorted_ids, tile_expert, num_tiles, nullptr, stream);
    if (st.code != MX_OK)
        return st;

    const void *x = p->hidden_states;
    if (p->apply_router_weight_on_input) {
        st = mx_cuda_moe_scale_input(x, p->topk_weights, p->num_tokens, H, p->top_k, p->act_dtype, x_scaled, stream);
        if (st.code != MX_OK)
            return st;
        x = x_scaled;
    } else if (x_copied(p)) {
        st = mx_check_call(cudaMemcpyAsync(x_scaled, x, mx_dtype_size(p->act_dtype) * p->num_tokens * H,
                                           cudaMemcpyDeviceToDevice, stream),
                           "experts (CUDA): x copy");
        if (st.code != MX_OK)
            return st;
        x = x_scaled;
    }

    mx_gemm_args g1;
    g1.a = x;
    g1.lda = H;
    g1.w = p->w13;
    g1.w_packed = p->weights_packed;
    g1.bias = p->w13_bias;
    g1.n_rows = p->is_act_and_mul ? 2 * I : I;
    g1.k = H;
    g1.out_cols = I;
    g1.sorted_ids = sorted_ids;
    g1.tile_expert = tile_expert;
    g1.num_tiles = num_tiles;
    g1.topk_weights = p->topk_weights;
    g1.top_k = p->top_k;
    g1.activation = p->activation;
    g1.swiglu_alpha = p->swiglu_alpha;
    g1.swiglu_limit = p->swiglu_limit;
    g1.scale_by_weight = 0;
    g1.out = act;
    g1.ldo = plan.ld_act;
    g1.m_tile_base = 0;
    g1.k_splits = 1;
    g1.k_split_len = H;
    g1.out_split_stride = 0;
    g1.rows = 0;
    g1.pairs = plan.pairs;
    g1.y_by_sorted_row = 0;
    g1.split_count = nullptr;
    g1.split_exact = 0;
    g1.units_taken = mx_sm90_units_counter(num_tiles, plan.pairs, p->num_local_experts, false);
    const mx_gemm_kind kind1 = !p->is_act_and_mul                  ? MX_GEMM_UP
                             : p->activation == MX_ACT_SWIGLUOAI ? MX_GEMM_GATE_UP_INTERLEAVED
                                                                 : MX_GEMM_GATE_UP;

    mx_gemm_args g2 = g1;
    g2.a = act;
    g2.lda = plan.ld_act;
    g2.w = p->w2;
    g2.bias = p->w2_bias;
    g2.n_rows = H;
    g2.k = I;
    g2.out_cols = H;
    g2.scale_by_weight = !p->apply_router_weight_on_input;
    g2.out = y;
    g2.ldo = H;
    g2.k_splits = plan.down_splits;
    g2.k_split_len = plan.down_split_len;
    g2.out_split_stride = plan.pairs * H;
    int32_t *split_count = plan_picks_splits(plan) ? reinterpret_cast<int32_t *>(ws + plan.off_split_count) : nullptr;
    g2.split_count = split_count;
    g2.split_exact = plan.split_exact;

    const int tile_config = plan.tile_config;
    /* 16-byte loads need 16-byte rows and bases (act rows always are). */
    const int aligned1 = H % 8 == 0 && mx_aligned16(x) && mx_aligned16(p->w13);
    const int aligned2 = I % 8 == 0 && mx_aligned16(p->w2);
    if (mx_tile_is_sm90_decode(tile_config)) {
        st = mx_cuda_grouped_gemm_sm90_decode(&g1, nullptr, kind1, p->act_dtype, MX_QUANT_NONE, tile_config,
                                              p->num_local_experts, plan.tiles_max, stream);
        if (st.code == MX_OK)
            st = mx_cuda_grouped_gemm_sm90_decode(&g2, nullptr, MX_GEMM_DOWN, p->act_dtype, MX_QUANT_NONE, tile_config,
                                                  p->num_local_experts, plan.tiles_max, stream);
    } else if (mx_tile_is_sm90(tile_config)) {
        const auto gemm = p->act_dtype == MX_BF16 ? mx_cuda_grouped_gemm_bf16_sm90 : mx_cuda_grouped_gemm_fp16_sm90;
        st = gemm(&g1, kind1, tile_config, p->num_local_experts, plan.tiles_max, stream);
        if (st.code == MX_OK)
            st = gemm(&g2, MX_GEMM_DOWN, tile_config, p->num_local_experts, plan.tiles_max, stream);
    } else switch (p->act_dtype) {
    case MX_BF16:
        st = mx_cuda_grouped_gemm_bf16(&g1, kind1, tile_config, aligned1, plan.tiles_max, stream);
        if (st.code == MX_OK)
            st = mx_cuda_grouped_gemm_bf16(&g2, MX_GEMM_DOWN, tile_config, aligned2, plan.tiles_max, stream);
        break;
    case MX_F16:
        st = mx_cuda_grouped_gemm_fp16(&g1, kind1, tile_config, aligned1, plan.tiles_max, stream);
        if (st.code == MX_OK)
            st = mx_cuda_grouped_gemm_fp16(&g2, MX_GEMM_DOWN, tile_config, aligned2, plan.tiles_max, stream);
        break;
    default:
        st = mx_cuda_grouped_gemm_f32(&g1, kind1, plan.tiles_max, stream);
        if (st.code == MX_OK)
            st = mx_cuda_grouped_gemm_f32(&g2, MX_GEMM_DOWN, plan.tiles_max, stream);
        break;
    }
    if (st.code != MX_OK)
        return st;

    return mx_cuda_moe_sum(y, nullptr, plan.down_splits, split_count, plan.pairs * H, p->topk_ids, p->expert_map,
                           p->num_tokens, p->top_k, H, p->global_num_experts, p->num_local_experts, p->act_dtype,
                           p->output, stream);
}
