/* mx_cuda_fp8_linear: a dense FP8 w8a8 layer, out = x @ W.T (+ bias)
 * (abi.h mx_fp8_linear_problem; numerics.md "FP8").
 *
 * Operands: x [rows, in] and bias [out] and out [rows, out] in the act dtype
 * (bfloat16 / float16 / float32); weight fp8 [out, in] row-major;
 * weight_scale f32 TENSOR [1], BLOCK [ceil(out/128), ceil(in/128)].
 * x is quantized dynamically as in the expert pipeline: TENSOR per tensor
 * (rows_amax_kernel + rows_quant_tensor_kernel), BLOCK per row and 128
 * columns (group_quant_kernel). The GEMM is of kind LINEAR: one "expert",
 * identity rows (no tile table), epilogue bias + rounding to the act dtype;
 * no split-K. On Hopper (sm_90a code, bfloat16 / float16 act dtype, in a
 * multiple of 16, 16-byte aligned weight) it runs on FP8 wgmma in the
 * decode kernel (grouped_gemm_sm90_decode.cuh; 16-row tiles under 32 rows,
 * else 64); elsewhere the mma.sync FP8 grouped GEMM (grouped_gemm_fp8.cuh),
 * tile config by the expert rule with E = 1.
 *
 * Workspace (256-byte aligned pieces): scalar x_scale f32 [1], partials f32
 * [mx_fp8_amax_parts(rows)] (TENSOR), x_q fp8 [rows, ld] (ld = in rounded up
 * to 16, zero-padded), x_scale f32 [rows, ceil(in/128)] (BLOCK). */
#include <string.h>

#include "grouped_gemm_fp8.cuh"
#include "grouped_gemm_sm90.cuh"

namespace {

typedef struct linear_plan {
    int64_t ld, blocks;
    size_t off_scalar, off_partials, off_x_q, off_x_scale, total_bytes;
} linear_plan;

void make_plan(const mx_fp8_linear_problem *p, linear_plan *plan)
{
    const bool block = p->quant == MX_QUANT_FP8_BLOCK;
    plan->ld = (p->in_features + 15) / 16 * 16;
    plan->blocks = mx_ceil_div(p->in_features, kFp8Block);
    size_t at = 0;
    plan->off_scalar = mx_ws_take(&at, sizeof(float));
    plan->off_partials = mx_ws_take(&at, block ? 0 : sizeof(float) * mx_fp8_amax_parts(p->rows));
    plan->off_x_q = mx_ws_take(&at, static_cast<size_t>(p->rows * plan->ld));
    plan->off_x_scale = mx_ws_take(&at, block ? sizeof(float) * p->rows * plan->blocks : 0);
    plan->total_bytes = at;
}

template <int QUANT>
mx_status launch_linear(const mx_fp8_gemm_args &g, int tile_config, int aligned_w, int64_t m_tiles,
                        cudaStream_t stream)
{
    return launch_fp8_config<MX_GEMM_LINEAR, QUANT>(g, tile_config, aligned_w, m_tiles, stream);
}

} /* namespace */

extern "C" size_t mx_cuda_fp8_linear_workspace_bytes(const mx_fp8_linear_problem *p)
{
    if (p->rows <= 0 || p->in_features < 1)
        return 0;
    linear_plan plan;
    make_plan(p, &plan);
    return plan.total_bytes;
}

extern "C" mx_status mx_cuda_fp8_linear(const mx_fp8_linear_problem *p, void *workspace, void *stream_ptr)
{
    if (p->quant != MX_QUANT_FP8_TENSOR && p->quant != MX_QUANT_FP8_BLOCK)
        return mx_status_fail(MX_ERR_VALUE, "fp8_linear (CUDA): quant %d is not FP8_TENSOR or FP8_BLOCK",
                              (int)p->quant);
    if (p->act_dtype != MX_BF16 && p->act_dtype != MX_F16 && p->act_dtype != MX_F32)
        return mx_status_fail(MX_ERR_NOT_IMPLEMENTED, "fp8_linear (CUDA): act_dtype %s; supported: bfloat16, "
                              "float16, float32", mx_dtype_name(p->act_dtype));
    if (p->rows < 0 || p->in_features < 1 || p->out_features < 1)
        return mx_status_fail(MX_ERR_VALUE, "fp8_linear (CUDA): need rows >= 0, in/out_features >= 1 (rows=%lld "
                              "in=%lld out=%lld)", (long long)p->rows, (long long)p->in_features,
                              (long long)p->out_features);
    if (p->rows == 0)
        return mx_status_ok();
    if (!p->x || !p->weight || !p->weight_scale || !p->output || !workspace)
        return mx_status_fail(MX_ERR_VALUE, "fp8_linear (CUDA): x, weight, weight_scale, output or workspace is "
                              "NULL");
    if (p->rows > 0x7fffffff)
        return mx_status_fail(MX_ERR_VALUE, "fp8_linear (CUDA): %lld rows exceed int32 indexing", (long long)p->rows);

    cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
    const bool block = p->quant == MX_QUANT_FP8_BLOCK;
    linear_plan plan;
    make_plan(p, &plan);
    unsigned char *ws = static_cast<unsigned char *>(workspace);
    float *x_tensor_scale = reinterpret_cast<float *>(ws + plan.off_scalar);
    float *partials = reinterpret_cast<float *>(ws + plan.off_partials);
    uint8_t *x_q = ws + plan.off_x_q;
    float *x_scale = reinterpret_cast<float *>(ws + plan.off_x_scale);

    mx_fp8_row_filter all;
    memset(&all, 0, sizeof all);
    all.mode = MX_FP8_ROWS_ALL;
    const int64_t K = p->in_features;
    mx_status st = mx_cuda_fp8_quant_a(p->x, p->act_dtype, p->rows, K, K, &all, p->quant, partials, nullptr, x_q,
                                       plan.ld, block ? x_scale : x_tensor_scale, plan.blocks, stream);
    if (st.code != MX_OK)
        return st;

    mx_fp8_gemm_args g;
    memset(&g, 0, sizeof g);
    g.a = x_q;
    g.lda = plan.ld;
    g.a_scale = block ? x_scale : x_tensor_scale;
    g.a_scale_ld = plan.blocks;
    g.w = p->weight;
    g.w_scale = p->weight_scale;
    g.bias = p->bias;
    g.n_rows = p->out_features;
    g.k = K;
    g.out_cols = p->out_features;
    g.rows = p->rows;
    g.out_dtype = p->act_dtype;
    g.out = p->output;
    g.ldo = p->out_features;
    const size_t es = p->act_dtype == MX_F32 ? 4 : 2;
    g.vec_out = p->out_features % 4 == 0 && reinterpret_cast<uintptr_t>(p->output) % (4 * es) == 0;
    g.k_splits = 1;
    g.k_split_len = K;
    const int aligned_w = K % 16 == 0 && reinterpret_cast<uintptr_t>(p->weight) % 16 == 0;
    if (aligned_w && p->act_dtype != MX_F32 && mx_cuda_sm90_gemm_available()) {
        const int sm90 = p->rows < 32 ? MX_FP8_TILE_SM90_DECODE : MX_FP8_TILE_SM90_MID;
        return mx_cuda_grouped_gemm_fp8_sm90(&g, MX_GEMM_LINEAR, p->quant, sm90, 1,
                                             mx_ceil_div(p->rows, mx_fp8_tile_block_m(sm90)), stream);
    }
    const int config = mx_fp8_select_tile_config(p->rows, 1, aligned_w);
    const int64_t m_tiles = mx_ceil_div(p->rows, mx_fp8_tile_block_m(config));
    return block ? launch_linear<MX_QUANT_FP8_BLOCK>(g, config, aligned_w, m_tiles, stream)
                 : launch_linear<MX_QUANT_FP8_TENSOR>(g, config, aligned_w, m_tiles, stream);
}
