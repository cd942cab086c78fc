/* The whole decode forward in one launch, for one or two tokens with
 * 16-bit weights (Hopper): routing, GEMM1 with its activation, GEMM2 and
 * the top-k sum run as one cooperative kernel with one grid barrier, in
 * place of the pipeline's 4 launches (experts.cu). Each of those launches
 * costs 2-5 us of fixed latency on the device and ~5 us of host time; at
 * M = 1 the forward is mostly that and the weight stream.
 *
 * One CTA of 16 warps per SM, every CTA resident (cooperative launch):
 *   0. every CTA routes the tokens itself (route_token.cuh, a warp per
 *      token; CTA 0 alone writes topk_weights / topk_ids) or reads the
 *      caller's ids, and maps them to local slots (slots of other ranks and
 *      out-of-range ids contribute nothing);
 *   1. the x rows into shared memory (apply_router_weight_on_input: times
 *      the routing weight, rounded as moe_scale_input rounds);
 *   2. GEMM1: a warp per (local slot, act column), slots slowest: the
 *      column's two weight rows (gate and up, or two columns of a non-gated
 *      w13) dotted with the token's x row, 16 bytes a lane per step and
 *      kUnroll steps of both rows loaded before any is used, then a warp
 *      sum; lane 0 adds the bias, applies the activation and stores act,
 *      rounded to T, to the workspace;
 *   3. one grid barrier; before it each CTA prefetches its GEMM2 weight
 *      rows into L2 (bulk prefetches), so the stream runs on through it;
 *   4. act into shared memory;
 *   5. GEMM2: CTA b owns hidden rows [H b / G, H (b + 1) / G); its warps
 *      take (slot, row) items two at a time and leave each dot product in
 *      shared memory; then out[t, h] = sum over the slots in slot order of
 *      (y + b2) * w, float32, rounded once (moe_sum's order).
 * The dot products run on the CUDA cores (FMA in float32): at one or two
 * tokens the forward is its weight stream, and a warp per row pair streams
 * without a tile table, TMA descriptors or padded tiles.
 *
 * Where it is taken (mx_cuda_decode_fused_usable): bfloat16 / float16
 * weights, M <= kMaxTokens, 16-byte rows and bases, its shared memory
 * within kMaxSmem, a device of compute capability 9.0 or later that
 * launches cooperatively. Measured on an H100 against the pipeline
 * (benchmarks/NOTES.md "One launch at decode"): qwen3moe bf16 M = 1 -9%,
 * gpt-oss -6%, Mixtral -1%, host time per call about halved; FP8 weights
 * (their fp8 -> float conversions on the CUDA cores) and M >= 4 lost, so
 * those stay on the pipeline. Workspace: act [local slots, I] in T. */
#include <cooperative_groups.h>
#include <string.h>

#include <type_traits>

#include "common.cuh"
#include "experts.cuh"
#include "route_token.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTokens = 2;
constexpr int kMaxPairs = 64;
constexpr int kChunk = 512;                       /* bytes of a row per warp step: 16 a lane */
constexpr int kUnroll = 4;                        /* steps of each row in flight */
constexpr size_t kMaxSmem = 200 * 1024;
constexpr long long kPrefetchPerCta = 192 * 1024; /* GEMM2 bytes a CTA prefetches into L2 */

struct fused_args {
    int64_t M, H, I, n1, E_local, E_global;
    int top_k, kind, activation, weight_on_input, route_epl, routed;
    float alpha, limit;
    const void *x, *w13, *w2, *b13, *b2;
    const float *topk_weights;
    const int32_t *topk_ids, *expert_map;
    mx_routing_problem routing; /* routed: its outputs are topk_weights / topk_ids */
    void *out, *act;
    size_t off_ops, off_ys;     /* shared memory: x or act rows, GEMM2's dot products */
    int64_t rows_max;           /* GEMM2 rows of a CTA, at most */
};

struct fused_head {
    int32_t ids[kMaxPairs];
    float weights[kMaxPairs];
    int32_t slot_e[kMaxPairs]; /* local expert of pair p, or -1 */
    int32_t valid[kMaxPairs];  /* pairs with a local expert, in pair order */
    int32_t vq[kMaxPairs];     /* pair -> its index in valid */
    int32_t nvalid;
};

__device__ __forceinline__ uint4 ld_stream16(const uint8_t *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

/* acc + the dot product of 16 bytes of T (8 elements) from w and a */
template <typename T> __device__ __forceinline__ float dot8(uint4 w, uint4 a, float acc)
{
    const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = mx_unpack2<T>(wv[i]), q = mx_unpack2<T>(av[i]);
        acc = fmaf(p.y, q.y, fmaf(p.x, q.x, acc));
    }
    return acc;
}

/* Lane sums of two weight rows (w0, w1: kbytes each, global) against rows
 * a0, a1 (shared memory): 16 bytes a lane per step, kUnroll steps of both
 * rows loaded before any is used. */
template <typename T>
__device__ __forceinline__ void dot_rows(const uint8_t *w0, const uint8_t *w1, const uint8_t *a0, const uint8_t *a1,
                                         int kbytes, int lane, float &acc0, float &acc1)
{
    for (int base = lane * 16; base < kbytes; base += kChunk * kUnroll) {
        uint4 r0[kUnroll], r1[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int off = base + u * kChunk;
            if (off < kbytes) {
                r0[u] = ld_stream16(w0 + off);
                r1[u] = ld_stream16(w1 + off);
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int off = base + u * kChunk;
            if (off >= kbytes)
                break;
            acc0 = dot8<T>(r0[u], *reinterpret_cast<const uint4 *>(a0 + off), acc0);
            acc1 = dot8<T>(r1[u], *reinterpret_cast<const uint4 *>(a1 + off), acc1);
        }
    }
}

/* Phase 0: routing (or the caller's ids) and the local slots. */
__device__ __forceinline__ void fused_route(const fused_args &a, fused_head &hd, float *rows)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pairs = static_cast<int>(a.M) * a.top_k;
    if (a.routed) {
        mx_routing_problem r = a.routing;
        r.topk_weights = hd.weights;
        r.topk_ids = hd.ids;
        if (warp < a.M) {
            float *mine = rows + warp * 4 * r.num_experts;
            switch (a.route_epl) {
            case 1: route_token<1>(r, warp, mine, lane, nullptr); break;
            case 2: route_token<2>(r, warp, mine, lane, nullptr); break;
            case 4: route_token<4>(r, warp, mine, lane, nullptr); break;
            case 8: route_token<8>(r, warp, mine, lane, nullptr); break;
            default: route_token<0>(r, warp, mine, lane, nullptr); break;
            }
        }
        __syncthreads();
        if (blockIdx.x == 0)
            for (int p = threadIdx.x; p < pairs; p += kThreads) {
                a.routing.topk_weights[p] = hd.weights[p];
                a.routing.topk_ids[p] = hd.ids[p];
            }
    } else {
        for (int p = threadIdx.x; p < pairs; p += kThreads) {
            hd.ids[p] = a.topk_ids[p];
            hd.weights[p] = a.topk_weights[p];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        int n = 0;
        for (int p = 0; p < pairs; ++p) {
            const int e = mx_local_expert(hd.ids, a.expert_map, p, a.E_global, a.E_local);
            hd.slot_e[p] = e;
            hd.vq[p] = n;
            if (e >= 0)
                hd.valid[n++] = p;
        }
        hd.nvalid = n;
    }
    __syncthreads();
}

/* Phase 1: the x rows, one per token (two elements a thread and step). */
template <typename T> __device__ __forceinline__ void fused_stage_x(const fused_args &a, const fused_head &hd, uint8_t *ops)
{
    const T *x = static_cast<const T *>(a.x);
    const int64_t half = a.H / 2;
    for (int64_t i = threadIdx.x; i < a.M * half; i += kThreads) {
        const int t = static_cast<int>(i / half);
        const int64_t c = (i - t * half) * 2;
        float v0 = mx_to_float(x[t * a.H + c]), v1 = mx_to_float(x[t * a.H + c + 1]);
        if (a.weight_on_input) {
            const float w = mx_to_float(mx_from_float<T>(hd.weights[t * a.top_k]));
            v0 *= w;
            v1 *= w;
        }
        *reinterpret_cast<uint32_t *>(ops + (t * a.H + c) * sizeof(T)) = mx_pack2<T>(v0, v1);
    }
    __syncthreads();
}

/* GEMM1 unit u: slot index v (slowest), act column c, weight rows r0 / r1
 * (gate / up, or two columns of a non-gated w13). */
struct gemm1_unit {
    int v, e, c, r0, r1;
    __device__ __forceinline__ gemm1_unit(const fused_args &a, const fused_head &hd, int u, int cols)
    {
        v = u / cols;
        c = u - v * cols;
        e = hd.slot_e[hd.valid[v]];
        if (a.kind == MX_GEMM_GATE_UP) {
            r0 = c;
            r1 = static_cast<int>(a.I) + c;
        } else {
            r0 = 2 * c;
            r1 = 2 * c + 1 < a.n1 ? 2 * c + 1 : r0;
        }
    }
};

/* Phase 2: GEMM1 and the activation; act [nvalid, I] in T to the workspace. */
template <typename T> __device__ __forceinline__ void fused_gemm1(const fused_args &a, const fused_head &hd, const uint8_t *ops)
{
    const int lane = threadIdx.x & 31;
    const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
    const int cols = static_cast<int>(a.kind == MX_GEMM_UP ? (a.I + 1) / 2 : a.I), units = hd.nvalid * cols;
    const int hbytes = static_cast<int>(a.H * sizeof(T));
    const T *bias = static_cast<const T *>(a.b13);
    T *act = static_cast<T *>(a.act);
    for (int u = gw; u < units; u += nw) {
        const gemm1_unit n(a, hd, u, cols);
        const uint8_t *w = static_cast<const uint8_t *>(a.w13) + n.e * a.n1 * hbytes;
        const uint8_t *xr = ops + static_cast<int64_t>(hd.valid[n.v] / a.top_k) * hbytes;
        float acc0 = 0.0f, acc1 = 0.0f;
        dot_rows<T>(w + static_cast<int64_t>(n.r0) * hbytes, w + static_cast<int64_t>(n.r1) * hbytes, xr, xr, hbytes,
                    lane, acc0, acc1);
        acc0 = warp_sum(acc0);
        acc1 = warp_sum(acc1);
        if (lane != 0)
            continue;
        if (bias) {
            acc0 += mx_to_float(bias[n.e * a.n1 + n.r0]);
            acc1 += mx_to_float(bias[n.e * a.n1 + n.r1]);
        }
        T *dst = act + n.v * a.I;
        if (a.kind == MX_GEMM_UP) {
            dst[n.r0] = mx_from_float<T>(mx_act_plain(a.activation, acc0));
            if (n.r1 != n.r0)
                dst[n.r1] = mx_from_float<T>(mx_act_plain(a.activation, acc1));
        } else {
            dst[n.c] = mx_from_float<T>(mx_act_gated(a.activation, acc0, acc1, a.alpha, a.limit));
        }
    }
}

/* GEMM2 rows of this CTA: [h0, h1) */
__device__ __forceinline__ void cta_rows(const fused_args &a, int64_t &h0, int64_t &h1)
{
    h0 = a.H * blockIdx.x / gridDim.x;
    h1 = a.H * (blockIdx.x + 1) / gridDim.x;
}

/* Phase 3a: the CTA's GEMM2 weight rows into L2 (contiguous per slot),
 * kPrefetchPerCta bytes at most, a warp per slot. */
template <typename T> __device__ __forceinline__ void fused_prefetch_w2(const fused_args &a, const fused_head &hd)
{
    int64_t h0, h1;
    cta_rows(a, h0, h1);
    const int64_t ibytes = a.I * sizeof(T), bytes = (h1 - h0) * ibytes;
    if ((threadIdx.x & 31) != 0 || bytes <= 0)
        return;
    for (int v = threadIdx.x >> 5; v < hd.nvalid && (v + 1) * bytes <= kPrefetchPerCta; v += kWarps) {
        const int e = hd.slot_e[hd.valid[v]];
        prefetch_l2(static_cast<const uint8_t *>(a.w2) + (e * a.H + h0) * ibytes, static_cast<uint32_t>(bytes));
    }
}

/* Phase 4: act rows into shared memory (written by other CTAs: L2 loads). */
template <typename T> __device__ __forceinline__ void fused_stage_act(const fused_args &a, const fused_head &hd, uint8_t *ops)
{
    const uint4 *act = static_cast<const uint4 *>(a.act);
    const int64_t n16 = hd.nvalid * a.I * static_cast<int64_t>(sizeof(T)) / 16;
    for (int64_t i = threadIdx.x; i < n16; i += kThreads)
        reinterpret_cast<uint4 *>(ops)[i] = __ldcg(act + i);
    __syncthreads();
}

/* Phase 5: GEMM2 of the CTA's rows, then the top-k sum into out. A warp
 * takes items i and i + kWarps (item: slot v = i / nrows, row h0 + i %
 * nrows) together. */
template <typename T>
__device__ __forceinline__ void fused_gemm2(const fused_args &a, const fused_head &hd, const uint8_t *ops, float *ys)
{
    int64_t h0, h1;
    cta_rows(a, h0, h1);
    const int nrows = static_cast<int>(h1 - h0), items = hd.nvalid * nrows;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ibytes = static_cast<int>(a.I * sizeof(T));
    const uint8_t *w2 = static_cast<const uint8_t *>(a.w2);
    for (int i0 = warp; i0 < items; i0 += 2 * kWarps) {
        const int i1 = i0 + kWarps < items ? i0 + kWarps : i0;
        const int v0 = i0 / nrows, v1 = i1 / nrows;
        const int64_t g0 = h0 + (i0 - v0 * nrows), g1 = h0 + (i1 - v1 * nrows);
        const int e0 = hd.slot_e[hd.valid[v0]], e1 = hd.slot_e[hd.valid[v1]];
        float acc0 = 0.0f, acc1 = 0.0f;
        dot_rows<T>(w2 + (e0 * a.H + g0) * ibytes, w2 + (e1 * a.H + g1) * ibytes, ops + v0 * ibytes,
                    ops + v1 * ibytes, ibytes, lane, acc0, acc1);
        acc0 = warp_sum(acc0);
        acc1 = warp_sum(acc1);
        if (lane == 0) {
            ys[v0 * a.rows_max + (g0 - h0)] = acc0;
            ys[v1 * a.rows_max + (g1 - h0)] = acc1;
        }
    }
    __syncthreads();
    const T *bias = static_cast<const T *>(a.b2);
    T *out = static_cast<T *>(a.out);
    for (int64_t i = threadIdx.x; i < a.M * nrows; i += kThreads) {
        const int t = static_cast<int>(i / nrows);
        const int64_t h = h0 + (i - t * nrows);
        float sum = 0.0f;
        for (int j = 0; j < a.top_k; ++j) {
            const int p = t * a.top_k + j, e = hd.slot_e[p];
            if (e < 0)
                continue;
            float y = ys[hd.vq[p] * a.rows_max + (h - h0)];
            if (bias)
                y += mx_to_float(bias[e * a.H + h]);
            sum += __fmul_rn(y, a.weight_on_input ? 1.0f : hd.weights[p]);
        }
        out[t * a.H + h] = mx_from_float<T>(sum);
    }
}

template <typename T> __global__ void __launch_bounds__(kThreads, 1) decode_fused_kernel(const fused_args a)
{
    extern __shared__ __align__(16) uint8_t fused_smem[];
    fused_head &hd = *reinterpret_cast<fused_head *>(fused_smem);
    uint8_t *ops = fused_smem + a.off_ops;
    float *ys = reinterpret_cast<float *>(fused_smem + a.off_ys);

    fused_route(a, hd, reinterpret_cast<float *>(ops));
    fused_stage_x<T>(a, hd, ops);
    fused_gemm1<T>(a, hd, ops);
    fused_prefetch_w2<T>(a, hd);
    cg::this_grid().sync();
    fused_stage_act<T>(a, hd, ops);
    fused_gemm2<T>(a, hd, ops, ys);
}

struct fused_layout {
    size_t off_ops, off_ys, smem;
    int64_t rows_max;
};

/* Shared memory of a launch on grid CTAs: the head, then x / act rows (or
 * the routing rows before them), then GEMM2's dot products; 0 when that
 * exceeds kMaxSmem. */
size_t fused_plan(const mx_experts_problem *p, int grid, fused_layout *l)
{
    const int64_t M = p->num_tokens, pairs = M * p->top_k, es = static_cast<int64_t>(mx_dtype_size(p->act_dtype));
    l->rows_max = (p->hidden_size + grid - 1) / grid;
    int64_t ops = M * p->hidden_size * es;
    if (pairs * p->intermediate_size * es > ops)
        ops = pairs * p->intermediate_size * es;
    if (p->routing && M * static_cast<int64_t>(route_warp_bytes(p->routing->num_experts)) > ops)
        ops = M * static_cast<int64_t>(route_warp_bytes(p->routing->num_experts));
    size_t at = 0;
    mx_ws_take(&at, sizeof(fused_head));
    l->off_ops = mx_ws_take(&at, static_cast<size_t>(ops));
    l->off_ys = mx_ws_take(&at, sizeof(float) * static_cast<size_t>(pairs * l->rows_max));
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
    slot.store(sms, std::memory_order_relaxed);
    return sms;
}

template <typename T> mx_status launch(const fused_args &args, size_t smem, int grid, cudaStream_t stream)
{
    static std::atomic<unsigned long long> configured{0};
    static const mx_kernel_name name("decode_fused_kernel<%s>", std::is_same<T, __half>::value ? "float16" : "bfloat16");
    mx_status st = mx_opt_in_smem(decode_fused_kernel<T>, kMaxSmem, configured, name.text);
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
    return mx_check_call(cudaLaunchKernelEx(&cfg, decode_fused_kernel<T>, args), name.text);
}

std::atomic<int> fused_enabled{1};

} /* namespace */

extern "C" int mx_cuda_set_decode_fused(int enabled)
{
    return fused_enabled.exchange(enabled ? 1 : 0);
}

extern "C" int mx_cuda_decode_fused_usable(const mx_experts_problem *p)
{
    const int64_t M = p->num_tokens;
    if (!fused_enabled.load(std::memory_order_relaxed) || p->quant != MX_QUANT_NONE || M < 1 || M > kMaxTokens ||
        M * p->top_k > kMaxPairs)
        return 0;
    if (p->act_dtype != MX_BF16 && p->act_dtype != MX_F16)
        return 0;
    if (p->hidden_size % 8 != 0 || p->intermediate_size % 8 != 0 || !mx_aligned16(p->hidden_states) ||
        !mx_aligned16(p->w13) || !mx_aligned16(p->w2))
        return 0;
    const mx_routing_problem *r = p->routing;
    mx_status st;
    /* routing the pipeline would refuse: let it say why */
    if (r && (route_check(r, &st) || r->num_tokens != M || r->top_k != p->top_k ||
              r->num_experts != p->global_num_experts || r->topk_ids != p->topk_ids ||
              r->topk_weights != p->topk_weights))
        return 0;
    if (!cooperative_device())
        return 0;
    const int grid = fused_grid();
    fused_layout l;
    return grid > 0 && fused_plan(p, grid, &l) > 0;
}

extern "C" size_t mx_cuda_decode_fused_workspace_bytes(const mx_experts_problem *p)
{
    return mx_dtype_size(p->act_dtype) * static_cast<size_t>(p->num_tokens * p->top_k * p->intermediate_size);
}

extern "C" mx_status mx_cuda_decode_fused(const mx_experts_problem *p, void *workspace, cudaStream_t stream)
{
    const int grid = fused_grid();
    fused_layout l;
    if (grid <= 0 || fused_plan(p, grid, &l) == 0)
        return mx_status_fail(MX_ERR_VALUE, "decode_fused: the problem does not fit the fused kernel");
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
    a.out = p->output;
    a.act = workspace;
    a.off_ops = l.off_ops;
    a.off_ys = l.off_ys;
    a.rows_max = l.rows_max;
    return p->act_dtype == MX_BF16 ? launch<__nv_bfloat16>(a, l.smem, grid, stream)
                                   : launch<__half>(a, l.smem, grid, stream);
}
