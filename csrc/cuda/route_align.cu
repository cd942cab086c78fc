/* The first stage of the expert pipelines: routing (when the engine routes,
 * mx_experts_problem.routing) and the sort of the (token, slot) pairs by
 * expert (moe_align.cuh).
 *
 * At decode both are tiny and each launch costs more than its work, so up
 * to kFusedMaxTokens tokens they run as one kernel of one block of one warp
 * per token: warp t routes token t (route_token.cuh), the block
 * synchronizes once, and warp 0 sorts (moe_align_warp, reading the ids just
 * written). Past 128 experts, where route_token_split.cuh gives the same
 * bits and 32 / (E / 32) tokens fit, E / 32 warps route each token
 * (route_align_split_kernel). Larger M: the two launches (route_kernel over
 * many blocks, then moe_align_kernel).
 *
 * Shared memory of the fused kernel: M x 4 x E floats of routing rows, then
 * moe_align's 2 x E_local counters, then a copy of the M x k ids, which the
 * sort reads instead of global memory. Over 48 KB it opts in once per device
 * (E = 256, M = 32: 130 KB); past kFusedMaxSmem the two launches run.
 *
 * The FP8 pipeline hands the fused kernel its quantization of x
 * (mx_fp8_x_quant) up to kFusedQuantMaxElements elements of x: while warp 0
 * sorts, the block's other warps (kFusedQuantWarps - 1 of them; the split
 * kernel's E / 32 x M - 1 >= 4) quantize the rows of tokens with a local
 * expert with the row quantizers' code (fp8_rows.cuh), so the bits are
 * theirs. That saves the one (block scales) or two (per tensor) launches of
 * fp8_quant.cu, ~4 and ~5 us of the critical path at M = 1 (H100,
 * 2026-11-25, logs/2026-11-25-nvidia-h100-e3c8c86-decode-profile.txt). One
 * block only streams x fast enough while x is small: with 64K elements and
 * one load in flight per lane the launch took 30-40 us longer (Mixtral
 * fp8_block M = 8, qwen3moe fp8_tensor M = 32, DeepSeek-V3 fp8_tensor M = 8;
 * logs/2026-11-25-nvidia-h100-ab-x-quant-in-routing.txt). */
#include "experts.cuh"
#include "fp8_rows.cuh"
#include "moe_align.cuh"
#include "route_token.cuh"
#include "route_token_split.cuh"

namespace {

constexpr int kFusedMaxTokens = 32;
constexpr size_t kFusedMaxSmem = 160 * 1024;
constexpr int kSplitRouting = -1; /* route_align_body's EPL for route_token_split: E / 32 warps a token */
constexpr int kFusedQuantWarps = 32; /* with x to quantize: warps of the one-warp-per-token kernel (warp 0 sorts,
                                       the others quantize) */
constexpr int kFusedQuantBatch = 4;  /* 4-element pieces a lane loads before using them */
constexpr int64_t kFusedQuantMaxElements = 16 * 1024; /* M x H up to which one block quantizes x */

/* x[at .. at + 4) in the quantization's dtype, as float32 */
__device__ __forceinline__ void fused_load4(const mx_fp8_x_quant &xq, int64_t at, float (&v)[4])
{
    if (xq.dtype == MX_BF16)
        load4(static_cast<const __nv_bfloat16 *>(xq.x) + at, v);
    else if (xq.dtype == MX_F16)
        load4(static_cast<const __half *>(xq.x) + at, v);
    else
        load4(static_cast<const float *>(xq.x) + at, v);
}

/* mx_cuda_fp8_quant_a by warps quant_warp = 0 .. quant_warps - 1 (block
 * warps 1 ..): the rows of tokens with a local expert (ids: the M x k ids
 * just routed). Block scales as group_quant_vec4_kernel (a warp per row
 * and 128-column group); per tensor as rows_amax_kernel +
 * rows_quant_tensor_kernel (the max over the warps' maxima meets at named
 * barrier 1, then the scale, and act_amax zeroed for GEMM1). A lane takes
 * kFusedQuantBatch 4-element pieces at a time, all loads first: one load in
 * flight per lane made the pass latency-bound (Mixtral fp8_block at M = 8:
 * the fused launch 3.9 -> 35.8 us; H100, 2026-11-25). */
__device__ void fused_quant_x(const mx_fp8_x_quant &xq, int64_t rows, int top_k, const int32_t *ids,
                              const int32_t *__restrict__ expert_map, int64_t global_experts, int64_t local_experts,
                              int quant_warp, int quant_warps, int lane)
{
    constexpr int B = kFusedQuantBatch;
    __shared__ float warp_amax[kFusedMaxTokens];
    mx_fp8_row_filter routed = {};
    routed.mode = MX_FP8_ROWS_ROUTED;
    routed.topk_ids = ids;
    routed.expert_map = expert_map;
    routed.top_k = top_k;
    routed.global_experts = global_experts;
    routed.local_experts = local_experts;
    /* bit t: token t has a local expert (rows <= kFusedMaxTokens = 32) */
    const uint32_t valid = __ballot_sync(0xffffffffu, lane < rows && row_valid(routed, lane));
    auto is_valid = [valid](int64_t row) { return ((valid >> row) & 1u) != 0; };
    const int64_t cols = xq.cols;
    float v[B][4];
    if (xq.quant == MX_QUANT_FP8_BLOCK) {
        /* units (row, group): this warp's B units u0 + quant_warps i of each round */
        const int64_t groups = (cols + 127) / 128, units = rows * groups;
        for (int64_t u0 = quant_warp; u0 < units; u0 += static_cast<int64_t>(B) * quant_warps) {
            float m[B];
#pragma unroll
            for (int i = 0; i < B; ++i) {
                const int64_t u = u0 + static_cast<int64_t>(i) * quant_warps, row = u / groups;
                const int64_t c = (u - row * groups) * 128 + 4 * lane;
                m[i] = 0.0f;
                if (u < units && c < cols && is_valid(row)) {
                    fused_load4(xq, row * xq.ldx + c, v[i]);
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        m[i] = mx_amax_step(m[i], v[i][e]);
                }
            }
#pragma unroll
            for (int i = 0; i < B; ++i) {
                const int64_t u = u0 + static_cast<int64_t>(i) * quant_warps, row = u / groups, g = u - row * groups;
                if (u >= units || !is_valid(row))
                    continue;
                const int64_t c = g * 128 + 4 * lane;
                const float s = mx_fp8_group_scale(mx_warp_max(m[i]));
                uint8_t *qr = xq.q + row * xq.ldq;
                if (c < cols)
                    store4(qr + c, encode4_divided(v[i], s));
                if (lane == 0)
                    xq.scales[row * xq.scale_ld + g] = s;
                if (g == groups - 1)
                    for (int64_t pad = cols + 4 * lane; pad < xq.ldq; pad += 128)
                        store4(qr + pad, 0u);
            }
        }
        return;
    }
    /* per tensor: the lane's pieces c = first + step i of each valid row */
    const int64_t first = 4 * (static_cast<int64_t>(quant_warp) * 32 + lane), step = 4 * 32 * static_cast<int64_t>(quant_warps);
    float m = 0.0f;
    for (int64_t row = 0; row < rows; ++row) {
        if (!is_valid(row))
            continue;
        for (int64_t c0 = first; c0 < cols; c0 += B * step) {
#pragma unroll
            for (int i = 0; i < B; ++i)
                if (c0 + i * step < cols)
                    fused_load4(xq, row * xq.ldx + c0 + i * step, v[i]);
#pragma unroll
            for (int i = 0; i < B; ++i)
                if (c0 + i * step < cols) {
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        m = mx_amax_step(m, v[i][e]);
                }
        }
    }
    m = mx_warp_max(m);
    if (lane == 0)
        warp_amax[quant_warp] = m;
    asm volatile("bar.sync 1, %0;\n" ::"r"(32 * quant_warps) : "memory");
    float amax = warp_amax[0];
    for (int w = 1; w < quant_warps; ++w)
        amax = mx_max_nan(amax, warp_amax[w]);
    const float s = mx_fp8_tensor_scale(amax), inv = __fdiv_rn(1.0f, s);
    if (quant_warp == 0 && lane == 0) {
        *xq.scales = s;
        *xq.act_amax = 0u;
    }
    for (int64_t row = 0; row < rows; ++row) {
        if (!is_valid(row))
            continue;
        for (int64_t c0 = first; c0 < xq.ldq; c0 += B * step) {
#pragma unroll
            for (int i = 0; i < B; ++i)
                if (c0 + i * step < cols)
                    fused_load4(xq, row * xq.ldx + c0 + i * step, v[i]);
#pragma unroll
            for (int i = 0; i < B; ++i) {
                const int64_t c = c0 + i * step;
                if (c < xq.ldq)
                    store4(xq.q + row * xq.ldq + c, c < cols ? encode4_scaled(v[i], inv) : 0u);
            }
        }
    }
}

/* The fused kernel's body: EPL = route_experts_per_lane(E) (a warp per
 * token; warps past M route nothing), or kSplitRouting (E / 32 warps per
 * token); then warp 0 sorts while the others quantize x when xq asks. */
template <int EPL>
__device__ __forceinline__ void route_align_body(const mx_routing_problem &r, const int32_t *__restrict__ expert_map,
                                                 int64_t local_experts, int block_m, int32_t *__restrict__ sorted_ids,
                                                 int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles,
                                                 const mx_fp8_x_quant &xq)
{
    extern __shared__ float route_align_smem[];
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    const size_t rows = 4 * static_cast<size_t>(r.num_experts);
    int32_t *counters = reinterpret_cast<int32_t *>(route_align_smem + r.num_tokens * rows);
    int32_t *ids = counters + 2 * local_experts; /* the sort reads the ids from here */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if constexpr (EPL == kSplitRouting) {
        const int W = static_cast<int>(r.num_experts / 32);
        route_token_split(r, warp / W, route_align_smem + (warp / W) * rows, warp % W, lane, ids);
    } else if (warp < r.num_tokens) {
        route_token<EPL>(r, warp, route_align_smem + warp * rows, lane, ids);
    }
    __syncthreads(); /* the ids in shared memory are complete */
    if (warp == 0)
        moe_align_warp(ids, expert_map, r.num_tokens * r.top_k, r.num_experts, local_experts, block_m, counters,
                       sorted_ids, tile_expert, num_tiles);
    else if (xq.quant != MX_QUANT_NONE)
        fused_quant_x(xq, r.num_tokens, r.top_k, ids, expert_map, r.num_experts, local_experts, warp - 1,
                      static_cast<int>(blockDim.x / 32) - 1, lane);
}

template <int EPL>
__global__ void __launch_bounds__(32 * kFusedMaxTokens, 1)
    route_align_kernel(const mx_routing_problem r, const int32_t *__restrict__ expert_map, int64_t local_experts,
                       int block_m, int32_t *__restrict__ sorted_ids, int32_t *__restrict__ tile_expert,
                       int32_t *__restrict__ num_tiles, const mx_fp8_x_quant xq)
{
    route_align_body<EPL>(r, expert_map, local_experts, block_m, sorted_ids, tile_expert, num_tiles, xq);
}

__global__ void __launch_bounds__(32 * kFusedMaxTokens, 1)
    route_align_split_kernel(const mx_routing_problem r, const int32_t *__restrict__ expert_map,
                             int64_t local_experts, int block_m, int32_t *__restrict__ sorted_ids,
                             int32_t *__restrict__ tile_expert, int32_t *__restrict__ num_tiles,
                             const mx_fp8_x_quant xq)
{
    route_align_body<kSplitRouting>(r, expert_map, local_experts, block_m, sorted_ids, tile_expert, num_tiles, xq);
}

/* Whether the fused kernel takes xq: 4-element rows, and x small enough
 * for one block (larger x streams faster through fp8_quant.cu's grids). */
bool fused_quant_usable(const mx_fp8_x_quant *xq, int64_t tokens)
{
    if (!xq || (xq->quant != MX_QUANT_FP8_TENSOR && xq->quant != MX_QUANT_FP8_BLOCK))
        return false;
    const int64_t es = xq->dtype == MX_F32 ? 4 : 2;
    return (xq->dtype == MX_BF16 || xq->dtype == MX_F16 || xq->dtype == MX_F32) && xq->cols % 4 == 0 &&
           xq->ldx % 4 == 0 && xq->ldq % 16 == 0 && reinterpret_cast<uintptr_t>(xq->x) % (4 * es) == 0 &&
           reinterpret_cast<uintptr_t>(xq->q) % 16 == 0 && tokens * xq->cols <= kFusedQuantMaxElements;
}

/* Launches one fused kernel (its shared-memory opt-in kept per kernel). */
template <auto Kernel>
mx_status launch_fused(const mx_experts_problem *p, int block_m, unsigned threads, size_t smem, int32_t *sorted_ids,
                       int32_t *tile_expert, int32_t *num_tiles, const mx_fp8_x_quant &xq, cudaStream_t stream)
{
    static std::atomic<unsigned long long> configured{0};
    if (smem > 48 * 1024) {
        const mx_status st = mx_opt_in_smem(Kernel, kFusedMaxSmem, configured, "route_align_kernel");
        if (st.code != MX_OK)
            return st;
    }
    return mx_check_call(mx_launch_after(Kernel, dim3(1), dim3(threads), smem, stream, *p->routing, p->expert_map,
                                         p->num_local_experts, block_m, sorted_ids, tile_expert, num_tiles, xq),
                         "route_align_kernel");
}

} /* namespace */

extern "C" mx_status mx_cuda_route_and_align(const mx_experts_problem *p, int block_m, int32_t *align_ws,
                                             int32_t *sorted_ids, int32_t *tile_expert, int32_t *num_tiles,
                                             const mx_fp8_x_quant *xq, int *x_quantized, cudaStream_t stream)
{
    if (x_quantized)
        *x_quantized = 0;
    const int64_t pairs = p->num_tokens * p->top_k;
    const mx_routing_problem *r = p->routing;
    if (r) {
        mx_status st;
        if (route_check(r, &st))
            return st;
        if (r->num_tokens != p->num_tokens || r->top_k != p->top_k || r->num_experts != p->global_num_experts ||
            r->topk_ids != p->topk_ids || r->topk_weights != p->topk_weights)
            return mx_status_fail(MX_ERR_VALUE, "route_and_align: the routing problem does not match the experts' "
                                  "(M, top_k, E, outputs)");
        const size_t smem = route_warp_bytes(r->num_experts) * static_cast<size_t>(r->num_tokens) +
                            sizeof(int32_t) * static_cast<size_t>(2 * p->num_local_experts + pairs);
        if (r->num_tokens <= kFusedMaxTokens && smem <= kFusedMaxSmem) {
            mx_fp8_x_quant quant = {};
            quant.quant = MX_QUANT_NONE;
            if (fused_quant_usable(xq, r->num_tokens))
                quant = *xq;
            /* more than 4 experts per lane: E / 32 warps per token where the arithmetic allows */
            const int64_t warps_per_token = r->num_experts / 32;
            if (r->num_experts > 128 && route_split_usable(r) && warps_per_token * r->num_tokens <= kFusedMaxTokens)
                st = launch_fused<route_align_split_kernel>(p, block_m,
                                                            static_cast<unsigned>(32 * warps_per_token * r->num_tokens),
                                                            smem, sorted_ids, tile_expert, num_tiles, quant, stream);
            else
                st = route_pick_experts_per_lane(r->num_experts, [&](auto epl) {
                    const int64_t warps = quant.quant == MX_QUANT_NONE || r->num_tokens > kFusedQuantWarps
                                              ? r->num_tokens
                                              : kFusedQuantWarps;
                    return launch_fused<route_align_kernel<decltype(epl)::value>>(
                        p, block_m, static_cast<unsigned>(32 * warps), smem, sorted_ids, tile_expert, num_tiles, quant,
                        stream);
                });
            if (st.code == MX_OK && x_quantized)
                *x_quantized = quant.quant != MX_QUANT_NONE;
            return st;
        }
        st = mx_cuda_route(r, stream);
        if (st.code != MX_OK)
            return st;
    }
    return mx_cuda_moe_align(p->topk_ids, p->expert_map, pairs, p->global_num_experts, p->num_local_experts, block_m,
                             align_ws, sorted_ids, tile_expert, num_tiles, stream);
}
