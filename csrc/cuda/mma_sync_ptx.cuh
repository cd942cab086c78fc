/* PTX wrappers of the cp.async -> ldmatrix -> mma.sync pipelines
 * (grouped_gemm_tc.cuh, grouped_gemm_fp8.cuh): shared-memory addresses,
 * asynchronous global->shared copies, ldmatrix, and the 16-bit m16n8k16
 * mma (the FP8 kernel feeds it converted fragments where the GPU has no
 * e4m3 mma.sync). */
#ifndef MOE_EXT_CUDA_MMA_SYNC_PTX_CUH
#define MOE_EXT_CUDA_MMA_SYNC_PTX_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t mx_smem_addr(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/* 16-byte global->shared copy that bypasses L1 (.cg: tiles are used once per
 * CTA); bytes past src_bytes (0 or 16) are zero-filled. dst: a shared-memory
 * address (mx_smem_addr) or pointer. */
__device__ __forceinline__ void mx_cp_async16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void mx_cp_async16(void *dst, const void *src, int src_bytes)
{
    mx_cp_async16(mx_smem_addr(dst), src, src_bytes);
}

/* 4-byte copy (.ca: the only size-4 form), for block scales. */
__device__ __forceinline__ void mx_cp_async4(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(mx_smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void mx_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void mx_cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Four 8x8 b16 matrices: lanes 8i..8i+7 give the row addresses of matrix i. */
__device__ __forceinline__ void mx_ldmatrix_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                               const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(mx_smem_addr(p)));
}

/* c += a (16x16, row) * b (16x8, col), float32 accumulate. */
template <typename T> struct mx_mma_16816;
template <> struct mx_mma_16816<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2])
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct mx_mma_16816<__half> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2])
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

} /* namespace */

#endif /* MOE_EXT_CUDA_MMA_SYNC_PTX_CUH */
