/* The final reduction over the top-k slots: out[t] = sum_j y[t * k + j].
 *
 * Operands: y float32 [splits, rows, H] row-major, written by GEMM2 already
 * multiplied by the routing weight (splits > 1 when GEMM2 ran split-K, each
 * slice a partial sum over K); a pair's row is its index (y [splits, M k,
 * H]), or, where GEMM2 wrote y by sorted row (the persistent Hopper kernel
 * with block scales, gemm_configs_fp8.cuh mx_fp8_sm90_down_by_sorted_row),
 * pair_rows[pair] (moe_align). The slice count is `splits`, or
 * *split_count where the persistent GEMM2 picked it on the device.
 * out [M, H] in the activation dtype. Slots whose id has no local expert
 * were never written and are skipped (pair_rows holds -1 for them; by pair
 * their ids are re-derived from topk_ids / expert_map exactly as moe_align
 * did). The sum runs in float32
 * in (slot, slice) order and is rounded once, so the result is
 * deterministic and the same for either layout; a token with no local slot
 * gets a zero row.
 *
 * Grid: x = token, y = chunk of kChunk columns (H / 4 float4 columns when
 * H % 4 == 0, else scalars); each block first puts its token's slot rows
 * (-1: no local expert) in shared memory (k int32). Launched dependent where
 * the GPU allows (common.cuh): the slot rows (from topk_ids and pair_rows,
 * written before GEMM1) overlap GEMM2's tail; y is read after the wait. */
#include "common.cuh"
#include "experts.cuh"

namespace {

constexpr int kSumThreads = 128;
constexpr int kBatch = 8; /* (slot, slice) terms loaded at once */

template <typename T> struct vec4_store;
template <> struct vec4_store<float> {
    static __device__ __forceinline__ void run(float *dst, float4 v) { *reinterpret_cast<float4 *>(dst) = v; }
};
template <typename T> struct vec4_store {
    /* two packed pairs: one 8-byte store */
    static __device__ __forceinline__ void run(T *dst, float4 v)
    {
        *reinterpret_cast<uint2 *>(dst) = make_uint2(mx_pack2<T>(v.x, v.y), mx_pack2<T>(v.z, v.w));
    }
};

template <typename T, bool kVec4>
__global__ void __launch_bounds__(kSumThreads)
    moe_sum_kernel(const float *__restrict__ y, const int32_t *__restrict__ pair_rows, int max_splits,
                   const int32_t *__restrict__ split_count, int64_t split_stride,
                   const int32_t *__restrict__ topk_ids, const int32_t *__restrict__ expert_map, int top_k,
                   int64_t hidden, int64_t global_experts, int64_t local_experts, T *__restrict__ out)
{
    extern __shared__ int32_t slot_row[];
    const int64_t t = blockIdx.x;
    for (int j = threadIdx.x; j < top_k; j += kSumThreads) {
        const int64_t pair = t * top_k + j;
        slot_row[j] = pair_rows ? pair_rows[pair] /* -1 without a local expert, as moe_align wrote it */
                      : mx_local_expert(topk_ids, expert_map, pair, global_experts, local_experts) >= 0
                          ? static_cast<int32_t>(pair)
                          : -1;
    }
    __syncthreads();
    mx_griddep_wait();
    mx_griddep_launch_dependents();
    const int splits = split_count ? *split_count : max_splits;

    const int64_t c = static_cast<int64_t>(blockIdx.y) * kSumThreads + threadIdx.x;
    if (kVec4) {
        if (c * 4 >= hidden)
            return;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        /* the (slot, slice) terms in slot-major order, kBatch loads in flight before their adds */
        const int terms = top_k * splits;
        for (int n0 = 0; n0 < terms; n0 += kBatch) {
            float4 v[kBatch];
            bool used[kBatch];
#pragma unroll
            for (int i = 0; i < kBatch; ++i) {
                const int j = (n0 + i) / splits, s = n0 + i - j * splits;
                used[i] = n0 + i < terms && slot_row[j] >= 0;
                if (used[i])
                    v[i] = *reinterpret_cast<const float4 *>(y + s * split_stride + slot_row[j] * hidden + c * 4);
            }
#pragma unroll
            for (int i = 0; i < kBatch; ++i)
                if (used[i]) {
                    acc.x += v[i].x;
                    acc.y += v[i].y;
                    acc.z += v[i].z;
                    acc.w += v[i].w;
                }
        }
        vec4_store<T>::run(out + t * hidden + c * 4, acc);
    } else {
        if (c >= hidden)
            return;
        float acc = 0.f;
        for (int j = 0; j < top_k; ++j)
            if (slot_row[j] >= 0)
                for (int s = 0; s < splits; ++s)
                    acc += y[s * split_stride + slot_row[j] * hidden + c];
        out[t * hidden + c] = mx_from_float<T>(acc);
    }
}

template <typename T>
mx_status launch(const float *y, const int32_t *pair_rows, int splits, const int32_t *split_count,
                 int64_t split_stride, const int32_t *ids,
                 const int32_t *map, int64_t tokens, int top_k, int64_t hidden, int64_t ge, int64_t le, void *out,
                 cudaStream_t stream)
{
    const bool vec4 = hidden % 4 == 0 && reinterpret_cast<uintptr_t>(out) % (4 * sizeof(T)) == 0;
    const int64_t cols = vec4 ? hidden / 4 : hidden;
    const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(mx_ceil_div(cols, kSumThreads)));
    auto kernel = vec4 ? moe_sum_kernel<T, true> : moe_sum_kernel<T, false>;
    return mx_check_call(mx_launch_after(kernel, grid, dim3(kSumThreads), top_k * sizeof(int32_t), stream, y, pair_rows,
                                         splits, split_count, split_stride, ids, map, top_k, hidden, ge, le,
                                         static_cast<T *>(out)),
                         "moe_sum_kernel");
}

} /* namespace */

extern "C" mx_status mx_cuda_moe_sum(const float *y, const int32_t *pair_rows, int k_splits,
                                     const int32_t *split_count, int64_t split_stride,
                                     const int32_t *topk_ids, const int32_t *expert_map, int64_t tokens, int top_k,
                                     int64_t hidden, int64_t global_experts, int64_t local_experts, mx_dtype dtype,
                                     void *out, cudaStream_t stream)
{
    if (tokens > 0x7fffffff || mx_ceil_div(hidden, kSumThreads) > 65535)
        return mx_status_fail(MX_ERR_VALUE, "moe_sum: M=%lld, H=%lld exceed the grid", (long long)tokens,
                              (long long)hidden);
    switch (dtype) {
    case MX_BF16:
        return launch<__nv_bfloat16>(y, pair_rows, k_splits, split_count, split_stride, topk_ids, expert_map, tokens,
                                     top_k, hidden, global_experts, local_experts, out, stream);
    case MX_F16:
        return launch<__half>(y, pair_rows, k_splits, split_count, split_stride, topk_ids, expert_map, tokens, top_k,
                              hidden, global_experts, local_experts, out, stream);
    case MX_F32:
        return launch<float>(y, pair_rows, k_splits, split_count, split_stride, topk_ids, expert_map, tokens, top_k,
                             hidden, global_experts, local_experts, out, stream);
    default:
        return mx_status_fail(MX_ERR_TYPE, "moe_sum: dtype %s", mx_dtype_name(dtype));
    }
}
