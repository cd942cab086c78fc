/* Top-k routing of one token by W = E / 32 warps (one expert per lane), for
 * the fused route + sort kernel at decode (route_align.cu) with many
 * experts: DeepSeek-V3's E = 256 on one warp keeps 8 experts per lane and
 * takes ~20 us per token in the layer, most of it the cold fetch of that
 * long path. Here each warp runs the 1-expert-per-lane path on its 32
 * experts and picks its own top k; the token's first warp merges the W x k
 * candidates (the global top k is among them: every expert ahead of a
 * chosen one in the order is in the same warp's list or chosen first).
 *
 * Taken only when the arithmetic is the same as route_token's, bit for bit:
 * sigmoid scoring (no sum across lanes), E % 32 == 0, groups either absent
 * or of exactly 32 experts (a group is one warp: its two largest choices by
 * a butterfly), k <= kSplitMaxTopK. route_split_usable says so.
 *
 * Shared memory: the token's 4 x E floats of route_rows; candidates in the
 * first half of score (values, [W k]) and choice (weights), their ids in
 * the second half of group, the group scores in the second half of aux;
 * the slots in group / aux [k] as route_write reads them. */
#ifndef MOE_EXT_CUDA_ROUTE_TOKEN_SPLIT_CUH
#define MOE_EXT_CUDA_ROUTE_TOKEN_SPLIT_CUH

#include "route_token.cuh"

namespace {

constexpr int kSplitMaxTopK = 16;   /* W k <= E / 2 */
constexpr int kSplitMergePerLane = 2; /* W k <= 64 candidates for the merging warp */

inline bool route_split_usable(const mx_routing_problem *p)
{
    const int64_t E = p->num_experts;
    return p->scoring == MX_SCORING_SIGMOID && E % 32 == 0 && E / 32 * p->top_k <= 32 * kSplitMergePerLane &&
           p->top_k <= kSplitMaxTopK && (p->num_expert_group == 0 || E / p->num_expert_group == 32);
}

/* Warp w (of W) of token t, lane: routes experts 32 w + lane. Every thread
 * of the block calls it (two block barriers), each for a token. Warp 0 of
 * the token writes the outputs (and ids_copy) as route_write does. */
__device__ __forceinline__ void route_token_split(const mx_routing_problem &p, int64_t t, float *rows, int w,
                                                  int lane, int32_t *ids_copy)
{
    const int E = static_cast<int>(p.num_experts), W = E / 32, k = p.top_k;
    const route_rows r(rows, E);
    float *cand_value = r.score, *cand_weight = r.choice, *group_score = reinterpret_cast<float *>(r.aux) + E / 2;
    int *cand_id = reinterpret_cast<int *>(r.group) + E / 2;
    const int e = 32 * w + lane;
    const float score = 1.0f / (1.0f + expf(-mx_load_float(p.router_logits, p.logits_dtype, t * E + e)));
    float choice = score;
    if (p.correction_bias)
        choice += mx_load_float(p.correction_bias, p.bias_dtype, e);
    choice = isnan(choice) ? -INFINITY : choice;
    if (p.num_expert_group > 0) { /* group w: the warp's two largest choices */
        float m1 = choice, m2 = -INFINITY;
        for (int off = 16; off > 0; off >>= 1) {
            const float o1 = __shfl_xor_sync(0xffffffffu, m1, off), o2 = __shfl_xor_sync(0xffffffffu, m2, off);
            m2 = fmaxf(fminf(m1, o1), fmaxf(m2, o2));
            m1 = fmaxf(m1, o1);
        }
        if (lane == 0)
            group_score[w] = p.correction_bias ? m1 + m2 : m1;
    }
    __syncthreads();
    if (p.num_expert_group > 0) {
        const float mine = group_score[w];
        int rank = 0;
        for (int h = 0; h < W; ++h)
            rank += route_better(group_score[h], h, mine, w);
        if (rank >= p.topk_group)
            choice = -INFINITY;
    }
    for (int j = 0; j < k; ++j) { /* the warp's top k */
        if (warp_argmax(choice, isnan(choice) ? E : e) == e) {
            cand_value[w * k + j] = choice;
            choice = NAN;
            cand_weight[w * k + j] = score;
            cand_id[w * k + j] = e;
        }
    }
    __syncthreads();
    if (w != 0)
        return;
    uint32_t key[kSplitMergePerLane]; /* route_key of the candidates' values; taken or none: 0 */
    int id[kSplitMergePerLane];
    float weight[kSplitMergePerLane];
#pragma unroll
    for (int i = 0; i < kSplitMergePerLane; ++i) {
        const int n = lane + 32 * i;
        key[i] = n < W * k ? route_key(cand_value[n]) : 0u;
        id[i] = n < W * k ? cand_id[n] : E;
        weight[i] = n < W * k ? cand_weight[n] : 0.0f;
    }
    float wsum = 0.0f;
    /* route_token_regs' rounds; the ids are not in lane order, so the lowest is reduced */
    for (int j = 0; j < k; ++j) {
        uint32_t mine = key[0];
#pragma unroll
        for (int i = 1; i < kSplitMergePerLane; ++i)
            mine = max(mine, key[i]);
        const uint32_t best = __reduce_max_sync(0xffffffffu, mine);
        uint32_t at = 0xffffffffu;
#pragma unroll
        for (int i = 0; i < kSplitMergePerLane; ++i)
            if (key[i] == best)
                at = min(at, static_cast<uint32_t>(id[i]));
        const int bi = static_cast<int>(__reduce_min_sync(0xffffffffu, at));
        float w = 0.0f;
        bool mine_taken = false;
#pragma unroll
        for (int i = 0; i < kSplitMergePerLane; ++i)
            if (id[i] == bi && key[i] != 0u) {
                key[i] = 0u;
                w = weight[i];
                mine_taken = true;
            }
        w = __shfl_sync(0xffffffffu, w, __ffs(__ballot_sync(0xffffffffu, mine_taken)) - 1);
        wsum += w;
        if (lane == 0) {
            r.group[j] = w;
            r.aux[j] = bi;
        }
    }
    __syncwarp();
    route_write(p, t, r, lane, ids_copy, wsum);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_ROUTE_TOKEN_SPLIT_CUH */
