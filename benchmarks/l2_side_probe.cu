/* Probe of Hopper's two L2 halves: which SMs share a copy of a line, and
 * what reading one buffer from SMs on both halves costs in DRAM bytes.
 * Every launch is one CTA per SM (the dynamic shared memory it asks for
 * leaves room for no second); the CTAs whose SM is in the launch's mask read the whole
 * buffer `passes` times with ld.global.cg (L2, not L1), the others return.
 * Launches, in order:
 *   1. SM 0 and SM j, for j = 1 .. SMs - 1, one pass over 16 MB;
 *   2. every SM, one pass over 16 MB;
 *   3. every SM, two passes over 16, 24, 32, 40 and 48 MB.
 * Given one half's SMs (a comma list), instead, for 16, 24, 32 and 40 MB:
 * that half two passes, the other half two passes, then both halves at once,
 * each over its own buffer of that size.
 * Run under ncu with its cache control (L2 flushed before each launch) and
 * read DRAM bytes and the L2 fabric's sectors per launch: a pair whose
 * reads cross the fabric, or read the buffer twice from DRAM, sits on two
 * halves. Each launch prints its mask's SMs that got no CTA (none
 * expected). Not part of the package; build and run on an sm_90a GPU:
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/l2_side_probe benchmarks/l2_side_probe.cu
 *   ncu --clock-control none --cache-control all --csv \
 *       --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_ltcfabric.sum /tmp/l2_side_probe */
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_check.cuh"

constexpr int kThreads = 512;
constexpr int kMaxSms = 192;

struct sm_mask {
    uint64_t bits[kMaxSms / 64];
};

static __host__ __device__ bool has(const sm_mask &m, unsigned sm)
{
    return sm < kMaxSms && ((m.bits[sm / 64] >> (sm % 64)) & 1u);
}

/* CTAs on the SMs of `mask` read buf[0, n), those of `other` buf[n, 2n) */
__global__ void __launch_bounds__(kThreads, 1)
    read_buffer(const int4 *buf, size_t n, int passes, sm_mask mask, sm_mask other, int *seen, int *sink)
{
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    if (!has(mask, smid) && !has(other, smid))
        return;
    if (threadIdx.x == 0)
        seen[smid] = 1;
    if (!has(mask, smid))
        buf += n;
    int acc = 0;
    for (int p = 0; p < passes; ++p)
        for (size_t i = threadIdx.x; i < n; i += kThreads) {
            const int4 v = __ldcg(buf + i);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    if (acc == 0x7fffffff)
        sink[0] = acc; /* keeps the loads */
}

static void run(const int4 *buf, size_t bytes, int passes, const sm_mask &mask, int sms, int *seen, int *sink,
                const char *what, const sm_mask &other = sm_mask{})
{
    CHECK(cudaMemset(seen, 0, sizeof(int) * kMaxSms));
    read_buffer<<<sms, kThreads, kOneCtaPerSmSmemBytes>>>(buf, bytes / sizeof(int4), passes, mask, other, seen, sink);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<int> got(kMaxSms);
    CHECK(cudaMemcpy(got.data(), seen, sizeof(int) * kMaxSms, cudaMemcpyDeviceToHost));
    printf("launch %s, %zu MB x %d:", what, bytes >> 20, passes);
    for (int s = 0; s < sms; ++s)
        if ((has(mask, s) || has(other, s)) && !got[s])
            printf(" SM %d got no CTA", s);
    printf("\n");
}

int main(int argc, char **argv)
{
    const int sms = one_cta_per_sm(read_buffer, kMaxSms);
    const size_t max_bytes = size_t{96} << 20;
    int4 *buf = nullptr;
    int *seen = nullptr, *sink = nullptr;
    CHECK(cudaMalloc(&buf, max_bytes));
    CHECK(cudaMemset(buf, 1, max_bytes));
    CHECK(cudaMalloc(&seen, sizeof(int) * kMaxSms));
    CHECK(cudaMalloc(&sink, sizeof(int)));
    char what[64];
    if (argc > 1) {
        /* argv[1]: the SMs of one half (from a run without arguments) */
        sm_mask half = {}, rest = {};
        for (char *tok = strtok(argv[1], ","); tok; tok = strtok(nullptr, ","))
            if (atoi(tok) >= 0 && atoi(tok) < sms)
                half.bits[atoi(tok) / 64] |= uint64_t{1} << (atoi(tok) % 64);
        for (int s = 0; s < sms; ++s)
            if (!has(half, s))
                rest.bits[s / 64] |= uint64_t{1} << (s % 64);
        for (int mb = 16; mb <= 40; mb += 8) {
            run(buf, size_t(mb) << 20, 2, half, sms, seen, sink, "half twice");
            run(buf, size_t(mb) << 20, 2, rest, sms, seen, sink, "rest twice");
            run(buf, size_t(mb) << 20, 2, half, sms, seen, sink, "half one, rest another, twice", rest);
        }
        return 0;
    }
    for (int j = 1; j < sms; ++j) {
        sm_mask m = {};
        m.bits[0] = 1u;
        m.bits[j / 64] |= uint64_t{1} << (j % 64);
        snprintf(what, sizeof what, "pair 0 %d", j);
        run(buf, size_t{16} << 20, 1, m, sms, seen, sink, what);
    }
    sm_mask all = {};
    for (int s = 0; s < sms; ++s)
        all.bits[s / 64] |= uint64_t{1} << (s % 64);
    run(buf, size_t{16} << 20, 1, all, sms, seen, sink, "all");
    for (int mb = 16; mb <= 48; mb += 8)
        run(buf, size_t(mb) << 20, 2, all, sms, seen, sink, "all twice");
    CHECK(cudaFree(buf));
    CHECK(cudaFree(seen));
    CHECK(cudaFree(sink));
    return 0;
}
