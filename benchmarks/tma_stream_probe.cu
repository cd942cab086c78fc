/* DRAM read probe for the Hopper decode kernel's weight stream: CTAs read
 * tiles of weight rows [rows, K] (bfloat16, K contiguous) through a ring of
 * TMA boxes (64 columns = 128 bytes x box rows, 128B swizzle) and do no
 * math, so each line is the rate a load pattern allows: rows per CTA,
 * k blocks (128 bytes of K) per stage, stages, CTAs per SM and the tensor
 * map's L2 promotion; then small grids of back-to-back launches (the time
 * a grid of a few hundred tiles takes, ramp and tail included). A plain
 * LDG.128 stream and cudaMemset give the ceilings of the same run. The
 * "packed" lines read the same bytes as a tile-contiguous layout (each
 * stage's box one contiguous piece: weights repacked at load time) for
 * the decode kernel's GEMM1 rings. Not
 * part of the package or its tests; build and run on an sm_90a GPU:
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a \
 *        -I csrc/include -I csrc/cuda -o /tmp/tma_stream_probe benchmarks/tma_stream_probe.cu
 *   /tmp/tma_stream_probe
 * (benchmarks/NOTES.md, "Two k blocks per decode stage", has its results.) */
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "probe_check.cuh"
#include "sm90_common.cuh" /* the decode kernel's own mbarrier, TMA and tensor-map helpers */

/* A CTA per tile of ROWS rows x K; a stage: ROWS rows x KCH k blocks, as
 * ROWS / BOXR x KCH boxes, a row group's k blocks issued together. Thread 0
 * refills a slot as soon as its bytes have landed. PACKED: the same bytes
 * as a tile-contiguous layout (tile t's k blocks one after another, each
 * its ROWS rows of 128 bytes, so a stage is one contiguous piece: weights
 * repacked at load time); the map then sees rows of 128 bytes. */
template <int ROWS, int BOXR, int KCH, int STAGES, bool PACKED = false>
__global__ void __launch_bounds__(128) tma_stream(const __grid_constant__ CUtensorMap map, int k, int *sink)
{
    extern __shared__ __align__(1024) unsigned char ring[];
    __shared__ __align__(8) uint64_t bars[STAGES];
    constexpr uint32_t STAGE = ROWS * KCH * 128;
    const uint32_t base = (mx_smem_addr(ring) + 1023u) & ~1023u;
    const int k_stages = k / (64 * KCH);
    if (threadIdx.x != 0)
        return;
    for (int s = 0; s < STAGES; ++s)
        mbar_init(mx_smem_addr(&bars[s]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    const int r0 = blockIdx.x * (PACKED ? k_stages * KCH : 1) * ROWS;
    auto issue = [&](int ks, int s) {
        const uint32_t dst = base + s * STAGE, bar = mx_smem_addr(&bars[s]);
        mbar_arrive_expect_tx(bar, STAGE);
        for (int g = 0; g < ROWS / BOXR; ++g)
            for (int c = 0; c < KCH; ++c) {
                if (PACKED)
                    tma_load_2d(dst + (c * ROWS + g * BOXR) * 128, &map, bar, 0, r0 + (ks * KCH + c) * ROWS + g * BOXR);
                else
                    tma_load_2d(dst + (c * ROWS + g * BOXR) * 128, &map, bar, (ks * KCH + c) * 64, r0 + g * BOXR);
            }
    };
    for (int s = 0; s < STAGES && s < k_stages; ++s)
        issue(s, s);
    for (int ks = 0; ks < k_stages; ++ks) {
        const int s = ks % STAGES;
        mbar_wait(mx_smem_addr(&bars[s]), static_cast<uint32_t>(ks / STAGES) & 1u);
        if (ks + STAGES < k_stages)
            issue(ks + STAGES, s);
    }
    if (blockIdx.x == 0)
        sink[0] = 1;
}

/* The reference stream: 16-byte loads, four in flight per thread. */
__global__ void ldg_stream(const int4 *p, long long n, int *sink)
{
    int acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const int4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride),
                   d = __ldcs(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride)
        acc ^= __ldcs(p + i).x;
    if (acc == 0x12345678)
        sink[1] = 1;
}

/* The decode kernel's own map of [rows, k] bfloat16 rows (sm90_common.cuh
 * sm90_kmajor_map: 128B swizzle, boxes of 64 columns x box_rows). */
static CUtensorMap rows_map(void *p, long long rows, int k, int box_rows, CUtensorMapL2promotion promotion)
{
    CUtensorMap map;
    mx_status st;
    if (!sm90_kmajor_map<__nv_bfloat16>(p, 2, k, rows, k, 1, 0, box_rows, &map, &st, promotion)) {
        printf("%s\n", st.message);
        exit(1);
    }
    return map;
}

/* TB/s of the median of 10 timed passes (after 2 untimed). */
static double rate(const std::function<void()> &pass, double bytes)
{
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    std::vector<float> ms;
    for (int i = 0; i < 12; ++i) {
        CHECK(cudaEventRecord(t0));
        pass();
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float m = 0;
        CHECK(cudaEventElapsedTime(&m, t0, t1));
        if (i >= 2)
            ms.push_back(m);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    CHECK(cudaEventDestroy(t0));
    CHECK(cudaEventDestroy(t1));
    return bytes / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

template <int ROWS, int BOXR, int KCH, int STAGES, bool PACKED = false>
static void probe(const char *name, void *p, long long rows, int k, int ctas_per_sm, int *sink,
                  CUtensorMapL2promotion promotion)
{
    auto kernel = tma_stream<ROWS, BOXR, KCH, STAGES, PACKED>;
    const int smem = std::min(233472 / ctas_per_sm - 2048, 227 * 1024 - 2048); /* holds the SM to ctas_per_sm */
    const int need = STAGES * ROWS * KCH * 128 + 1024;
    if (need > smem) {
        printf("%-40s needs %d bytes of shared memory, over %d\n", name, need, smem);
        return;
    }
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const CUtensorMap map = PACKED ? rows_map(p, rows * k / 64, 64, BOXR, promotion) : rows_map(p, rows, k, BOXR, promotion);
    const int tiles = (int)(rows / ROWS);
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 128, smem));
    const double tbs = rate([&] { kernel<<<tiles, 128, smem>>>(map, k, sink); }, (double)rows * k * 2);
    printf("%s%-*s K=%5d promotion %s tiles %6d  %d/SM  %.3f TB/s\n", PACKED ? "packed " : "", PACKED ? 33 : 40, name, k,
           promotion == CU_TENSOR_MAP_L2_PROMOTION_L2_128B ? "128B" : "256B", tiles, per_sm, tbs);
}

/* Small grids: `ctas` CTAs of one tile each, passes of 30 launches back to
 * back, each over its own slice of the buffer (no L2 reuse between
 * launches); microseconds per launch. */
template <int ROWS, int BOXR, int KCH, int STAGES>
static void small_grid(const char *name, void *p, long long bytes, int k, int ctas, int ctas_per_sm, int *sink,
                       CUtensorMapL2promotion promotion)
{
    auto kernel = tma_stream<ROWS, BOXR, KCH, STAGES>;
    const int smem = std::min(233472 / ctas_per_sm - 2048, 227 * 1024 - 2048);
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const long long slice = (long long)ctas * ROWS * k * 2;
    const int slices = (int)(bytes / slice);
    constexpr int kLaunches = 30;
    std::vector<CUtensorMap> maps; /* one per launch of a pass */
    for (int i = 0; i < kLaunches; ++i)
        maps.push_back(rows_map((char *)p + (long long)(i % slices) * slice, (long long)ctas * ROWS, k, BOXR, promotion));
    const double tbs = rate(
        [&] {
            for (int i = 0; i < kLaunches; ++i)
                kernel<<<ctas, 128, smem>>>(maps[i], k, sink);
        },
        (double)slice * kLaunches);
    printf("%-40s K=%5d promotion %s %4d CTAs  %.2f us per launch, %.3f TB/s\n", name, k,
           promotion == CU_TENSOR_MAP_L2_PROMOTION_L2_128B ? "128B" : "256B", ctas, slice / (tbs * 1e6), tbs);
}

int main()
{
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    const long long bytes = 1879048192LL; /* 1.75 GiB: far past L2 */
    void *p = nullptr;
    int *sink = nullptr;
    CHECK(cudaMalloc(&p, bytes));
    CHECK(cudaMalloc(&sink, 64));
    CHECK(cudaMemset(p, 1, bytes));
    const int sms = prop.multiProcessorCount;
    printf("%-40s %.3f TB/s\n", "LDG.128 stream",
           rate([&] { ldg_stream<<<sms * 8, 512>>>((const int4 *)p, bytes / 16, sink); }, (double)bytes));
    printf("%-40s %.3f TB/s (write)\n", "cudaMemset", rate([&] { CHECK(cudaMemsetAsync(p, 0, bytes)); }, (double)bytes));
    CHECK(cudaMemset(p, 1, bytes));
    const auto p256 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B, p128 = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
    for (int k : {768, 2048, 2880, 3584, 4096, 4160, 14336}) {
        long long rows = bytes / (k * 2);
        rows -= rows % 256;
        probe<128, 64, 1, 4>("128 rows, 1 k block x 4 stages", p, rows, k, 3, sink, p256);
        probe<128, 64, 1, 4>("128 rows, 1 k block x 4 stages", p, rows, k, 3, sink, p128);
        probe<128, 64, 1, 4>("128 rows, 1 k block x 4 stages", p, rows, k, 2, sink, p128);
        probe<128, 64, 1, 6>("128 rows, 1 k block x 6 stages", p, rows, k, 2, sink, p256);
        probe<128, 64, 2, 2>("128 rows, 2 k blocks x 2 stages", p, rows, k, 3, sink, p256);
        probe<128, 64, 2, 2>("128 rows, 2 k blocks x 2 stages", p, rows, k, 3, sink, p128);
        probe<128, 64, 2, 3>("128 rows, 2 k blocks x 3 stages", p, rows, k, 2, sink, p128);
        probe<64, 64, 2, 4>("64 rows, 2 k blocks x 4 stages", p, rows, k, 3, sink, p128);
        probe<32, 32, 4, 4>("32 rows, 4 k blocks x 4 stages", p, rows, k, 3, sink, p128);
    }
    for (int k : {768, 2048, 4096, 14336}) {
        long long rows = bytes / (k * 2);
        rows -= rows % 256;
        probe<128, 64, 1, 3>("128 rows, 1 k block x 3 stages", p, rows, k, 3, sink, p256);
        probe<128, 64, 1, 3, true>("128 rows, 1 k block x 3 stages", p, rows, k, 3, sink, p256);
        probe<128, 64, 1, 3, true>("128 rows, 1 k block x 3 stages", p, rows, k, 3, sink, p128);
        probe<128, 128, 1, 3, true>("128 rows, 1 k block x 3 stages, 1 box", p, rows, k, 3, sink, p256);
        probe<128, 64, 1, 4, true>("128 rows, 1 k block x 4 stages", p, rows, k, 3, sink, p256);
        probe<128, 64, 1, 4, true>("128 rows, 1 k block x 4 stages", p, rows, k, 3, sink, p128);
        probe<128, 64, 1, 6, true>("128 rows, 1 k block x 6 stages", p, rows, k, 2, sink, p256);
        probe<128, 64, 1, 2, true>("128 rows, 1 k block x 2 stages", p, rows, k, 3, sink, p256);
    }
    /* qwen3moe's GEMM1 at M = 1 is 96 tiles of 128 rows x 2048 (50 MB) */
    for (int ctas : {96, 132, 192, 264, 396, 792}) {
        small_grid<128, 64, 1, 4>("128 rows, 1 k block x 4 stages", p, bytes, 2048, ctas, 3, sink, p256);
        small_grid<128, 64, 1, 12>("128 rows, 1 k block x 12 stages", p, bytes, 2048, ctas, 1, sink, p256);
        small_grid<128, 64, 2, 3>("128 rows, 2 k blocks x 3 stages", p, bytes, 2048, ctas, 2, sink, p128);
    }
    for (int ctas : {192, 264, 396})
        small_grid<64, 64, 2, 4>("64 rows, 2 k blocks x 4 stages", p, bytes, 2048, ctas, 3, sink, p128);
    CHECK(cudaDeviceSynchronize());
    return 0;
}
