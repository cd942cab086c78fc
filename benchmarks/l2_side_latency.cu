/* Can a kernel find which L2 half its SM sits on without profiler counters?
 * (l2_side_probe.cu finds the halves with ncu.) One CTA per SM; the CTA on
 * a reference SM reads every other SM's segment of a buffer (256 lines of
 * 128 bytes each, L2 only), which leaves each line in its home half and a
 * copy in the reference's half; then every other SM walks its own segment
 * as a dependent chain (each line holds the index of the next, a random
 * cycle) and times it with clock64. An SM on the reference's half finds
 * every line in its own half; one on the other half finds the lines whose
 * home is the reference's half only across the fabric, so its walk should
 * take longer per line. Prints, per reference SM, one line of
 * "sm:cycles-per-line" for every SM. Not part of the package; build and run
 * on an sm_90a GPU:
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I benchmarks \
 *        -o /tmp/l2_side_latency benchmarks/l2_side_latency.cu
 *   /tmp/l2_side_latency [reference SM ...]   (default: 0) */
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <random>
#include <vector>

#include "probe_check.cuh"

constexpr int kLines = 256;     /* lines per segment */
constexpr int kLineInts = 32;   /* 128 bytes */
constexpr int kMaxSms = 192;

__global__ void __launch_bounds__(32, 1)
    walk_segments(const uint32_t *buf, int sms, int reference, int *ready, long long *cycles, uint32_t *sink)
{
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    if (smid >= kMaxSms || threadIdx.x != 0)
        return;
    if (static_cast<int>(smid) == reference) {
        uint32_t acc = 0;
        for (int s = 0; s < sms; ++s)
            if (s != reference)
                for (int i = 0; i < kLines; ++i)
                    acc += __ldcg(buf + (static_cast<size_t>(s) * kLines + i) * kLineInts);
        sink[kMaxSms] = acc;
        __threadfence();
        atomicExch(ready, 1);
        return;
    }
    for (long long spins = 0; atomicAdd(ready, 0) == 0; ++spins)
        if (spins > (1ll << 26)) { /* the reference SM got no CTA */
            cycles[smid] = -2;
            return;
        }
    const uint32_t *seg = buf + static_cast<size_t>(smid) * kLines * kLineInts;
    uint32_t line = 0;
    const long long t0 = clock64();
    for (int i = 0; i < kLines; ++i)
        line = __ldcg(seg + static_cast<size_t>(line) * kLineInts);
    const long long t1 = clock64();
    cycles[smid] = (t1 - t0) / kLines;
    sink[smid] = line;
}

int main(int argc, char **argv)
{
    const int sms = one_cta_per_sm(walk_segments, kMaxSms);
    /* each segment one random cycle through its lines, starting at line 0 */
    std::vector<uint32_t> host(static_cast<size_t>(sms) * kLines * kLineInts, 0);
    std::mt19937 rng(1);
    for (int s = 0; s < sms; ++s) {
        std::vector<uint32_t> order(kLines);
        for (int i = 0; i < kLines; ++i)
            order[i] = static_cast<uint32_t>(i);
        std::shuffle(order.begin() + 1, order.end(), rng);
        for (int i = 0; i < kLines; ++i)
            host[(static_cast<size_t>(s) * kLines + order[i]) * kLineInts] = order[(i + 1) % kLines];
    }
    uint32_t *buf = nullptr, *sink = nullptr;
    int *ready = nullptr;
    long long *cycles = nullptr;
    CHECK(cudaMalloc(&buf, host.size() * sizeof(uint32_t)));
    CHECK(cudaMemcpy(buf, host.data(), host.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&sink, sizeof(uint32_t) * (kMaxSms + 1)));
    CHECK(cudaMalloc(&ready, sizeof(int)));
    CHECK(cudaMalloc(&cycles, sizeof(long long) * kMaxSms));
    /* an L2-sized buffer read between runs, so that no run finds the last one's lines */
    void *flush = nullptr;
    const size_t flush_bytes = size_t{128} << 20;
    CHECK(cudaMalloc(&flush, flush_bytes));
    std::vector<int> refs;
    for (int a = 1; a < argc; ++a)
        refs.push_back(atoi(argv[a]));
    if (refs.empty())
        refs.push_back(0);
    for (int reference : refs) {
        if (reference < 0 || reference >= sms)
            continue;
        CHECK(cudaMemset(flush, reference & 0xff, flush_bytes));
        CHECK(cudaMemset(ready, 0, sizeof(int)));
        CHECK(cudaMemset(cycles, 0xff, sizeof(long long) * kMaxSms));
        walk_segments<<<sms, 32, kOneCtaPerSmSmemBytes>>>(buf, sms, reference, ready, cycles, sink);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        std::vector<long long> got(kMaxSms);
        CHECK(cudaMemcpy(got.data(), cycles, sizeof(long long) * kMaxSms, cudaMemcpyDeviceToHost));
        printf("reference %d:", reference);
        for (int s = 0; s < sms; ++s)
            printf(" %d:%lld", s, got[s]);
        printf("\n");
    }
    CHECK(cudaFree(flush));
    CHECK(cudaFree(buf));
    CHECK(cudaFree(sink));
    CHECK(cudaFree(ready));
    CHECK(cudaFree(cycles));
    return 0;
}
