/* CPU top-k routing (abi.h mx_cpu_route, numerics.md "Routing").
 *
 * router_logits [M, E] (F32 | F16 | BF16, row-major) -> topk_weights float32
 * [M, k] and topk_ids int32 [M, k]. Per token, all in float32:
 *   s = softmax(logits) or sigmoid(logits); c = s (+ correction_bias);
 *   grouped: rank groups by max(c) (by the sum of the two largest c with a
 *   bias), keep topk_group of them, set c = -inf elsewhere;
 *   pick the k largest c (ties -> lower index), weights = s at those ids,
 *   optionally divided by their sum, then times routed_scaling_factor.
 * Tokens run in parallel; each thread keeps its per-token scratch on its own
 * stack, sized for MX_ROUTE_MAX_EXPERTS (about 52 KiB), so routing allocates
 * nothing; more experts are not implemented. */
#include <math.h>

#include "cpu_common.h"

enum { MX_ROUTE_MAX_EXPERTS = 4096 };

/* Per-thread scratch for one token. */
typedef struct mx_route_scratch {
    float *scores;         /* [E] s */
    float *choice;         /* [E] c */
    float *group_score;    /* [G] */
    unsigned char *taken;  /* [E] (G <= E) */
} mx_route_scratch;

/* Index of the largest v[i] not yet taken (ties -> lower index); marks it taken. */
static int64_t mx_take_max(const float *v, unsigned char *taken, int64_t n)
{
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++) {
        if (taken[i])
            continue;
        if (best < 0 || v[i] > v[best])
            best = i;
    }
    taken[best] = 1;
    return best;
}

static void mx_route_token(const mx_routing_problem *p, int64_t t, const mx_route_scratch *s)
{
    const int64_t E = p->num_experts;
    const int k = p->top_k;
    const size_t esize = mx_dtype_size(p->logits_dtype);
    const void *logits = (const char *)p->router_logits + (size_t)(t * E) * esize;
    float *sc = s->scores, *c = s->choice;

    if (p->scoring == MX_SCORING_SOFTMAX) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            sc[e] = mx_load_f32(p->logits_dtype, logits, e);
            mx = sc[e] > mx ? sc[e] : mx;
        }
        for (int64_t e = 0; e < E; e++) {
            sc[e] = expf(sc[e] - mx);
            sum += sc[e];
        }
        for (int64_t e = 0; e < E; e++)
            sc[e] /= sum;
    } else {
        for (int64_t e = 0; e < E; e++)
            sc[e] = 1.0f / (1.0f + expf(-mx_load_f32(p->logits_dtype, logits, e)));
    }
    for (int64_t e = 0; e < E; e++)
        c[e] = p->correction_bias ? sc[e] + mx_load_f32(p->bias_dtype, p->correction_bias, e) : sc[e];

    if (p->num_expert_group > 0) {
        const int64_t G = p->num_expert_group, gsize = E / G;
        for (int64_t g = 0; g < G; g++) {
            const float *cg = c + g * gsize;
            float first = cg[0], second = -INFINITY;
            for (int64_t i = 1; i < gsize; i++) {
                if (cg[i] > first) {
                    second = first;
                    first = cg[i];
                } else if (cg[i] > second) {
                    second = cg[i];
                }
            }
            s->group_score[g] = (p->correction_bias && gsize > 1) ? first + second : first;
        }
        memset(s->taken, 0, (size_t)G);
        for (int i = 0; i < p->topk_group; i++)
            mx_take_max(s->group_score, s->taken, G);
        for (int64_t g = 0; g < G; g++)
            if (!s->taken[g])
                for (int64_t i = 0; i < gsize; i++)
                    c[g * gsize + i] = -INFINITY;
    }

    float *w = p->topk_weights + t * k;
    int32_t *ids = p->topk_ids + t * k;
    float sum = 0.0f;
    memset(s->taken, 0, (size_t)E);
    for (int j = 0; j < k; j++) {
        int64_t e = mx_take_max(c, s->taken, E);
        ids[j] = (int32_t)e;
        w[j] = sc[e];
        sum += w[j];
    }
    for (int j = 0; j < k; j++) {
        if (p->renormalize)
            w[j] /= sum;
        w[j] *= p->routed_scaling_factor;
    }
}

static int mx_float_dtype(mx_dtype dt)
{
    return dt == MX_F32 || dt == MX_F16 || dt == MX_BF16;
}

mx_status mx_cpu_route(const mx_routing_problem *p)
{
    const int64_t M = p->num_tokens, E = p->num_experts;
    const int64_t G = p->num_expert_group > 0 ? p->num_expert_group : 0;

    if (M < 0 || E < 1)
        return mx_error(MX_ERR_VALUE, "routing: num_tokens = %lld and num_experts = %lld are out of range",
                        (long long)M, (long long)E);
    if (E > MX_ROUTE_MAX_EXPERTS)
        return mx_error(MX_ERR_NOT_IMPLEMENTED, "routing: num_experts = %lld is above the CPU engine's limit of %d",
                        (long long)E, MX_ROUTE_MAX_EXPERTS);
    if (p->top_k < 1 || p->top_k > E)
        return mx_error(MX_ERR_VALUE, "routing: top_k = %d is outside [1, %lld]", p->top_k, (long long)E);
    if (p->scoring != MX_SCORING_SOFTMAX && p->scoring != MX_SCORING_SIGMOID)
        return mx_error(MX_ERR_VALUE, "routing: unknown scoring function %d", (int)p->scoring);
    if (!mx_float_dtype(p->logits_dtype))
        return mx_error(MX_ERR_TYPE, "routing: router_logits must be float32, float16 or bfloat16, got %s",
                        mx_dtype_name(p->logits_dtype));
    if (p->correction_bias && !mx_float_dtype(p->bias_dtype))
        return mx_error(MX_ERR_TYPE, "routing: e_score_correction_bias must be float32, float16 or bfloat16, got %s",
                        mx_dtype_name(p->bias_dtype));
    if (p->num_expert_group < 0 || (G > 0 && E % G != 0))
        return mx_error(MX_ERR_VALUE, "routing: num_expert_group = %d must be 0 or divide num_experts = %lld",
                        p->num_expert_group, (long long)E);
    if (G > 0 && (p->topk_group < 1 || p->topk_group > G))
        return mx_error(MX_ERR_VALUE, "routing: topk_group = %d is outside [1, num_expert_group = %lld]",
                        p->topk_group, (long long)G);
    if (M == 0)
        return mx_ok();

    MX_OMP(parallel if (M * E >= MX_PARALLEL_MIN_WORK / 64))
    {
        /* G <= E, so group scores fit the same bound */
        float scores[MX_ROUTE_MAX_EXPERTS], choice[MX_ROUTE_MAX_EXPERTS], group_score[MX_ROUTE_MAX_EXPERTS];
        unsigned char taken[MX_ROUTE_MAX_EXPERTS];
        const mx_route_scratch s = {
            .scores = scores,
            .choice = choice,
            .group_score = group_score,
            .taken = taken,
        };
        MX_OMP(for schedule(static))
        for (int64_t t = 0; t < M; t++)
            mx_route_token(p, t, &s);
    }
    return mx_ok();
}
