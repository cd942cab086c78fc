/* Pieces of the one-launch decode forward (decode_fused.cu) that its 16-bit
 * and FP8 phases share: sizes, the kernel's arguments and shared-memory
 * head, streaming loads, the routing phase (0) and the GEMM2 prefetch
 * before the grid barrier (3a). */
#ifndef MOE_EXT_CUDA_DECODE_FUSED_CUH
#define MOE_EXT_CUDA_DECODE_FUSED_CUH

#include "common.cuh"
#include "experts.cuh"
#include "route_token.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTokens = 2;
constexpr int kMaxPairs = kWarps;   /* (token, slot) pairs: FP8's one token of at most kWarps slots */
constexpr int kMax16BitPairs = 8;   /* the 16-bit path's pairs (decode_fused.cu fused_usable) */
constexpr int kUnroll = 4;                        /* steps of each row in flight */
constexpr size_t kMaxSmem = 200 * 1024;
constexpr long long kPrefetchPerCta = 192 * 1024; /* GEMM2 bytes a CTA prefetches into L2 */
constexpr int kMaxCtas = 1024;                    /* workspace for the FP8 act amax partials */

enum fused_quant { Q_NONE = 0, Q_TENSOR = 1, Q_BLOCK = 2 };
constexpr int kMmaBlocks = 2;          /* FP8: 128-byte k blocks of both rows loaded before any is used */
constexpr int64_t kFp8MaxHidden = 2048; /* FP8: the longest GEMM1 K taken (decode_fused.cu fused_usable) */

struct fused_args {
    int64_t M, H, I, n1, E_local, E_global;
    int top_k, kind, activation, weight_on_input, route_epl, routed;
    float alpha, limit;
    const void *x, *w13, *w2, *b13, *b2;
    int w_packed;               /* w13 / w2 in the packed layout (abi.h weights_packed) */
    const float *w13_scale, *w2_scale; /* FP8 */
    const float *topk_weights;
    const int32_t *topk_ids, *expert_map;
    mx_routing_problem routing; /* routed: its outputs are topk_weights / topk_ids */
    void *out, *act;
    float *amax_parts;          /* FP8 per tensor: act amax of each CTA */
    size_t off_ops, off_ys;     /* shared memory: x or act rows, GEMM2's dot products (16-bit) or the
                                   warps' partial sums (FP8) */
    size_t off_route;           /* shared memory: the routing warps' rows (route_warp_bytes each) */
    size_t off_xsc, off_asc;    /* FP8 block scales of x and act rows */
    int64_t rows_max;           /* GEMM2 rows of a CTA, at most */
};

struct fused_head {
    int32_t ids[kMaxPairs];
    float weights[kMaxPairs];
    int32_t slot_e[kMaxPairs]; /* local expert of pair p, or -1 */
    int32_t valid[kMaxPairs];  /* pairs with a local expert, in pair order */
    int32_t vq[kMaxPairs];     /* pair -> its index in valid */
    int32_t nvalid;
    uint32_t amax_bits;
    float x_scale, act_scale; /* FP8 per tensor */
};

__device__ __forceinline__ uint4 ld_stream16(const uint8_t *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* One weight row in its tensor's layout: byte `off` (a multiple of 16) of
 * its k at at(off). Row-major: the row's slices of 128 bytes follow each
 * other; packed (abi.h weights_packed): they lie 8 KB apart. */
struct weight_row {
    const uint8_t *p;     /* the row's first byte */
    int64_t slice_stride; /* bytes from one 128-byte k slice of the row to the next */
    __device__ __forceinline__ const uint8_t *at(int off) const { return p + (off >> 7) * slice_stride + (off & 127); }
};

/* Row `row` of expert e of w [E, n_rows, kbytes] */
__device__ __forceinline__ weight_row weight_row_of(const void *w, bool packed, int64_t e, int64_t n_rows, int64_t row,
                                                    int64_t kbytes)
{
    const uint8_t *expert = static_cast<const uint8_t *>(w) + e * n_rows * kbytes;
    if (packed)
        return {expert + (row >> 6) * 64 * kbytes + (row & 63) * 128, 64 * 128};
    return {expert + row * kbytes, 128};
}

__device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

/* Phase 0: routing (or the caller's ids) and the local slots; the warps
 * from kMaxTokens on meanwhile run beside(first), work that needs no
 * routing, given the first of their threads. */
template <typename Beside>
__device__ __forceinline__ void fused_route(const fused_args &a, fused_head &hd, float *rows, Beside beside)
{
    constexpr int idle_first = 32 * kMaxTokens; /* the first thread of warp kMaxTokens */
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
        } else if (warp >= kMaxTokens) {
            beside(idle_first);
        }
        __syncthreads();
        if (blockIdx.x == 0)
            for (int p = threadIdx.x; p < pairs; p += kThreads) {
                a.routing.topk_weights[p] = hd.weights[p];
                a.routing.topk_ids[p] = hd.ids[p];
            }
    } else {
        if (warp >= kMaxTokens)
            beside(idle_first);
        else
            for (int p = threadIdx.x; p < pairs; p += idle_first) {
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
        hd.amax_bits = 0u;
    }
    __syncthreads();
}

/* Phase 3a: the CTA's first GEMM2 weight rows [row0, row0 + rows) of each
 * local slot (contiguous, ibytes a row) into L2, kPrefetchPerCta bytes at
 * most, a warp per slot. */
__device__ __forceinline__ void fused_prefetch_w2(const fused_args &a, const fused_head &hd, int64_t row0, int64_t rows,
                                                  int64_t ibytes)
{
    const int64_t bytes = rows * ibytes;
    if (bytes <= 0)
        return;
    const int lane = threadIdx.x & 31;
    for (int v = threadIdx.x >> 5; v < hd.nvalid && (v + 1) * bytes <= kPrefetchPerCta; v += kWarps) {
        const int e = hd.slot_e[hd.valid[v]];
        if (!a.w_packed) {
            if (lane == 0)
                prefetch_l2(weight_row_of(a.w2, false, e, a.H, row0, ibytes).p, static_cast<uint32_t>(bytes));
            continue;
        }
        /* packed: the rows' part of each 128-byte k slice of each 64-row block */
        const int64_t slices = ibytes / 128, row1 = row0 + rows;
        for (int64_t b = row0 / 64; b * 64 < row1; ++b) {
            const int64_t r0 = b * 64 > row0 ? b * 64 : row0, r1 = (b + 1) * 64 < row1 ? (b + 1) * 64 : row1;
            const weight_row w = weight_row_of(a.w2, true, e, a.H, r0, ibytes);
            for (int64_t kb = lane; kb < slices; kb += 32)
                prefetch_l2(w.at(static_cast<int>(kb * 128)), static_cast<uint32_t>((r1 - r0) * 128));
        }
    }
}

} /* namespace */

#endif /* MOE_EXT_CUDA_DECODE_FUSED_CUH */
