/* Latency probe of one token's top-k routing (route_token.cuh) by one warp,
 * the decode kernels' first phase: per config, clock cycles and ns of
 * route_token<EPL> run back to back in one warp (the first run cold, the
 * rest warm), and of route_token_split.cuh's E / 32 warps where it
 * applies, to split the ~4.5 us seen at E = 128, k = 8 inside
 * decode_fused_kernel into its parts by varying k, scoring and E. Then a
 * fingerprint of the routing's output bits over many random tokens (ties,
 * NaN and infinite logits, groups, every logits dtype), so that two builds
 * of route_token.cuh / route_token_split.cuh can be compared bit for bit,
 * and the split path against the one-warp path. Not part of the package or
 * its tests; build and run on an sm_90a GPU:
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a \
 *        -I csrc/include -I csrc/cuda -o /tmp/route_probe benchmarks/route_probe.cu
 *   /tmp/route_probe */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_check.cuh"
#include "route_token.cuh"
#include "route_token_split.cuh"

constexpr int kReps = 16;

__device__ __forceinline__ unsigned long long global_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

template <int EPL> __global__ void probe_kernel(mx_routing_problem p, long long *cycles, long long *ns)
{
    extern __shared__ float rows[];
    const int lane = threadIdx.x & 31;
    for (int rep = 0; rep < kReps; ++rep) {
        __syncwarp();
        const long long c0 = clock64();
        const unsigned long long n0 = global_ns();
        route_token<EPL>(p, 0, rows, lane, nullptr);
        __syncwarp();
        const long long c1 = clock64();
        const unsigned long long n1 = global_ns();
        if (lane == 0) {
            cycles[rep] = c1 - c0;
            ns[rep] = static_cast<long long>(n1 - n0);
        }
    }
}

template <int EPL> __global__ void route_tokens_kernel(mx_routing_problem p)
{
    extern __shared__ float rows[];
    route_token<EPL>(p, blockIdx.x, rows, threadIdx.x & 31, nullptr);
}

/* route_token_split: a block of E / 32 warps per token */
__global__ void route_split_tokens_kernel(mx_routing_problem p)
{
    extern __shared__ float rows[];
    route_token_split(p, blockIdx.x, rows, threadIdx.x >> 5, threadIdx.x & 31, nullptr);
}

__global__ void probe_split_kernel(mx_routing_problem p, long long *cycles, long long *ns)
{
    extern __shared__ float rows[];
    for (int rep = 0; rep < kReps; ++rep) {
        __syncthreads();
        const long long c0 = clock64();
        const unsigned long long n0 = global_ns();
        route_token_split(p, 0, rows, threadIdx.x >> 5, threadIdx.x & 31, nullptr);
        __syncthreads();
        const long long c1 = clock64();
        const unsigned long long n1 = global_ns();
        if (threadIdx.x == 0) {
            cycles[rep] = c1 - c0;
            ns[rep] = static_cast<long long>(n1 - n0);
        }
    }
}

struct config {
    const char *name;
    int E, k;
    mx_scoring scoring;
    int renormalize, groups, topk_group, bias;
    mx_dtype dtype;
};

/* c's routing of `tokens` tokens (float32 bias, scaling factor `scaling`) */
static mx_routing_problem problem_of(const config &c, int64_t tokens, float scaling, const void *logits,
                                     const float *bias, float *w, int32_t *ids)
{
    mx_routing_problem p{};
    p.num_tokens = tokens;
    p.num_experts = c.E;
    p.top_k = c.k;
    p.scoring = c.scoring;
    p.renormalize = c.renormalize;
    p.num_expert_group = c.groups;
    p.topk_group = c.topk_group;
    p.routed_scaling_factor = scaling;
    p.logits_dtype = c.dtype;
    p.router_logits = logits;
    p.bias_dtype = MX_F32;
    p.correction_bias = c.bias ? bias : nullptr;
    p.topk_weights = w;
    p.topk_ids = ids;
    return p;
}

/* Waits for the probe kernel just launched; prints its first (cold) run and
 * the median of the warm ones. */
static void print_times(const char *name, const char *path, const long long *cyc, const long long *ns)
{
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    long long hc[kReps], hn[kReps];
    CHECK(cudaMemcpy(hc, cyc, sizeof hc, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hn, ns, sizeof hn, cudaMemcpyDeviceToHost));
    std::vector<long long> wc(hc + 1, hc + kReps), wn(hn + 1, hn + kReps);
    std::sort(wc.begin(), wc.end());
    std::sort(wn.begin(), wn.end());
    printf("%-34s %-14s cold %6lld cyc %6lld ns  warm median %6lld cyc %6lld ns\n", name, path, hc[0], hn[0],
           wc[wc.size() / 2], wn[wn.size() / 2]);
}

template <int EPL> void run(const config &c, const void *logits, const float *bias, float *w, int32_t *ids,
                            long long *cyc, long long *ns)
{
    const mx_routing_problem p = problem_of(c, 1, 1.0f, logits, bias, w, ids);
    const size_t smem = route_warp_bytes(c.E);
    char path[32];
    probe_kernel<EPL><<<1, 32, smem>>>(p, cyc, ns);
    snprintf(path, sizeof path, "EPL %d", EPL);
    print_times(c.name, path, cyc, ns);
    if (!route_split_usable(&p))
        return;
    probe_split_kernel<<<1, c.E, smem>>>(p, cyc, ns);
    snprintf(path, sizeof path, "split %d warps", c.E / 32);
    print_times(c.name, path, cyc, ns);
}

/* v's bfloat16 bits, truncated (the probe's logits are exact in bfloat16,
 * or only timed) */
static uint16_t bf16_bits(float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    return static_cast<uint16_t>(u >> 16);
}

/* FNV-1a over bytes, continuing from h. */
static uint64_t fingerprint(const void *data, size_t bytes, uint64_t h)
{
    const unsigned char *b = static_cast<const unsigned char *>(data);
    for (size_t i = 0; i < bytes; ++i)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* The routing outputs of the kernel just launched: its weights' and ids'
 * bytes, and their fingerprint. */
struct routed {
    std::vector<float> w;
    std::vector<int32_t> ids;
    uint64_t print;
    routed(const float *dw, const int32_t *dids, size_t n) : w(n), ids(n)
    {
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(w.data(), dw, n * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(ids.data(), dids, n * 4, cudaMemcpyDeviceToHost));
        print = fingerprint(ids.data(), n * 4, fingerprint(w.data(), n * 4, 1469598103934665603ull));
    }
    bool operator==(const routed &o) const
    {
        return w.size() == o.w.size() && !memcmp(w.data(), o.w.data(), w.size() * 4) && ids == o.ids;
    }
};

/* One of 9 logit levels in [-1, 1] */
static float random_level() { return static_cast<float>(rand() % 9) * 0.25f - 1.0f; }

/* Routes kTokens random tokens per case (logits from a few levels, so that
 * ties are common, with NaN and +-inf sprinkled in) and prints one
 * fingerprint per case (and of the split path where it applies) and one
 * over all. */
static void fingerprints()
{
    constexpr int kTokens = 512;
    const int maxE = 384;
    const config cases[] = {
        {"", 8, 2, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},    {"", 32, 4, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_BF16},
        {"", 60, 6, MX_SCORING_SOFTMAX, 0, 0, 0, 0, MX_F32},   {"", 64, 8, MX_SCORING_SIGMOID, 1, 4, 2, 0, MX_F16},
        {"", 128, 8, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},  {"", 128, 8, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_BF16},
        {"", 128, 1, MX_SCORING_SOFTMAX, 0, 0, 0, 1, MX_F32},  {"", 128, 40, MX_SCORING_SIGMOID, 1, 0, 0, 1, MX_F32},
        {"", 160, 6, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F16},  {"", 256, 8, MX_SCORING_SIGMOID, 1, 8, 4, 1, MX_F32},
        {"", 256, 8, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_BF16}, {"", 384, 8, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},
        {"", 128, 8, MX_SCORING_SIGMOID, 1, 0, 0, 1, MX_BF16}, {"", 64, 6, MX_SCORING_SIGMOID, 0, 0, 0, 1, MX_F32},
        {"", 160, 8, MX_SCORING_SIGMOID, 1, 0, 0, 0, MX_F16},  {"", 256, 8, MX_SCORING_SIGMOID, 1, 0, 0, 0, MX_F32},
        {"", 256, 16, MX_SCORING_SIGMOID, 1, 8, 2, 1, MX_F32},
    };
    std::vector<float> hl(static_cast<size_t>(kTokens) * maxE), hb(maxE);
    std::vector<uint16_t> h16(hl.size());
    void *logits;
    float *bias, *w;
    int32_t *ids;
    CHECK(cudaMalloc(&logits, hl.size() * 4));
    CHECK(cudaMalloc(&bias, maxE * 4));
    CHECK(cudaMalloc(&w, kTokens * 64 * 4));
    CHECK(cudaMalloc(&ids, kTokens * 64 * 4));
    uint64_t all = 1469598103934665603ull;
    srand(7);
    for (const config &c : cases) {
        for (size_t i = 0; i < static_cast<size_t>(kTokens) * c.E; ++i) {
            const int r = rand() % 1000;
            hl[i] = r == 0 ? NAN : r == 1 ? INFINITY : r == 2 ? -INFINITY : random_level();
            const __half hh = __float2half(hl[i]);
            h16[i] = c.dtype == MX_BF16 ? bf16_bits(hl[i]) : *reinterpret_cast<const uint16_t *>(&hh);
        }
        for (int e = 0; e < c.E; ++e)
            hb[e] = static_cast<float>(rand() % 5) * 0.125f;
        if (c.dtype == MX_F32)
            CHECK(cudaMemcpy(logits, hl.data(), static_cast<size_t>(kTokens) * c.E * 4, cudaMemcpyHostToDevice));
        else
            CHECK(cudaMemcpy(logits, h16.data(), static_cast<size_t>(kTokens) * c.E * 2, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(bias, hb.data(), c.E * 4, cudaMemcpyHostToDevice));
        const mx_routing_problem p = problem_of(c, kTokens, 2.5f, logits, bias, w, ids);
        const size_t n = static_cast<size_t>(kTokens) * c.k;
        route_pick_experts_per_lane(c.E, [&](auto epl) {
            route_tokens_kernel<decltype(epl)::value><<<kTokens, 32, route_warp_bytes(c.E)>>>(p);
            return 0;
        });
        const routed one(w, ids, n);
        all = fingerprint(&one.print, sizeof one.print, all);
        printf("fingerprint E %3d k %2d %s renorm %d groups %d/%d bias %d dtype %d: %016llx\n", c.E, c.k,
               c.scoring == MX_SCORING_SOFTMAX ? "softmax" : "sigmoid", c.renormalize, c.groups, c.topk_group, c.bias,
               static_cast<int>(c.dtype), static_cast<unsigned long long>(one.print));
        if (route_split_usable(&p)) {
            CHECK(cudaMemset(w, 0xff, kTokens * 64 * 4));
            route_split_tokens_kernel<<<kTokens, c.E, route_warp_bytes(c.E)>>>(p);
            const routed split(w, ids, n);
            all = fingerprint(&split.print, sizeof split.print, all);
            printf("  split (E / 32 warps): %016llx, %s the one-warp path's bits\n",
                   static_cast<unsigned long long>(split.print), split == one ? "equal to" : "DIFFERENT FROM");
        }
    }
    printf("fingerprint of all cases: %016llx\n", static_cast<unsigned long long>(all));
}

int main()
{
    const int maxE = 256;
    std::vector<float> hl(maxE), hb(maxE);
    srand(1);
    for (int i = 0; i < maxE; ++i) {
        hl[i] = static_cast<float>(rand()) / RAND_MAX * 4.0f - 2.0f;
        hb[i] = static_cast<float>(rand()) / RAND_MAX * 0.1f;
    }
    std::vector<uint16_t> hbf(maxE);
    std::transform(hl.begin(), hl.end(), hbf.begin(), bf16_bits);
    float *logits, *bias, *w;
    void *logits_bf;
    int32_t *ids;
    long long *cyc, *ns;
    CHECK(cudaMalloc(&logits, maxE * 4));
    CHECK(cudaMalloc(&logits_bf, maxE * 2));
    CHECK(cudaMalloc(&bias, maxE * 4));
    CHECK(cudaMalloc(&w, 64 * 4));
    CHECK(cudaMalloc(&ids, 64 * 4));
    CHECK(cudaMalloc(&cyc, kReps * 8));
    CHECK(cudaMalloc(&ns, kReps * 8));
    CHECK(cudaMemcpy(logits, hl.data(), maxE * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(logits_bf, hbf.data(), maxE * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(bias, hb.data(), maxE * 4, cudaMemcpyHostToDevice));
    const config cs[] = {
        {"qwen3moe E128 k8 softmax renorm", 128, 8, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},
        {"E128 k8 softmax renorm bf16", 128, 8, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_BF16},
        {"E128 k1 softmax renorm", 128, 1, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},
        {"E128 k4 softmax renorm", 128, 4, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},
        {"E128 k8 softmax no renorm", 128, 8, MX_SCORING_SOFTMAX, 0, 0, 0, 0, MX_F32},
        {"E128 k8 sigmoid renorm", 128, 8, MX_SCORING_SIGMOID, 1, 0, 0, 0, MX_F32},
        {"E32 k4 softmax renorm (gpt-oss)", 32, 4, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},
        {"E8 k2 softmax renorm (mixtral)", 8, 2, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},
        {"E64 k8 softmax renorm", 64, 8, MX_SCORING_SOFTMAX, 1, 0, 0, 0, MX_F32},
        {"E256 k8 sigmoid g8/4 bias (dsv3)", 256, 8, MX_SCORING_SIGMOID, 1, 8, 4, 1, MX_F32},
    };
    for (const config &c : cs) {
        const void *lg = c.dtype == MX_BF16 ? logits_bf : logits;
        route_pick_experts_per_lane(c.E, [&](auto epl) {
            run<decltype(epl)::value>(c, lg, bias, w, ids, cyc, ns);
            return 0;
        });
    }
    fingerprints();
    return 0;
}
