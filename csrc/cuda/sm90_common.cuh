/* Pieces shared by the Hopper (sm_90a) kernels, grouped_gemm_sm90_impl.cuh
 * (the persistent warp-specialized GEMM) and grouped_gemm_sm90_decode.cuh
 * (few rows per expert): PTX wrappers for mbarriers, TMA, wgmma and its
 * shared-memory descriptors; the FP8 scale operands; and on the host the
 * cached tensor-map encoding. */
#ifndef MOE_EXT_CUDA_SM90_COMMON_CUH
#define MOE_EXT_CUDA_SM90_COMMON_CUH

#include <cuda.h> /* CUtensorMap and its enums only; the driver entry is fetched through cudart */

#include <atomic>
#include <string.h>

#include "common.cuh"
#include "experts.cuh"
#include "fp8.cuh"
#include "grouped_gemm_sm90.cuh"
#include "mma_sync_ptx.cuh"

/* The kernel bodies exist only in the sm_90a pass (wgmma, setmaxnreg). */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MX_SM90_DEVICE_PASS 1
#else
#define MX_SM90_DEVICE_PASS 0
#endif

namespace {

/* ---- PTX helpers (sm_90) ----------------------------------------------------- */

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

/* One arrival that also announces the bytes the TMA loads will deliver. */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}

/* One arrival once every cp.async this thread issued before has landed
 * (.noinc: the barrier's expected count includes this arrival). */
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

/* Orders this thread's generic-proxy view of shared memory (barrier
 * initialization, cp.async data seen through an mbarrier) before its
 * async-proxy accesses (TMA, wgmma). */
__device__ __forceinline__ void fence_proxy_async_smem()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Spin until the phase of parity `parity` has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
                 : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1, int c2)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}

__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c2, int c3, int c4)
{
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %3, %4, %5, %6}], [%2];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(0), "r"(c2), "r"(c3), "r"(c4)
                 : "memory");
}

/* The same box into the same shared-memory offset of every CTA in cta_mask
 * (cluster multicast); each destination's barrier at `bar` gets the bytes. */
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0,
                                                      int c1, int c2, uint16_t cta_mask)
{
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%4, %5, %6}], [%2], %3;\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "h"(cta_mask), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}

__device__ __forceinline__ void tma_load_5d_multicast(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c2,
                                                      int c3, int c4, uint16_t cta_mask)
{
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%4, %4, %5, %6, %7}], [%2], %3;\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "h"(cta_mask), "r"(0), "r"(c2), "r"(c3),
                 "r"(c4)
                 : "memory");
}

/* A weight box: k block kb (128 bytes, kb_elems elements) of the rows from
 * `row` of one expert, through a map of sm90_weight_map (packed: the 5-D
 * map of the packed layout, `row` a multiple of 64). */
__device__ __forceinline__ void tma_load_w(uint32_t dst, const CUtensorMap *map, uint32_t bar, int kb, int kb_elems,
                                           int row, int expert, bool packed)
{
    if (packed)
        tma_load_5d(dst, map, bar, kb, row / 64, expert);
    else
        tma_load_3d(dst, map, bar, kb * kb_elems, row, expert);
}

__device__ __forceinline__ void tma_load_w_multicast(uint32_t dst, const CUtensorMap *map, uint32_t bar, int kb,
                                                     int kb_elems, int row, int expert, bool packed,
                                                     uint16_t cta_mask)
{
    if (packed)
        tma_load_5d_multicast(dst, map, bar, kb, row / 64, expert, cta_mask);
    else
        tma_load_3d_multicast(dst, map, bar, kb * kb_elems, row, expert, cta_mask);
}

/* TMA store of a box of shared memory (at src, laid out as the map's swizzle) to
 * the map's coordinates (c0 innermost); the box is clipped at the tensor's
 * bounds. One bulk group per commit; wait_read<N> returns once at most N of
 * this thread's groups still read shared memory, wait_all<N> once at most N
 * are still in flight at all. */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int c0, int c1)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read()
{
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_all()
{
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads. */
__device__ __forceinline__ void named_barrier_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v)
{
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr)
{
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float a, float b)
{
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

/* Arrive on the barrier at the same offset in CTA `rank` of the cluster. */
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank)
{
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
                 : "memory");
}

/* Store v at the same shared-memory offset in CTA `rank` of the cluster. */
__device__ __forceinline__ void st_shared_cluster(uint32_t addr, uint32_t rank, uint32_t v)
{
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "st.shared::cluster.b32 [remote], %2;\n}\n" ::"r"(addr), "r"(rank), "r"(v)
                 : "memory");
}

__device__ __forceinline__ uint32_t cluster_cta_rank()
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

/* All threads of all CTAs of the cluster. */
__device__ __forceinline__ void cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map)
{
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/* wgmma shared-memory descriptor of a K-major operand in the 128B-swizzle
 * layout the TMA writes: rows of 128 bytes, 8-row atoms of 1024 bytes
 * (stride byte offset), leading byte offset unused (1), swizzle mode 1. The
 * atoms are 1024-byte aligned, so the base offset field stays 0; stepping k
 * by 16 elements adds 32 bytes to the start address. */
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr)
{
    return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
           (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accumulator reads or writes across the
 * asynchronous wgmma instructions (it cannot see that they are in flight). */
template <int R> __device__ __forceinline__ void fence_acc(float (&d)[R])
{
#pragma unroll
    for (int i = 0; i < R; ++i)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* Generated: the accumulator lists of wgmma.m64n128 / m64n256. KTYPES is
 * the k and the types ("k16.f32.bf16.bf16"), TAIL the immediates after the
 * scale-d predicate (the 16-bit forms take transpose flags, FP8 does not). */
#define MX_WGMMA_M64N128(KTYPES, TAIL)                                                                                            \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                              \
                 "wgmma.mma_async.sync.aligned.m64n128" KTYPES " {"                                             \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                  \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                        \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                        \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "                       \
                 "%64, %65, p, " TAIL ";\n}\n"                                                                           \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),         \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),   \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])  \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))

#define MX_WGMMA_M64N256(KTYPES, TAIL)                                                                                                    \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                                     \
                 "wgmma.mma_async.sync.aligned.m64n256" KTYPES " {"                                                     \
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                          \
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                                \
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                                \
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                                \
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                                \
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                                \
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                    \
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "               \
                 "%128, %129, p, " TAIL ";\n}\n"                                                                                 \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),                 \
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),           \
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),         \
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),         \
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),         \
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),         \
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),         \
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),         \
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),         \
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),         \
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),         \
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),         \
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),     \
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])  \
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))

/* The narrow forms (n 16 / 32 / 48 / 64) serve the decode kernel, whose n is
 * the token count of a tile. */
#define MX_WGMMA_M64N16(KTYPES, TAIL)\
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"\
                 "wgmma.mma_async.sync.aligned.m64n16" KTYPES " {"\
                 "%0, %1, %2, %3, %4, %5, %6, %7}, "\
                 "%8, %9, p, " TAIL ";\n}\n"\
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])\
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))

#define MX_WGMMA_M64N32(KTYPES, TAIL)\
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"\
                 "wgmma.mma_async.sync.aligned.m64n32" KTYPES " {"\
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "\
                 "%16, %17, p, " TAIL ";\n}\n"\
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])\
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))

#define MX_WGMMA_M64N48(KTYPES, TAIL)\
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"\
                 "wgmma.mma_async.sync.aligned.m64n48" KTYPES " {"\
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, "\
                 "%24, %25, p, " TAIL ";\n}\n"\
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])\
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))

#define MX_WGMMA_M64N64(KTYPES, TAIL)\
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"\
                 "wgmma.mma_async.sync.aligned.m64n64" KTYPES " {"\
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "\
                 "%32, %33, p, " TAIL ";\n}\n"\
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])\
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d))

template <typename TA, int N> struct sm90_wgmma;
/* sm90_wgmma<TA, N> for the compiled n of one operand type. */
#define MX_WGMMA_FORM(TA, N, KTYPES, TAIL)                                                                   \
    template <> struct sm90_wgmma<TA, N> {                                                                  \
        static __device__ __forceinline__ void run(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,     \
                                                   int scale_d)                                             \
        {                                                                                                   \
            MX_WGMMA_M64N##N(KTYPES, TAIL);                                                                 \
        }                                                                                                   \
    };
#define MX_WGMMA_FORMS(TA, KTYPES, TAIL)                                                                     \
    MX_WGMMA_FORM(TA, 16, KTYPES, TAIL)                                                                     \
    MX_WGMMA_FORM(TA, 32, KTYPES, TAIL)                                                                     \
    MX_WGMMA_FORM(TA, 48, KTYPES, TAIL)                                                                     \
    MX_WGMMA_FORM(TA, 64, KTYPES, TAIL)                                                                     \
    MX_WGMMA_FORM(TA, 128, KTYPES, TAIL)                                                                    \
    MX_WGMMA_FORM(TA, 256, KTYPES, TAIL)
MX_WGMMA_FORMS(__nv_bfloat16, "k16.f32.bf16.bf16", "1, 1, 0, 0")
MX_WGMMA_FORMS(__half, "k16.f32.f16.f16", "1, 1, 0, 0")
MX_WGMMA_FORMS(__nv_fp8_e4m3, "k32.f32.e4m3.e4m3", "1, 1")
#undef MX_WGMMA_FORMS
#undef MX_WGMMA_FORM


/* amax step over the two values of a stored pair, as rounded to T. */
template <typename T> __device__ __forceinline__ float sm90_amax2(float m, uint32_t packed)
{
    const float2 v = mx_unpack2<T>(packed);
    return mx_amax_step(mx_amax_step(m, v.x), v.y);
}

/* Byte offset of byte `byte` (0..127) of row `row` in a 128B-swizzled box of
 * 128-byte rows (the layout of a CU_TENSOR_MAP_SWIZZLE_128B box): the 16-byte
 * chunk byte / 16 lands at chunk (byte / 16) ^ (row % 8). */
__device__ __forceinline__ uint32_t sw128_offset(int row, uint32_t byte)
{
    return static_cast<uint32_t>(row) * 128u + ((((byte >> 4) ^ static_cast<uint32_t>(row)) & 7u) << 4) + (byte & 15u);
}

/* The 128x128 block scales (sc.w_ld k blocks) of expert `expert`'s weight
 * rows from `row`, a box's first row (a box lies in one scale block); a box
 * past n_rows reads zeros, so it takes the last block's. */
__device__ __forceinline__ const float *sm90_weight_block_scales(const mx_sm90_scales &sc, int expert, int64_t row)
{
    const int64_t block = row / 128 < sc.w_rows ? row / 128 : sc.w_rows - 1;
    return sc.w_scale + (static_cast<int64_t>(expert) * sc.w_rows + block) * sc.w_ld;
}

/* ---- host: tensor maps ----------------------------------------------------------- */

typedef CUresult (*sm90_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                   const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled, fetched once through the runtime so that only
 * cudart_static is linked; nullptr when the driver lacks it. */
inline sm90_encode_fn sm90_encode_tiled()
{
    static std::atomic<sm90_encode_fn> cached{nullptr};
    static std::atomic<int> tried{0};
    sm90_encode_fn fn = cached.load(std::memory_order_acquire);
    if (fn || tried.load(std::memory_order_acquire))
        return fn;
    void *p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
        p = nullptr;
    cudaGetLastError();
    fn = reinterpret_cast<sm90_encode_fn>(p);
    cached.store(fn, std::memory_order_release);
    tried.store(1, std::memory_order_release);
    return fn;
}

/* What a tensor map is built from (128B swizzle). */
struct sm90_map_key {
    const void *addr;
    int dtype;              /* CUtensorMapDataType */
    int rank;               /* 2, 3 or 5 */
    uint64_t dims[5];       /* elements, innermost first */
    uint64_t strides[4];    /* bytes of dims 1.. */
    uint32_t box[5];
    int promotion;          /* CUtensorMapL2promotion */
};

/* Tensor maps are pure host encodings of (address, shape, box): no device
 * call, no synchronization. A small per-thread cache skips re-encoding the
 * maps of unchanged weights and workspace pieces from one forward to the
 * next. 0 => error (message in *st). */
inline int sm90_tensor_map(const sm90_map_key &key, CUtensorMap *out, mx_status *st)
{
    constexpr int kEntries = 32;
    static thread_local sm90_map_key keys[kEntries];
    static thread_local CUtensorMap maps[kEntries];
    static thread_local int used = 0, next = 0;
    for (int i = 0; i < used; ++i)
        if (memcmp(&keys[i], &key, sizeof key) == 0) {
            *out = maps[i];
            return 1;
        }
    sm90_encode_fn encode = sm90_encode_tiled();
    if (!encode) {
        *st = mx_status_fail(MX_ERR_CUDA, "grouped_gemm_sm90: cuTensorMapEncodeTiled is not available");
        return 0;
    }
    const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
    CUresult r = encode(out, static_cast<CUtensorMapDataType>(key.dtype),
                        static_cast<cuuint32_t>(key.rank), const_cast<void *>(key.addr), key.dims, key.strides, key.box,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        static_cast<CUtensorMapL2promotion>(key.promotion), CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        *st = mx_status_fail(MX_ERR_CUDA,
                             "grouped_gemm_sm90: cuTensorMapEncodeTiled error %d (rank %d, dims %llu x %llu x %llu, "
                             "box %u x %u)",
                             (int)r, key.rank, (unsigned long long)key.dims[0], (unsigned long long)key.dims[1],
                             (unsigned long long)key.dims[2], key.box[0], key.box[1]);
        return 0;
    }
    keys[next] = key;
    maps[next] = *out;
    next = (next + 1) % kEntries;
    if (used < kEntries)
        ++used;
    return 1;
}

template <typename T> struct sm90_dtype;
template <> struct sm90_dtype<__nv_bfloat16> {
    static constexpr int kMap = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    static const char *name() { return "bf16"; }
};
template <> struct sm90_dtype<__half> {
    static constexpr int kMap = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    static const char *name() { return "fp16"; }
};
template <> struct sm90_dtype<float> {
    static constexpr int kMap = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
    static const char *name() { return "f32"; }
};
template <> struct sm90_dtype<__nv_fp8_e4m3> {
    static constexpr int kMap = CU_TENSOR_MAP_DATA_TYPE_UINT8; /* raw bytes: the wgmma reads them as e4m3 */
    static const char *name() { return "e4m3"; }
};

/* Tensor map of a K-contiguous operand of TA, 128-byte K boxes of box_rows
 * rows: [rows, k] with row stride `row_stride` elements (rank 2), or, with
 * rank 3, `experts` such matrices expert_stride elements apart. 0 => error
 * (message in *st). */
template <typename TA>
int sm90_kmajor_map(const void *base, int rank, int64_t k, int64_t rows, int64_t row_stride, int64_t experts,
                    int64_t expert_stride, int box_rows, CUtensorMap *map, mx_status *st,
                    int promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
{
    sm90_map_key key;
    memset(&key, 0, sizeof key);
    key.addr = base;
    key.dtype = sm90_dtype<TA>::kMap;
    key.rank = rank;
    key.dims[0] = static_cast<uint64_t>(k);
    key.dims[1] = static_cast<uint64_t>(rows);
    key.dims[2] = static_cast<uint64_t>(experts);
    key.strides[0] = static_cast<uint64_t>(row_stride) * sizeof(TA);
    key.strides[1] = static_cast<uint64_t>(expert_stride) * sizeof(TA);
    key.box[0] = 128 / sizeof(TA);
    key.box[1] = static_cast<uint32_t>(box_rows);
    key.box[2] = 1;
    key.promotion = promotion;
    return sm90_tensor_map(key, map, st);
}

/* Tensor map of A [a_rows, k] (row stride lda elements of TA), boxes of
 * a_box_rows rows. */
template <typename TA>
int sm90_rows_map(const void *a, int64_t lda, int64_t a_rows, int a_box_rows, int64_t k, CUtensorMap *map,
                  mx_status *st)
{
    return sm90_kmajor_map<TA>(a, 2, k, a_rows, lda, 1, 0, a_box_rows, map, st);
}

/* Tensor map of W [experts, n_rows, k], boxes of w_box_rows rows of one
 * expert by 128 bytes of k. packed: W in the packed layout (abi.h
 * weights_packed: [experts, n_rows / 64, k / 128 B, 64, 128 B]), a 5-D map
 * whose boxes are w_box_rows / 64 whole packed blocks (tma_load_w).
 * promotion: the row-major map's L2 promotion. A packed map always takes
 * 128B: its boxes are whole 8 KB pieces, so 256B only fetched the next row
 * of a piece the box reads anyway. Against 256B on the persistent kernel,
 * two calls of two rounds over M = 1024 / 4096 / 16384 (H100, 2026-11-28,
 * logs/2026-11-28-nvidia-h100-ab-packed-promotion-128b.txt): 0.9970 and
 * 0.9966 of the time (Mixtral bf16 -0.6..-1.0%, qwen3moe fp8_block
 * -0.7..-2.0%); the decode kernels were measured with it since packing
 * (benchmarks/NOTES.md "The decode weight stream..."). */
template <typename TA>
int sm90_weight_map(const void *w, int64_t k, int64_t n_rows, int64_t experts, int w_box_rows, bool packed,
                    CUtensorMap *map, mx_status *st, int promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
{
    if (!packed)
        return sm90_kmajor_map<TA>(w, 3, k, n_rows, k, experts, n_rows * k, w_box_rows, map, st, promotion);
    sm90_map_key key;
    memset(&key, 0, sizeof key);
    const uint64_t kb_elems = 128 / sizeof(TA), k_blocks = static_cast<uint64_t>(k) / kb_elems;
    const uint64_t row_blocks = static_cast<uint64_t>(n_rows) / 64, block_bytes = 64 * 128;
    key.addr = w;
    key.dtype = sm90_dtype<TA>::kMap;
    key.rank = 5;
    key.dims[0] = kb_elems;
    key.dims[1] = 64;
    key.dims[2] = k_blocks;
    key.dims[3] = row_blocks;
    key.dims[4] = static_cast<uint64_t>(experts);
    key.strides[0] = 128;
    key.strides[1] = block_bytes;
    key.strides[2] = k_blocks * block_bytes;
    key.strides[3] = row_blocks * k_blocks * block_bytes;
    key.box[0] = static_cast<uint32_t>(kb_elems);
    key.box[1] = 64;
    key.box[2] = 1;
    key.box[3] = static_cast<uint32_t>(w_box_rows / 64);
    key.box[4] = 1;
    key.promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
    return sm90_tensor_map(key, map, st);
}

const char *const sm90_quant_names[] = {"", ", fp8 tensor", ", fp8 block"};


} /* namespace */

#endif /* MOE_EXT_CUDA_SM90_COMMON_CUH */
