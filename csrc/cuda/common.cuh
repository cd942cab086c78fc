/* Shared helpers of the CUDA engine (csrc/cuda/): status construction, the
 * launch check, workspace carving, the shared-memory opt-in, element
 * conversions and the MoE activations.
 *
 * Everything here is static or a template in an unnamed namespace, so each
 * translation unit gets private copies and only the mx_* entry points of the
 * .cu files are exported. */
#ifndef MOE_EXT_CUDA_COMMON_CUH
#define MOE_EXT_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <utility>

#include "moe_ext/abi.h"

namespace {

/* ---- status -------------------------------------------------------------- */

inline mx_status mx_status_ok(void)
{
    mx_status s;
    s.code = MX_OK;
    s.message[0] = '\0';
    return s;
}

inline mx_status mx_status_fail(mx_code code, const char *fmt, ...)
{
    mx_status s;
    s.code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s.message, sizeof s.message, fmt, ap);
    va_end(ap);
    return s;
}

/* Call right after a launch: a launch error (bad configuration, too much
 * shared memory) or an earlier asynchronous fault becomes MX_ERR_CUDA naming
 * the kernel. */
inline mx_status mx_check_launch(const char *kernel)
{
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return mx_status_fail(MX_ERR_CUDA, "%s: %s", kernel, cudaGetErrorString(err));
    return mx_status_ok();
}

inline mx_status mx_check_call(cudaError_t err, const char *what)
{
    if (err != cudaSuccess) {
        cudaGetLastError(); /* clear a non-sticky error so later checks start clean */
        return mx_status_fail(MX_ERR_CUDA, "%s: %s", what, cudaGetErrorString(err));
    }
    return mx_status_ok();
}

inline int64_t mx_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool mx_aligned16(const void *ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

/* Carves a workspace: returns the offset of a piece of `bytes` at *cursor and
 * advances it to the next 256-byte boundary. */
inline size_t mx_ws_take(size_t *cursor, size_t bytes)
{
    const size_t at = *cursor;
    *cursor += (bytes + 255) & ~static_cast<size_t>(255);
    return at;
}

/* Launches a tiled kernel over m_tiles x n_tiles x g.k_splits CTAs: m tiles
 * on grid x when Shape::kMOnX, else on grid y in chunks of 65535 (g.m_tile_base
 * tells each launch its first m tile). The caller validated k_splits. */
template <typename Shape, typename Kernel, typename Args>
mx_status mx_launch_tile_grid(Kernel kernel, Args g, int64_t m_tiles, int64_t n_tiles, const char *name,
                              cudaStream_t stream)
{
    const int64_t max_y = 65535;
    const unsigned splits = static_cast<unsigned>(g.k_splits);
    if (Shape::kMOnX) {
        if (n_tiles > max_y || m_tiles > 0x7fffffff)
            return mx_status_fail(MX_ERR_VALUE, "%s: %lld x %lld tiles exceed the grid", name, (long long)m_tiles,
                                  (long long)n_tiles);
        g.m_tile_base = 0;
        kernel<<<dim3(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles), splits), Shape::kThreads,
                 Shape::kSmemBytes, stream>>>(g);
        return mx_check_launch(name);
    }
    if (n_tiles > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "%s: %lld n tiles exceed the grid", name, (long long)n_tiles);
    for (int64_t base = 0; base < m_tiles; base += max_y) {
        const int64_t rows = m_tiles - base < max_y ? m_tiles - base : max_y;
        g.m_tile_base = static_cast<int>(base);
        kernel<<<dim3(static_cast<unsigned>(n_tiles), static_cast<unsigned>(rows), splits), Shape::kThreads,
                 Shape::kSmemBytes, stream>>>(g);
        const mx_status st = mx_check_launch(name);
        if (st.code != MX_OK)
            return st;
    }
    return mx_status_ok();
}

/* ---- programmatic dependent launch (sm_90) ----------------------------------
 * A kernel launched by mx_launch_dependent may start while the kernel before
 * it in the stream still runs (its prologue, and any loads that do not depend
 * on that kernel, overlap the other's tail). Rules every such kernel keeps:
 * mx_griddep_wait() before it reads anything the previous kernel writes or
 * writes anything that kernel reads; mx_griddep_launch_dependents() only after
 * its own wait. So when a kernel starts, every kernel before the previous one
 * has completed, and it may read their outputs before waiting. One exception:
 * the per-tensor FP8 act quantizer at decode triggers before it waits
 * (mx_fp8_row_filter.early_dependents), so GEMM2 may start while GEMM1 runs;
 * GEMM2 reads only the tile table, sorted ids and routing weights (written
 * before GEMM1 started) and its weights before its wait. Both calls are
 * no-ops in a kernel launched plainly, and below sm_90. */
__device__ __forceinline__ void mx_griddep_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mx_griddep_launch_dependents()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* The rule's wait, then the trigger; dependents_first: the trigger first
 * (the exception above, for kernels whose dependents read nothing of the
 * kernel before them before their own wait). */
__device__ __forceinline__ void mx_griddep_enter(bool dependents_first)
{
    if (dependents_first) {
        mx_griddep_launch_dependents();
        mx_griddep_wait();
    } else {
        mx_griddep_wait();
        mx_griddep_launch_dependents();
    }
}

/* Launches kernel(args...) with programmatic stream serialization, in
 * clusters of cluster_x CTAs along x (grid.x a multiple of it; 1: no
 * clusters). Callers use it on Hopper only: mx_cuda_sm90_gemm_available(). */
template <typename... Params, typename... Args>
cudaError_t mx_launch_dependent_clusters(unsigned cluster_x, void (*kernel)(Params...), dim3 grid, dim3 block,
                                         size_t smem, cudaStream_t stream, Args &&...args)
{
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = cluster_x;
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = cluster_x > 1 ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

/* The same without clusters. */
template <typename... Params, typename... Args>
cudaError_t mx_launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                Args &&...args)
{
    return mx_launch_dependent_clusters(1u, kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

/* probe(device) for the current device, asked once per device and kept in
 * the caller's state (0 unknown, 1 yes, 2 no); false when no device is
 * current. Clears the errors the probe leaves. */
template <typename Probe> bool mx_device_property(std::atomic<int> (&state)[64], Probe probe)
{
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    std::atomic<int> &slot = state[device & 63];
    const int known = slot.load(std::memory_order_relaxed);
    if (known)
        return known == 1;
    const bool yes = probe(device);
    cudaGetLastError();
    slot.store(yes ? 1 : 2, std::memory_order_relaxed);
    return yes;
}

/* 1 when the current device can launch dependents (compute capability 9.0
 * or later). */
inline bool mx_dependent_launch_available()
{
    static std::atomic<int> state[64];
    return mx_device_property(state, [](int device) {
        int major = 0;
        return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
    });
}

/* The pipeline's small kernels (routing, sorting, quantizers, the top-k
 * sum) wait at their top, so launching them dependent is always safe: only
 * their launch and prologue overlap the kernel before. Dependent where the
 * device supports it, else a plain launch; returns the launch's error. */
template <typename... Params, typename... Args>
cudaError_t mx_launch_after(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                            Args &&...args)
{
    if (mx_dependent_launch_available())
        return mx_launch_dependent(kernel, grid, block, smem, stream, std::forward<Args>(args)...);
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaGetLastError();
}

/* A kernel's name for its error messages, formatted once: launchers keep it
 * as a function-local static, so the forward's hot path formats nothing. */
struct mx_kernel_name {
    char text[160];
    explicit mx_kernel_name(const char *fmt, ...)
    {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(text, sizeof text, fmt, ap);
        va_end(ap);
    }
};

/* Opts `kernel` into smem_bytes of dynamic shared memory once per device;
 * `configured` is the caller's per-kernel bit set. */
template <typename Kernel>
mx_status mx_opt_in_smem(Kernel kernel, size_t smem_bytes, std::atomic<unsigned long long> &configured,
                         const char *name)
{
    int device = 0;
    mx_status st = mx_check_call(cudaGetDevice(&device), "cudaGetDevice");
    if (st.code != MX_OK)
        return st;
    const unsigned long long bit = 1ull << (device & 63);
    if (configured.load(std::memory_order_relaxed) & bit)
        return mx_status_ok();
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
    if (err != cudaSuccess) {
        cudaGetLastError();
        return mx_status_fail(MX_ERR_CUDA, "%s: %zu bytes of shared memory: %s", name, smem_bytes,
                              cudaGetErrorString(err));
    }
    configured.fetch_or(bit, std::memory_order_relaxed);
    return mx_status_ok();
}

/* CTAs of `kernel` that fit the current device at once (SMs x CTAs per SM at
 * this block size and dynamic shared memory: a persistent kernel's grid),
 * asked once per device and kept in the caller's per-kernel `cache`. Call it
 * after mx_opt_in_smem. */
template <typename Kernel>
mx_status mx_resident_ctas(Kernel kernel, int threads, size_t smem_bytes, std::atomic<int> (&cache)[64],
                           const char *name, int *ctas)
{
    int device = 0;
    mx_status st = mx_check_call(cudaGetDevice(&device), "cudaGetDevice");
    if (st.code != MX_OK)
        return st;
    std::atomic<int> &slot = cache[device & 63];
    *ctas = slot.load(std::memory_order_relaxed);
    if (*ctas > 0)
        return mx_status_ok();
    int per_sm = 0, sms = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || per_sm < 1 ||
        sms < 1) {
        cudaGetLastError();
        return mx_status_fail(MX_ERR_CUDA, "%s: no CTA of %d threads and %zu bytes of shared memory fits an SM",
                              name, threads, smem_bytes);
    }
    *ctas = per_sm * sms;
    slot.store(*ctas, std::memory_order_relaxed);
    return mx_status_ok();
}

/* ---- elements ------------------------------------------------------------ */

template <typename T> __device__ __forceinline__ float mx_to_float(T v);
template <> __device__ __forceinline__ float mx_to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float mx_to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float mx_to_float<__nv_bfloat16>(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T mx_from_float(float v);
template <> __device__ __forceinline__ float mx_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half mx_from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 mx_from_float<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}

/* Two values rounded to a 16-bit dtype, packed low-then-high (one 4-byte store). */
template <typename T> __device__ __forceinline__ uint32_t mx_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t mx_pack2<__nv_bfloat16>(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t mx_pack2<__half>(float lo, float hi)
{
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* The two values of a packed pair (mx_pack2's layout), as float32. */
template <typename T> __device__ __forceinline__ float2 mx_unpack2(uint32_t packed);
template <> __device__ __forceinline__ float2 mx_unpack2<__nv_bfloat16>(uint32_t packed)
{
    return make_float2(__uint_as_float(packed << 16), __uint_as_float(packed & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 mx_unpack2<__half>(uint32_t packed)
{
    return __half22float2(*reinterpret_cast<const __half2 *>(&packed));
}

/* Element i of a float32/float16/bfloat16 array whose dtype is known only at
 * run time (routing logits, correction bias). */
__device__ __forceinline__ float mx_load_float(const void *p, mx_dtype dt, int64_t i)
{
    switch (dt) {
    case MX_F16: return __half2float(static_cast<const __half *>(p)[i]);
    case MX_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
    }
}

/* ---- expert ids ------------------------------------------------------------ */

/* Local expert of topk_ids[pair], or -1 when the id is out of range or the
 * expert lives on another rank (expert_map entry -1 or out of range). */
__device__ __forceinline__ int mx_local_expert(const int32_t *topk_ids, const int32_t *expert_map,
                                               int64_t pair, int64_t global_experts,
                                               int64_t local_experts)
{
    int64_t id = topk_ids[pair];
    if (id < 0 || id >= global_experts)
        return -1;
    int64_t e = expert_map ? expert_map[id] : id;
    return (e >= 0 && e < local_experts) ? static_cast<int>(e) : -1;
}

/* ---- activations (numerics.md "Experts"; float32 in and out) -------------- */

/* 1 / (1 + e^-x) from the special-function unit: ex2.approx and rcp.approx
 * (relative errors ~2^-22, far under the act dtype's rounding), two MUFU
 * operations and two FMULs where expf and an IEEE division cost ~40
 * instructions (the persistent kernel's silu GEMM1 4-12% faster with these;
 * H100, 2026-11-25). sigmoid(+inf) = 1, sigmoid(-inf) = 0, NaN stays NaN. */
__device__ __forceinline__ float mx_sigmoid(float x)
{
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    return r;
}

__device__ __forceinline__ float mx_silu(float x) { return x * mx_sigmoid(x); }

__device__ __forceinline__ float mx_gelu_erf(float x)
{
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}

/* act(gate) * up for the gated activations (silu, gelu, swigluoai). */
__device__ __forceinline__ float mx_act_gated(int act, float gate, float up, float alpha, float limit)
{
    if (act == MX_ACT_SWIGLUOAI) {
        float g = fminf(gate, limit);
        float u = fminf(fmaxf(up, -limit), limit);
        return (u + 1.0f) * g * mx_sigmoid(alpha * g);
    }
    return (act == MX_ACT_GELU ? mx_gelu_erf(gate) : mx_silu(gate)) * up;
}

/* act(h) for the non-gated activations (relu2, silu, gelu). */
__device__ __forceinline__ float mx_act_plain(int act, float h)
{
    if (act == MX_ACT_RELU2) {
        float r = fmaxf(h, 0.0f);
        return r * r;
    }
    return act == MX_ACT_GELU ? mx_gelu_erf(h) : mx_silu(h);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_COMMON_CUH */
