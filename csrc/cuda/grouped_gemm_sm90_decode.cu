/* Instantiations of the Hopper decode kernels: bfloat16 and float16
 * operands, and float8_e4m3 operands with per-tensor or 128x128 block
 * scales and a bfloat16 / float16 act dtype; 16-, 32-, 48- and 64-token
 * tiles (GEMM1 kinds, and GEMM2 over short K, with fewer stages:
 * gemm_configs.cuh mx_sm90_decode_gemm1_shape; 16-token tiles also with
 * paired weight loads, mx_sm90_decode_paired). The four expert kinds and LINEAR run
 * grouped_gemm_sm90_decode.cuh;
 * FP8 GEMM2 runs the persistent grouped_gemm_sm90_decode_down.cuh where its
 * rule (sm90_decode_down_grid) says that pays. */
#include <math.h>

#include "grouped_gemm_sm90_decode_down.cuh"

namespace {

/* CTAs of a 16-token grid of n_tiles per m tile likely in use: with
 * g.pairs pairs routed uniformly, E (1 - (1 - 1/E)^pairs) experts hold one
 * tile, plus a tile per kBlockT pairs (at most m_tiles; the grid itself
 * covers the worst case, m_tiles). */
inline int64_t decode_likely_ctas(const mx_gemm_args &g, int64_t local_experts, int64_t m_tiles, int block_t,
                                  int64_t n_tiles)
{
    const double e = static_cast<double>(local_experts > 0 ? local_experts : 1);
    const double likely = g.pairs > 0 ? e * (1.0 - pow(1.0 - 1.0 / e, static_cast<double>(g.pairs))) +
                                            static_cast<double>(g.pairs / block_t)
                                      : static_cast<double>(m_tiles);
    const double tiles = likely < static_cast<double>(m_tiles) ? likely : static_cast<double>(m_tiles);
    return static_cast<int64_t>(tiles * static_cast<double>(n_tiles) + 0.5);
}

constexpr const char *kDecodeKernelName = "grouped_gemm_sm90_decode_kernel";

/* Ring on 16-token tiles, with paired weight loads (gemm_configs.cuh
 * mx_sm90_decode_paired) where its grid likely fills every CTA slot of it at
 * least once (`ctas` from decode_likely_ctas, `slots` the ring's CTAs that
 * fit the GPU at once, from sm90_decode_opt_in); a grid of fewer CTAs keeps
 * one-slot refills and the 256B promotion's read-ahead. */
template <typename TA, typename T, typename Ring, int KIND, int QUANT>
mx_status launch_sm90_decode_by_fill(const mx_gemm_args &g, const mx_sm90_scales &sc, int64_t local_experts,
                                     int64_t m_tiles, int64_t ctas, int slots, cudaStream_t stream)
{
    if (ctas >= slots)
        return launch_sm90_decode<TA, T, mx_sm90_decode_paired<Ring>, KIND, QUANT>(g, sc, local_experts, m_tiles,
                                                                                   stream);
    return launch_sm90_decode<TA, T, Ring, KIND, QUANT>(g, sc, local_experts, m_tiles, stream);
}

/* GEMM1 on the shallow ring (mx_sm90_decode_gemm1_shape: 3 CTAs per SM),
 * except 16-token tiles whose grid is more than one wave of it with the last
 * wave under a third full: those keep the deep ring (2 per SM). Mixtral at
 * M = 1 (448 CTAs: 1.13 waves of 396, against 1.7 of 264) lost 3-6% per
 * forward on the shallow ring; qwen3moe at M = 8 (~684 CTAs in use, 1.73
 * waves) gained 3-6% (H200, 5c39a5a against 0d4cd5f). The grid counts the
 * tiles likely in use (decode_likely_ctas), not the worst case (qwen3moe
 * M = 8: 68 m tiles, 816 CTAs, read as a sparse last wave at 108e79a). */
template <typename TA, typename T, typename Shape, int KIND, int QUANT>
mx_status launch_sm90_decode_gemm1(const mx_gemm_args &g, const mx_sm90_scales &sc, int64_t local_experts,
                                   int64_t m_tiles, cudaStream_t stream)
{
    typedef mx_sm90_decode_gemm1_shape<Shape> Shallow;
    if constexpr (Shape::kBlockT == 16) {
        int slots = 0;
        mx_status st = sm90_decode_opt_in<TA, T, Shallow, KIND, QUANT>(kDecodeKernelName, &slots);
        if (st.code != MX_OK)
            return st;
        const int64_t n_tiles = KIND == MX_GEMM_UP ? mx_ceil_div(g.n_rows, 128) : mx_ceil_div(g.out_cols, 64);
        const int64_t ctas = decode_likely_ctas(g, local_experts, m_tiles, Shape::kBlockT, n_tiles);
        if (ctas > slots && 3 * (ctas % slots) < slots) {
            st = sm90_decode_opt_in<TA, T, Shape, KIND, QUANT>(kDecodeKernelName, &slots);
            if (st.code != MX_OK)
                return st;
            return launch_sm90_decode_by_fill<TA, T, Shape, KIND, QUANT>(g, sc, local_experts, m_tiles, ctas, slots,
                                                                         stream);
        }
        return launch_sm90_decode_by_fill<TA, T, Shallow, KIND, QUANT>(g, sc, local_experts, m_tiles, ctas, slots,
                                                                       stream);
    }
    return launch_sm90_decode<TA, T, Shallow, KIND, QUANT>(g, sc, local_experts, m_tiles, stream);
}

template <typename TA, typename T, typename Shape, int QUANT>
mx_status grouped_gemm_sm90_decode(const mx_gemm_args *g, const mx_sm90_scales &sc, mx_gemm_kind kind,
                                   int64_t local_experts, int64_t m_tiles, cudaStream_t stream)
{
    if (m_tiles <= 0)
        return mx_status_ok();
    switch (kind) {
    case MX_GEMM_GATE_UP:
        return launch_sm90_decode_gemm1<TA, T, Shape, MX_GEMM_GATE_UP, QUANT>(*g, sc, local_experts, m_tiles, stream);
    case MX_GEMM_GATE_UP_INTERLEAVED:
        return launch_sm90_decode_gemm1<TA, T, Shape, MX_GEMM_GATE_UP_INTERLEAVED, QUANT>(*g, sc, local_experts,
                                                                                          m_tiles, stream);
    case MX_GEMM_UP:
        return launch_sm90_decode_gemm1<TA, T, Shape, MX_GEMM_UP, QUANT>(*g, sc, local_experts, m_tiles, stream);
    case MX_GEMM_DOWN:
        if constexpr (QUANT != MX_QUANT_NONE) {
            int64_t grid = 0;
            const mx_status st = sm90_decode_down_grid<T, Shape, QUANT>(*g, sc, m_tiles, &grid);
            if (st.code != MX_OK)
                return st;
            if (grid > 0)
                return launch_sm90_decode_down<T, Shape, QUANT>(*g, sc, local_experts, m_tiles, grid, stream);
        }
        {
            /* on Ring: 16-token tiles paired where the grid fills it */
            auto launch_on = [&](auto ring) -> mx_status {
                typedef decltype(ring) Ring;
                if constexpr (Shape::kBlockT == 16) {
                    int slots = 0;
                    const mx_status st = sm90_decode_opt_in<TA, T, Ring, MX_GEMM_DOWN, QUANT>(kDecodeKernelName, &slots);
                    if (st.code != MX_OK)
                        return st;
                    const int64_t ctas =
                        decode_likely_ctas(*g, local_experts, m_tiles, Shape::kBlockT, mx_ceil_div(g->n_rows, 128)) *
                        g->k_splits;
                    return launch_sm90_decode_by_fill<TA, T, Ring, MX_GEMM_DOWN, QUANT>(*g, sc, local_experts, m_tiles,
                                                                                        ctas, slots, stream);
                }
                return launch_sm90_decode<TA, T, Ring, MX_GEMM_DOWN, QUANT>(*g, sc, local_experts, m_tiles, stream);
            };
            /* short K on GEMM1's shallow ring (gemm_configs.cuh kSm90DecodeDownShallowKBlocks) */
            const bool shallow = g->k_splits == 1 && mx_ceil_div(g->k * static_cast<int64_t>(sizeof(TA)), 128) <=
                                                         kSm90DecodeDownShallowKBlocks;
            return shallow ? launch_on(mx_sm90_decode_gemm1_shape<Shape>()) : launch_on(Shape());
        }
    case MX_GEMM_LINEAR:
        if constexpr (QUANT != MX_QUANT_NONE) /* dense FP8 layers only */
            return launch_sm90_decode<TA, T, Shape, MX_GEMM_LINEAR, QUANT>(*g, sc, local_experts, m_tiles, stream);
        break;
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90_decode: unknown kind %d", (int)kind);
}

template <typename TA, typename T, int QUANT>
mx_status decode_for_types(const mx_gemm_args *g, const mx_sm90_scales &sc, mx_gemm_kind kind, int tile_config,
                           int64_t local_experts, int64_t m_tiles, cudaStream_t stream)
{
    if (tile_config == MX_TILE_SM90_MID)
        return grouped_gemm_sm90_decode<TA, T, mx_tile_sm90_mid, QUANT>(g, sc, kind, local_experts, m_tiles, stream);
    if (tile_config == MX_TILE_SM90_DECODE48)
        return grouped_gemm_sm90_decode<TA, T, mx_tile_sm90_decode48, QUANT>(g, sc, kind, local_experts, m_tiles,
                                                                              stream);
    if (tile_config == MX_TILE_SM90_DECODE32)
        return grouped_gemm_sm90_decode<TA, T, mx_tile_sm90_decode32, QUANT>(g, sc, kind, local_experts, m_tiles,
                                                                              stream);
    return grouped_gemm_sm90_decode<TA, T, mx_tile_sm90_decode, QUANT>(g, sc, kind, local_experts, m_tiles, stream);
}

template <typename T>
mx_status decode_for_act(const mx_gemm_args *g, const mx_sm90_scales &sc, mx_gemm_kind kind, mx_quant quant,
                         int tile_config, int64_t local_experts, int64_t m_tiles,
                         cudaStream_t stream)
{
    typedef __nv_fp8_e4m3 E4M3;
    switch (quant) {
    case MX_QUANT_NONE:
        return decode_for_types<T, T, MX_QUANT_NONE>(g, sc, kind, tile_config, local_experts, m_tiles,
                                                     stream);
    case MX_QUANT_FP8_TENSOR:
        return decode_for_types<E4M3, T, MX_QUANT_FP8_TENSOR>(g, sc, kind, tile_config, local_experts,
                                                              m_tiles, stream);
    case MX_QUANT_FP8_BLOCK:
        return decode_for_types<E4M3, T, MX_QUANT_FP8_BLOCK>(g, sc, kind, tile_config, local_experts,
                                                             m_tiles, stream);
    default: break;
    }
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90_decode: quant %d not compiled", (int)quant);
}

} /* namespace */

extern "C" mx_status mx_cuda_grouped_gemm_sm90_decode(const mx_gemm_args *g, const mx_sm90_scales *sc,
                                                      mx_gemm_kind kind, mx_dtype act_dtype, mx_quant quant,
                                                      int tile_config, int64_t local_experts, int64_t m_tiles, cudaStream_t stream)
{
    if (!mx_tile_is_sm90_decode(tile_config))
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90_decode: tile config %d is not a decode config",
                              tile_config);
    mx_sm90_scales none;
    memset(&none, 0, sizeof none);
    const mx_sm90_scales &scales = sc ? *sc : none;
    if (quant != MX_QUANT_NONE && (!scales.a_scale || !scales.w_scale))
        return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90_decode: FP8 operands need their scales");
    if (act_dtype == MX_BF16)
        return decode_for_act<__nv_bfloat16>(g, scales, kind, quant, tile_config, local_experts, m_tiles,
                                             stream);
    if (act_dtype == MX_F16)
        return decode_for_act<__half>(g, scales, kind, quant, tile_config, local_experts, m_tiles,
                                      stream);
    return mx_status_fail(MX_ERR_VALUE, "grouped_gemm_sm90_decode: act dtype %s not compiled",
                          mx_dtype_name(act_dtype));
}
