/* The whole decode forward in one launch: routing, GEMM1 with its
 * activation, GEMM2 and the top-k sum as one cooperative kernel with one
 * grid barrier, in place of the pipeline's 4-7 launches (experts.cu,
 * experts_fp8.cu). Each of those launches costs 2-5 us of fixed latency on
 * the device and ~5 us of host time; at one token the forward is mostly
 * that and the weight stream.
 *
 * One CTA of 16 warps per SM, every CTA resident (cooperative launch):
 *   0. every CTA routes the tokens itself (route_token.cuh, a warp per
 *      token; CTA 0 alone writes topk_weights / topk_ids) or reads the
 *      caller's ids, and maps them to local slots (slots of other ranks and
 *      out-of-range ids contribute nothing)            (decode_fused.cuh);
 *   1. the x rows into shared memory (FP8: quantized as the x quantizers
 *      do; apply_router_weight_on_input: times the rounded weight); 16-bit
 *      without that weight and FP8 block-scaled: by the warps phase 0
 *      leaves idle, beside it;
 *   2. GEMM1 and the activation; act, rounded to T, to the workspace (per
 *      tensor FP8: each CTA's act amax too);
 *   3. one grid barrier; each CTA arrives, then prefetches its first GEMM2
 *      weight rows into L2 (so the weight stream runs on through the
 *      barrier), then waits. Arriving after the prefetch, the barrier
 *      ended 3.0 / 4.4 us after the last CTA's GEMM1 at qwen3moe / gpt-oss
 *      bf16 M = 1 (1.3 at Mixtral, which prefetches nothing); arriving
 *      first: gpt-oss M = 1 / 2 -2.6 / -1.6%, qwen3moe fp8_block / fp8_tensor
 *      M = 1 -2.5 / -1.4% (H200, 2026-11-28,
 *      logs/2026-11-28-nvidia-h200-ab-fused-barrier-arrive.txt);
 *   4. act into shared memory (FP8: quantized as the act quantizers do);
 *   5. GEMM2; then out[t, h] = sum over the local slots in slot order of
 *      (y + b2) * w, float32, rounded once (moe_sum's order).
 * 16-bit weights, M <= 2 (decode_fused_16bit.cuh): a warp per (slot, act
 * column) or two (slot, row) items, dot products on the CUDA cores, 16
 * bytes a lane per step (packed weights: 8 lanes an item, 4 consecutive
 * items a warp; GEMM2 also 16 lanes an item, 2 consecutive items a warp).
 * FP8, M = 1 (decode_fused_fp8.cuh): 16-row units on tensor cores
 * (m16n8k32 e4m3, the token as column 0), K split over warps.
 *
 * Where it is taken (fused_usable): bfloat16 / float16 activations,
 * 16-byte rows and bases, its shared memory within kMaxSmem, a
 * device of compute capability 9.0 or later that launches cooperatively;
 * 16-bit weights at M <= 2 with at most kMax16BitPairs (token, slot)
 * pairs; FP8 at M = 1 with gate-then-up rows, H and I multiples of 128,
 * H <= kFp8MaxHidden. Measured on an H100 against the
 * pipeline (benchmarks/NOTES.md "One launch at decode"): qwen3moe M = 1
 * bf16 -10%, fp8_block -14%, fp8_tensor -1%; gpt-oss bf16 -6%, Mixtral
 * bf16 -2%; the host time of a call about halved. Where it lost it is not
 * taken: M >= 4, FP8 at M = 2 and at H >= 4096, 16-bit past 8 pairs
 * (qwen3moe bf16 M = 2, 16 pairs: the pipeline -3.0% on an H100, three
 * rounds, -6.4% on an H200, one; gpt-oss M = 2, 8 pairs: the one launch
 * -4.0%; H100, 2026-11-28,
 * logs/2026-11-28-nvidia-h100-ab-decode-fused-stage.txt). Workspace: act
 * [local slots, I] in T, then kMaxCtas floats of act amax partials. */
#include <cooperative_groups.h>
#include <string.h>

#include <type_traits>
#include <utility>

#include "decode_fused.cuh"
#include "decode_fused_16bit.cuh"
#include "decode_fused_fp8.cuh"

namespace cg = cooperative_groups;

namespace {

template <typename T, int Q> __global__ void __launch_bounds__(kThreads, 1) decode_fused_kernel(const fused_args a)
{
    extern __shared__ __align__(16) uint8_t fused_smem[];
    fused_head &hd = *reinterpret_cast<fused_head *>(fused_smem);
    uint8_t *ops = fused_smem + a.off_ops;
    float *ys = reinterpret_cast<float *>(fused_smem + a.off_ys);

    float *route_rows = reinterpret_cast<float *>(fused_smem + a.off_route);
    if constexpr (Q == Q_NONE) {
        /* x staged beside the routing unless it is scaled by the routing's weights */
        fused_route(a, hd, route_rows, [&](int first) {
            if (!a.weight_on_input)
                fused_stage_x<T>(a, hd, ops, first);
        });
        if (a.weight_on_input) {
            fused_stage_x<T>(a, hd, ops, 0);
            __syncthreads();
        }
        fused_gemm1<T>(a, hd, ops);
        int64_t h0, h1;
        cta_rows(a, h0, h1);
        cg::grid_group grid = cg::this_grid();
        cg::grid_group::arrival_token arrived = grid.barrier_arrive();
        fused_prefetch_w2(a, hd, h0, h1 - h0, a.I * static_cast<int64_t>(sizeof(T)));
        grid.barrier_wait(std::move(arrived));
        fused_stage_act<T>(a, hd, ops);
        fused_gemm2<T>(a, hd, ops, ys);
    } else {
        float *xsc = reinterpret_cast<float *>(fused_smem + a.off_xsc);
        float *asc = reinterpret_cast<float *>(fused_smem + a.off_asc);
        /* block-scaled x quantized beside the routing; per tensor needs the CTA's amax first */
        fused_route(a, hd, route_rows, [&](int first) {
            if constexpr (Q == Q_BLOCK)
                fused_stage_x_fp8_block<T>(a, ops, xsc, first);
        });
        if constexpr (Q != Q_BLOCK)
            fused_stage_x_fp8_tensor<T>(a, hd, ops);
        fused_gemm1_fp8<T, Q>(a, hd, ops, xsc, ys);
        cg::grid_group grid = cg::this_grid();
        cg::grid_group::arrival_token arrived = grid.barrier_arrive();
        fused_prefetch_w2(a, hd, 16 * static_cast<int64_t>(blockIdx.x), blockIdx.x < a.H / 16 ? 16 : 0, a.I);
        grid.barrier_wait(std::move(arrived));
        fused_stage_act_fp8<T, Q>(a, hd, ops, asc);
        fused_gemm2_fp8<T, Q>(a, hd, ops, asc, ys);
    }
}

struct fused_layout {
    size_t off_ops, off_route, off_ys, off_xsc, off_asc, smem;
    int64_t rows_max;
};

/* Shared memory of a launch on grid CTAs: the head, x or act rows, the
 * routing warps' rows, GEMM2's dot products (16-bit) or the warps'
 * partial sums (FP8), the FP8 block scales of x and act; 0 when that
 * exceeds kMaxSmem. */
size_t fused_plan(const mx_experts_problem *p, int grid, fused_layout *l)
{
    const bool fp8 = p->quant != MX_QUANT_NONE;
    const int64_t M = p->num_tokens, pairs = M * p->top_k;
    const int64_t es = fp8 ? 1 : static_cast<int64_t>(mx_dtype_size(p->act_dtype));
    l->rows_max = (p->hidden_size + grid - 1) / grid;
    int64_t ops = M * p->hidden_size * es;
    if (pairs * p->intermediate_size * es > ops)
        ops = pairs * p->intermediate_size * es;
    size_t at = 0;
    mx_ws_take(&at, sizeof(fused_head));
    l->off_ops = mx_ws_take(&at, static_cast<size_t>(ops));
    l->off_route = mx_ws_take(&at, p->routing ? M * route_warp_bytes(p->routing->num_experts) : 0);
    l->off_ys = mx_ws_take(&at, fp8 ? sizeof(float) * 16 * kWarps
                                    : sizeof(float) * static_cast<size_t>(pairs * l->rows_max));
    l->off_xsc = mx_ws_take(&at, fp8 ? sizeof(float) * static_cast<size_t>(p->hidden_size / kFp8Block) : 0);
    l->off_asc =
        mx_ws_take(&at, fp8 ? sizeof(float) * static_cast<size_t>(pairs * p->intermediate_size / kFp8Block) : 0);
    l->smem = at;
    return at <= kMaxSmem ? at : 0;
}

/* Cooperative launches on compute capability 9.0 or later */
bool cooperative_device()
{
    static std::atomic<int> state[64];
    return mx_device_property(state, [](int device) {
        int coop = 0, major = 0;
        return cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device) == cudaSuccess && coop &&
               cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
               major >= 9;
    });
}

/* CTAs of the launch: one per SM of the current device (0 on error) */
int fused_grid()
{
    static std::atomic<int> cache[64];
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    std::atomic<int> &slot = cache[device & 63];
    const int known = slot.load(std::memory_order_relaxed);
    if (known > 0)
        return known;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    if (sms > kMaxCtas)
        sms = kMaxCtas;
    slot.store(sms, std::memory_order_relaxed);
    return sms;
}

template <typename T, int Q> mx_status launch(const fused_args &args, size_t smem, int grid, cudaStream_t stream)
{
    static std::atomic<unsigned long long> configured{0};
    static const mx_kernel_name name("decode_fused_kernel<%s, %s>",
                                     std::is_same<T, __half>::value ? "float16" : "bfloat16",
                                     Q == Q_NONE ? "16-bit" : Q == Q_TENSOR ? "fp8 per tensor" : "fp8 block");
    mx_status st = mx_opt_in_smem(decode_fused_kernel<T, Q>, kMaxSmem, configured, name.text);
    if (st.code != MX_OK)
        return st;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return mx_check_call(cudaLaunchKernelEx(&cfg, decode_fused_kernel<T, Q>, args), name.text);
}

std::atomic<int> fused_enabled{1};

/* Whether p fits the fused kernel (quant, M, shape, alignment, routing,
 * device); then grid and the shared-memory layout of its launch. */
bool fused_usable(const mx_experts_problem *p, int *grid, fused_layout *l)
{
    const int64_t M = p->num_tokens, H = p->hidden_size, I = p->intermediate_size;
    if (!fused_enabled.load(std::memory_order_relaxed) || M < 1 || M > kMaxTokens || M * p->top_k > kMaxPairs)
        return false;
    if (p->act_dtype != MX_BF16 && p->act_dtype != MX_F16)
        return false;
    if (H % 8 != 0 || I % 8 != 0 || !mx_aligned16(p->hidden_states) || !mx_aligned16(p->w13) || !mx_aligned16(p->w2))
        return false;
    if (p->quant == MX_QUANT_NONE && M * p->top_k > kMax16BitPairs)
        return false;
    /* FP8: one token, gated (gate rows then up rows), whole 128-wide blocks, at most 16 slots (a warp each),
     * H <= kFp8MaxHidden: the FP8 path won at qwen3moe's H = 2048 (-14% fp8_block, -1% fp8_tensor at
     * M = 1) and lost at Mixtral's 4096 and DeepSeek-V3's 7168 (+1..13%; H100, benchmarks/NOTES.md
     * "One launch at decode") */
    if (p->quant != MX_QUANT_NONE &&
        (M != 1 || !p->is_act_and_mul || p->activation == MX_ACT_SWIGLUOAI || p->apply_router_weight_on_input ||
         H % kFp8Block != 0 || I % kFp8Block != 0 || H > kFp8MaxHidden || p->top_k > kWarps || !p->w13_scale ||
         !p->w2_scale))
        return false;
    const mx_routing_problem *r = p->routing;
    mx_status st;
    /* routing the pipeline would refuse: let it say why */
    if (r && (route_check(r, &st) || r->num_tokens != M || r->top_k != p->top_k ||
              r->num_experts != p->global_num_experts || r->topk_ids != p->topk_ids ||
              r->topk_weights != p->topk_weights))
        return false;
    if (!cooperative_device())
        return false;
    *grid = fused_grid();
    return *grid > 0 && fused_plan(p, *grid, l) > 0;
}

} /* namespace */

extern "C" int mx_cuda_set_decode_fused(int enabled)
{
    return fused_enabled.exchange(enabled ? 1 : 0);
}

extern "C" size_t mx_cuda_decode_fused_workspace_bytes(const mx_experts_problem *p)
{
    size_t at = 0;
    mx_ws_take(&at, mx_dtype_size(p->act_dtype) * static_cast<size_t>(p->num_tokens * p->top_k * p->intermediate_size));
    mx_ws_take(&at, sizeof(float) * kMaxCtas);
    return at;
}

extern "C" int mx_cuda_decode_fused(const mx_experts_problem *p, void *workspace, cudaStream_t stream,
                                    mx_status *st)
{
    int grid = 0;
    fused_layout l;
    if (!fused_usable(p, &grid, &l))
        return 0;
    fused_args a;
    memset(&a, 0, sizeof a);
    a.M = p->num_tokens;
    a.H = p->hidden_size;
    a.I = p->intermediate_size;
    a.n1 = p->is_act_and_mul ? 2 * a.I : a.I;
    a.E_local = p->num_local_experts;
    a.E_global = p->global_num_experts;
    a.top_k = p->top_k;
    a.kind = !p->is_act_and_mul                  ? MX_GEMM_UP
           : p->activation == MX_ACT_SWIGLUOAI ? MX_GEMM_GATE_UP_INTERLEAVED
                                               : MX_GEMM_GATE_UP;
    a.activation = p->activation;
    a.weight_on_input = p->apply_router_weight_on_input;
    a.alpha = p->swiglu_alpha;
    a.limit = p->swiglu_limit;
    a.x = p->hidden_states;
    a.w13 = p->w13;
    a.w2 = p->w2;
    a.w_packed = p->weights_packed;
    a.b13 = p->w13_bias;
    a.b2 = p->w2_bias;
    a.topk_weights = p->topk_weights;
    a.topk_ids = p->topk_ids;
    a.expert_map = p->expert_map;
    if (p->routing) {
        a.routed = 1;
        a.routing = *p->routing;
        a.route_epl = route_experts_per_lane(p->routing->num_experts);
    }
    a.w13_scale = p->w13_scale;
    a.w2_scale = p->w2_scale;
    a.out = p->output;
    size_t at = 0;
    unsigned char *ws = static_cast<unsigned char *>(workspace);
    a.act = ws + mx_ws_take(&at, mx_dtype_size(p->act_dtype) * static_cast<size_t>(a.M * a.top_k * a.I));
    a.amax_parts = reinterpret_cast<float *>(ws + mx_ws_take(&at, sizeof(float) * kMaxCtas));
    a.off_ops = l.off_ops;
    a.off_route = l.off_route;
    a.off_ys = l.off_ys;
    a.off_xsc = l.off_xsc;
    a.off_asc = l.off_asc;
    a.rows_max = l.rows_max;
    const bool bf16 = p->act_dtype == MX_BF16;
    switch (p->quant) {
    case MX_QUANT_NONE:
        *st = bf16 ? launch<__nv_bfloat16, Q_NONE>(a, l.smem, grid, stream)
                   : launch<__half, Q_NONE>(a, l.smem, grid, stream);
        break;
    case MX_QUANT_FP8_TENSOR:
        *st = bf16 ? launch<__nv_bfloat16, Q_TENSOR>(a, l.smem, grid, stream)
                   : launch<__half, Q_TENSOR>(a, l.smem, grid, stream);
        break;
    default:
        *st = bf16 ? launch<__nv_bfloat16, Q_BLOCK>(a, l.smem, grid, stream)
                   : launch<__half, Q_BLOCK>(a, l.smem, grid, stream);
        break;
    }
    return 1;
}
