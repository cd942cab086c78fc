/* FP8 (float8_e4m3) instantiations of the Hopper grouped GEMM
 * (grouped_gemm_sm90_impl.cuh describes operands, tiling and pipeline) for
 * the expert pipeline of experts_fp8.cu: per-tensor scales on the 128x256
 * tiles (single CTAs: gemm_configs_fp8.cuh says why no pairs), 128x128
 * block scales on 128x256 or 128x128 tiles (mx_fp8_sm90_block_wide), and
 * either on ping-pong 64-row units (MX_FP8_TILE_SM90_PP); act
 * dtype bfloat16 or float16. The entry
 * also routes the decode configs to grouped_gemm_sm90_decode.cu, the only
 * ones that take the dense LINEAR kind (fp8_linear.cu). */
#include "gemm_configs_fp8.cuh"
#include "grouped_gemm_sm90_impl.cuh"

namespace {

template <typename T>
mx_status fp8_sm90_for_dtype(const mx_gemm_args *g, const mx_sm90_scales &sc, mx_gemm_kind kind, mx_quant quant,
                             int tile_config, bool a_by_token, int64_t local_experts, int64_t m_tiles,
                             cudaStream_t stream)
{
    typedef __nv_fp8_e4m3 E4M3;
    if (tile_config == MX_FP8_TILE_SM90_PP) {
        if (quant == MX_QUANT_FP8_BLOCK)
            return grouped_gemm_sm90_shape<E4M3, T, mx_tile_sm90_pp, MX_QUANT_FP8_BLOCK>(g, sc, kind, a_by_token,
                                                                                       local_experts, m_tiles, stream);
        return grouped_gemm_sm90_shape<E4M3, T, mx_tile_sm90_pp, MX_QUANT_FP8_TENSOR>(g, sc, kind, a_by_token,
                                                                                    local_experts, m_tiles, stream);
    }
    if (quant == MX_QUANT_FP8_BLOCK) {
        if (mx_fp8_sm90_block_wide(kind == MX_GEMM_GATE_UP, kind == MX_GEMM_DOWN, g->out_cols, g->pairs, local_experts))
            return grouped_gemm_sm90_shape<E4M3, T, mx_tile_sm90, MX_QUANT_FP8_BLOCK>(g, sc, kind, a_by_token,
                                                                                      local_experts, m_tiles, stream);
        return grouped_gemm_sm90_shape<E4M3, T, mx_tile_sm90_n128, MX_QUANT_FP8_BLOCK>(g, sc, kind, a_by_token,
                                                                                       local_experts, m_tiles, stream);
    }
    return grouped_gemm_sm90_shape<E4M3, T, mx_tile_sm90, MX_QUANT_FP8_TENSOR>(g, sc, kind, a_by_token,
                                                                               local_experts, m_tiles, stream);
}

} /* namespace */

extern "C" mx_status mx_cuda_grouped_gemm_fp8_sm90(const mx_fp8_gemm_args *f, mx_gemm_kind kind, mx_quant quant,
                                                   int tile_config, int64_t local_experts, int64_t m_tiles,
                                                   cudaStream_t stream)
{
    const bool decode = mx_tile_is_sm90_decode(tile_config);
    if ((kind == MX_GEMM_LINEAR && !decode) || (quant != MX_QUANT_FP8_TENSOR && quant != MX_QUANT_FP8_BLOCK) ||
        !mx_fp8_tile_is_sm90(tile_config))
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_fp8_sm90: kind %d, quant %d, tile config %d not compiled",
                              (int)kind, (int)quant, tile_config);
    if (f->out_dtype != MX_BF16 && f->out_dtype != MX_F16)
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_fp8_sm90: act dtype %s not compiled",
                              mx_dtype_name(f->out_dtype));
    if (f->a_sorted && (decode || kind == MX_GEMM_DOWN))
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_fp8_sm90: A by sorted row is a persistent GEMM1 form");
    /* TMA: 16-byte row strides and bases; one GEMM1 weight box (64 rows) per
     * 128-row scale block with block scales */
    if (f->k % 16 || f->lda % 16 || !mx_aligned16(f->a) || !mx_aligned16(f->w) ||
        (quant == MX_QUANT_FP8_BLOCK && kind == MX_GEMM_GATE_UP && f->out_cols % 64))
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_fp8_sm90: operands break the TMA preconditions");
    mx_gemm_args g;
    memset(&g, 0, sizeof g);
    g.a = f->a;
    g.lda = f->lda;
    g.w = f->w;
    g.w_packed = f->w_packed;
    g.bias = f->bias;
    g.n_rows = f->n_rows;
    g.k = f->k;
    g.out_cols = f->out_cols;
    g.sorted_ids = f->sorted_ids;
    g.tile_expert = f->tile_expert;
    g.num_tiles = f->num_tiles;
    g.topk_weights = f->topk_weights;
    g.top_k = f->top_k;
    g.activation = f->activation;
    g.swiglu_alpha = f->swiglu_alpha;
    g.swiglu_limit = f->swiglu_limit;
    g.scale_by_weight = f->scale_by_weight;
    g.out = f->out;
    g.ldo = f->ldo;
    g.k_splits = f->k_splits;
    g.k_split_len = f->k_split_len;
    g.out_split_stride = f->out_split_stride;
    g.split_count = f->split_count;
    g.split_exact = f->split_exact;
    g.units_taken = f->units_taken;
    g.rows = kind == MX_GEMM_LINEAR ? f->rows : 0;
    g.pairs = kind == MX_GEMM_LINEAR ? 0 : f->pairs;
    g.y_by_sorted_row = f->y_by_sorted_row;
    mx_sm90_scales sc;
    sc.a_scale = f->a_scale;
    sc.a_ld = f->a_scale_ld;
    sc.w_scale = f->w_scale;
    sc.w_rows = mx_ceil_div(f->n_rows, kFp8Block);
    sc.w_ld = mx_ceil_div(f->k, kFp8Block);
    sc.amax = f->amax;
    sc.act_q = f->act_q;
    sc.act_q_ld = f->act_q_ld;
    sc.act_q_scale = f->act_q_scale;
    sc.act_q_scale_ld = f->act_q_scale_ld;
    if (decode)
        return mx_cuda_grouped_gemm_sm90_decode(&g, &sc, kind, f->out_dtype, quant, tile_config, local_experts,
                                                m_tiles, stream);
    if (f->out_dtype == MX_BF16)
        return fp8_sm90_for_dtype<__nv_bfloat16>(&g, sc, kind, quant, tile_config, !f->a_sorted, local_experts,
                                                 m_tiles, stream);
    return fp8_sm90_for_dtype<__half>(&g, sc, kind, quant, tile_config, !f->a_sorted, local_experts, m_tiles,
                                      stream);
}
