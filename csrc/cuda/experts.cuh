/* Internal interface between the stages of the CUDA expert pipeline
 * (experts.cu drives them; each stage lives in its own .cu file).
 *
 * Pipeline, all on one stream, no host synchronization, scratch only from
 * the caller's workspace:
 *   moe_align.cu        topk_ids -> per-local-expert segments of pair indices
 *                        (pair = t * top_k + j), each padded to block_m rows
 *                        with -1, plus a tile table (tile -> expert)
 *   moe_scale_input.cu  apply_router_weight_on_input: x * w before GEMM1
 *   grouped_gemm_*.cu   GEMM1 (gather + gate/up + activation) and GEMM2
 *                        (down projection, routing weight; optionally split
 *                        over K into separate float32 slices) over the tiles
 *   moe_sum.cu          out[t] = sum over slots of the per-pair rows
 * Names in this header are C symbols starting with mx_; nothing here is part
 * of the public ABI (moe_ext/abi.h). */
#ifndef MOE_EXT_CUDA_EXPERTS_CUH
#define MOE_EXT_CUDA_EXPERTS_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "moe_ext/abi.h"

/* What one grouped-GEMM launch computes per (tile row s, output column n). */
typedef enum mx_gemm_kind {
    MX_GEMM_GATE_UP = 0,             /* GEMM1, w13 rows [gate 0..I) [up I..2I); act(gate) * up */
    MX_GEMM_GATE_UP_INTERLEAVED = 1, /* GEMM1, w13 rows 2i = gate i, 2i+1 = up i (swigluoai) */
    MX_GEMM_UP = 2,                  /* GEMM1, non-gated: w13 has I rows; act(h) */
    MX_GEMM_DOWN = 3,                /* GEMM2: act @ w2.T (+ bias), times the routing weight */
    MX_GEMM_LINEAR = 4,              /* dense FP8 layer (fp8_linear.cu): identity rows, one "expert",
                                        out = a @ w.T (+ bias) in the act dtype; FP8 kernels only */
} mx_gemm_kind;

/* The kind's name for kernel names in error messages. */
static inline const char *mx_gemm_kind_name(int kind)
{
    static const char *const names[] = {"gate_up", "gate_up_interleaved", "up", "down", "linear"};
    return kind >= 0 && kind <= MX_GEMM_LINEAR ? names[kind] : "unknown";
}

/* Arguments of a grouped GEMM launch. Rows of the problem are positions s in
 * the sorted (expert-grouped, block_m-padded) order; tile mt covers rows
 * [mt * block_m, (mt + 1) * block_m) and belongs to expert tile_expert[mt]. */
typedef struct mx_gemm_args {
    const void *a;                /* GEMM1: x [M, lda] gathered by token; GEMM2: act [rows, lda] by s */
    int64_t lda;                  /* row stride of a, elements */
    const void *w;                /* [E_local, n_rows, k] row-major (k contiguous), or packed */
    int w_packed;                 /* w in the packed layout (abi.h weights_packed): Hopper kernels only */
    const void *bias;             /* [E_local, n_rows] or NULL */
    int64_t n_rows;               /* weight rows per expert: 2I, I or H */
    int64_t k;                    /* reduction length: H (GEMM1) or I (GEMM2) */
    int64_t out_cols;             /* output columns: I (GEMM1) or H (GEMM2) */
    const int32_t *sorted_ids;    /* [rows] pair index or -1 (padding) */
    const int32_t *tile_expert;   /* [tiles] local expert of each tile */
    const int32_t *num_tiles;     /* [1] tiles in use (device memory; units_taken may point at the int
                                     after it, moe_align.cuh) */
    const float *topk_weights;    /* [M, top_k]; GEMM2 epilogue */
    int top_k;
    int activation;               /* mx_activation */
    float swiglu_alpha;
    float swiglu_limit;
    int scale_by_weight;          /* GEMM2: multiply by topk_weights[pair] */
    void *out;                    /* GEMM1: act [rows, ldo] in act dtype; GEMM2: y [M*top_k, ldo] float32
                                     (by sorted row: [rows, ldo]) */
    int64_t ldo;
    int m_tile_base;              /* first m tile of this launch (grids of more than 65535 rows);
                                     set by the launchers */
    int k_splits;                 /* GEMM2 split-K: grid z; split z covers k [z * k_split_len, ...) */
    int64_t k_split_len;          /* multiple of 64 (the k tile), >= k when k_splits == 1 */
    int64_t out_split_stride;     /* elements between the y slices of consecutive splits */
    int64_t rows;                 /* dense (LINEAR, sorted_ids NULL) launches of the Hopper decode kernel:
                                     rows of a and out; 0 otherwise */
    int64_t pairs;                /* GEMM kinds: the (token, slot) pairs of the tile table, 0 if unknown
                                     (a launch-shape hint of the Hopper decode kernel) */
    int y_by_sorted_row;          /* GEMM2 of the persistent Hopper kernel with block scales: out is y
                                     [rows, ldo] by sorted row (gemm_configs_fp8.cuh
                                     mx_fp8_sm90_down_by_sorted_row), else by pair */
    int32_t *split_count;         /* GEMM2 of the persistent Hopper kernel with k_splits > 1: k_splits is
                                     the most slices, the kernel picks the count on the device
                                     (gemm_configs.cuh mx_sm90_down_split; exactly k_splits with
                                     split_exact) and writes it here for moe_sum; k_split_len unused */
    int split_exact;
    int32_t *units_taken;         /* the persistent Hopper kernel on single CTAs: a counter its CTAs take
                                     their work units from, zero at launch and left zero
                                     (sm90_units.cuh; gemm_configs.cuh mx_sm90_deals_units); NULL:
                                     round robin */
} mx_gemm_args;

#ifdef __cplusplus
extern "C" {
#endif

/* moe_align's num_tiles: [0] tiles in use, [1] the persistent Hopper GEMMs'
 * unit counter, zeroed with it (moe_align.cuh). */
#define MX_MOE_ALIGN_NUM_TILES_BYTES (2 * sizeof(int32_t))

/* moe_align.cu. align_ws: mx_moe_align_workspace_bytes(pairs,
 * local_experts) of int32 scratch; sorted_ids: [rows_max]; tile_expert:
 * [tiles_max]; num_tiles: MX_MOE_ALIGN_NUM_TILES_BYTES; pair_rows: [pairs]
 * or NULL (moe_align.cuh). */
size_t mx_moe_align_workspace_bytes(int64_t pairs, int64_t local_experts);
mx_status mx_cuda_moe_align(const int32_t *topk_ids, const int32_t *expert_map, int64_t pairs,
                            int64_t global_experts, int64_t local_experts, int block_m, int32_t *align_ws,
                            int32_t *sorted_ids, int32_t *tile_expert, int32_t *num_tiles, int32_t *pair_rows,
                            cudaStream_t stream);

/* route_align.cu: routing when p->routing is set (fused with the sort into
 * one launch when M is small), then the sort of mx_cuda_moe_align with
 * p's ids, experts and pairs. */
mx_status mx_cuda_route_and_align(const mx_experts_problem *p, int block_m, int32_t *align_ws,
                                  int32_t *sorted_ids, int32_t *tile_expert, int32_t *num_tiles,
                                  int32_t *pair_rows, cudaStream_t stream);

/* moe_scale_input.cu: x_scaled[t] = x[t] * topk_weights[t, 0], both rounded to dtype. */
mx_status mx_cuda_moe_scale_input(const void *x, const float *topk_weights, int64_t tokens, int64_t hidden,
                                  int top_k, mx_dtype dtype, void *x_scaled, cudaStream_t stream);

/* grouped_gemm_bf16.cu / grouped_gemm_fp16.cu (tensor cores) and
 * grouped_gemm_f32.cu (SIMT). tile_config is an mx_tile_config
 * (gemm_configs.cuh); m_tiles is the grid's worst-case tile count. aligned: a,
 * w and their row strides allow 16-byte loads. */
mx_status mx_cuda_grouped_gemm_bf16(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config, int aligned,
                                    int64_t m_tiles, cudaStream_t stream);
mx_status mx_cuda_grouped_gemm_fp16(const mx_gemm_args *g, mx_gemm_kind kind, int tile_config, int aligned,
                                    int64_t m_tiles, cudaStream_t stream);
mx_status mx_cuda_grouped_gemm_f32(const mx_gemm_args *g, mx_gemm_kind kind, int64_t m_tiles,
                                   cudaStream_t stream);

/* experts.cu: the plans' slice count for a persistent Hopper GEMM2 that
 * takes k slices (mx_tile_sm90_takes_slices, mx_fp8_sm90_takes_slices)
 * under the test setting of mx_cuda_set_sm90_down_splits (abi.h):
 * unchanged when unset (the kernel picks up to *splits); else exactly that
 * many where K allows (*splits, *exact = 1 when > 1). k_blocks: GEMM2's
 * 128-byte k blocks as the kernel counts them; align: slice lengths'
 * multiple (2: per-tensor FP8). */
void mx_sm90_down_splits_setting(int *splits, int *exact, int64_t k_blocks, int align);

/* moe_sum.cu: out[t] = sum_j sum_s y[s][row(t * top_k + j)] over the slots
 * with a local expert and the k_splits split-K slices s (split_stride
 * elements apart; *split_count of them where split_count is not NULL: the
 * persistent GEMM2's pick, read on the device), float32 in (slot, split)
 * order, rounded once to dtype; zero rows for tokens without a local slot.
 * row(pair) = pair_rows[pair] (y by sorted row), or pair where pair_rows is
 * NULL (y by pair). */
mx_status mx_cuda_moe_sum(const float *y, const int32_t *pair_rows, int k_splits, const int32_t *split_count,
                          int64_t split_stride, const int32_t *topk_ids, const int32_t *expert_map, int64_t tokens, int top_k,
                          int64_t hidden, int64_t global_experts, int64_t local_experts, mx_dtype dtype, void *out,
                          cudaStream_t stream);

/* decode_fused.cu: the whole forward in one cooperative launch at one or
 * two tokens (FP8: one). mx_cuda_decode_fused returns 0 when p does not fit
 * it (quant, M, shape, alignment, device: the pipeline runs), else 1 with
 * the launch's status in *st; workspace_bytes() is what it needs of the
 * workspace. */
size_t mx_cuda_decode_fused_workspace_bytes(const mx_experts_problem *p);
int mx_cuda_decode_fused(const mx_experts_problem *p, void *workspace, cudaStream_t stream, mx_status *st);

/* experts_fp8.cu: the FP8 w8a8 pipeline, taken by mx_cuda_experts when
 * p->quant != MX_QUANT_NONE (after the common checks of experts.cu). Same
 * align / scale-input / sum stages; quantizers in fp8_quant.cu, GEMMs in
 * grouped_gemm_fp8.cu. */
size_t mx_cuda_experts_fp8_workspace_bytes(const mx_experts_problem *p);
mx_status mx_cuda_experts_fp8(const mx_experts_problem *p, void *workspace, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXT_CUDA_EXPERTS_CUH */
