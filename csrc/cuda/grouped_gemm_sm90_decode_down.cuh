/* GEMM2 (the down projection) of FP8 experts at few rows per expert on
 * Hopper (sm_90a): the decode kernel's operand swap and ring
 * (grouped_gemm_sm90_decode.cuh: weight rows are wgmma's m, the tile's
 * kBlockT sorted rows its n; A = act_q [rows, K] and W by TMA, 128 bytes
 * of K per stage), made persistent. Instantiated by
 * grouped_gemm_sm90_decode.cu for per-tensor and 128x128 block scales.
 *
 * Why a kernel of its own: FP8 GEMM2 units are short (qwen3moe's K = 768
 * is 6 k blocks), and one CTA per unit drained its ring at every unit: the
 * weight stream stalled at each CTA's start and epilogue (2.1 TB/s). Here
 * the grid is the CTAs that fit the GPU at once (2 per SM), CTA b takes
 * units b, b + grid, ..., and its ring of kStages k blocks runs on across
 * units, so the next unit's weights stream in during a unit's last k blocks
 * and its epilogue. H200, whole GEMM2: qwen3moe fp8_tensor M = 512 97 -> 83
 * us, fp8_block M = 256 84 -> 68 us, deepseekv3 fp8_block M = 1 32 -> 27 us.
 * The same scheme measured slower for the 16-bit GEMM2 at large M (gptoss
 * bf16 M = 1024 562 -> 615 us, qwen3moe bf16 M = 512 125 -> 130 us) and for
 * every GEMM1 (whose cp.async rows and activation epilogue made the kernel
 * twice the code): those stay in the decode kernel. 2026-11-22.
 *
 * Work unit = one (m tile, n tile of 128 output columns, k split), in the
 * decode kernel's grid order (chunks of kDecodeGroupN n tiles slowest, then
 * m tiles, then the chunk's n tiles and k splits), counting only the m
 * tiles in use and the n tiles that exist (a CTA whose units skipped the
 * missing n tiles of the last chunk would do less work than its
 * neighbours). Thread 0 is the producer: it walks the same units as the
 * consumers, kStages k blocks ahead, and refills a slot once every warp's
 * wgmmas on it have retired (wait_group 0, then a CTA barrier). Launched
 * dependent: its first kStages weight loads go out before it waits for the
 * kernel ahead (whose output is only A; the tile table is older).
 * Epilogue straight from the accumulators, with the unit's pairs, routing
 * weights and scale loaded one unit ahead (unit_rows): a thread holds
 * weight rows r, r + 8 (r = 16 warp + lane / 4) of both boxes for tokens
 * 8i + 2q + e (q = lane % 4, e = 0, 1) and stores float32 (acc * scale +
 * bias on split 0) * routing weight into its split-K slice of y.
 *
 * The launcher guarantees what the decode kernel's does (tile tables with
 * block_m = kBlockT, TMA preconditions, k splits of whole k blocks). */
#ifndef MOE_EXT_CUDA_GROUPED_GEMM_SM90_DECODE_DOWN_CUH
#define MOE_EXT_CUDA_GROUPED_GEMM_SM90_DECODE_DOWN_CUH

#include "grouped_gemm_sm90_decode.cuh"

namespace {

template <typename T, typename Shape, int QUANT>
__global__ void __launch_bounds__(Shape::kThreads)
    grouped_gemm_sm90_decode_down_kernel(const __grid_constant__ CUtensorMap tma_a, /* A [rows, K], box 128 B x kBlockT */
                                         const __grid_constant__ CUtensorMap tma_w, /* W [E, n_rows, K], box 128 B x 64 x 1 */
                                         const mx_gemm_args g, const mx_sm90_scales sc,
                                         int n_tiles,      /* n tiles per m tile */
                                         int kb_per_split) /* k blocks per split-K slice */
{
#if MX_SM90_DEVICE_PASS
    constexpr int BT = Shape::kBlockT, STAGES = Shape::kStages;
    constexpr int NACC = BT / 2, NTOK = BT / 4; /* accumulators of one m64nBT wgmma, tokens, per thread */
    constexpr uint32_t W_BYTES = Shape::kWBytes, BOX_BYTES = W_BYTES / 2, STAGE_BYTES = Shape::kStageBytes;
    constexpr bool kBlockScales = QUANT == MX_QUANT_FP8_BLOCK;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, q = lane % 4;
    /* units in order: the full chunks of kDecodeGroupN n tiles, each m tile
     * by m tile, then the last chunk's n_last n tiles the same way */
    const int splits = g.k_splits, per_mt = kDecodeGroupN * splits;
    const int tiles = *g.num_tiles;
    const int n_chunks = (n_tiles + kDecodeGroupN - 1) / kDecodeGroupN;
    const int n_last = n_tiles - (n_chunks - 1) * kDecodeGroupN;
    const int full_units = (n_chunks - 1) * tiles * per_mt;
    const int units = full_units + tiles * n_last * splits;
    const int k_blocks = static_cast<int>((g.k + 127) / 128);
    const int stride = static_cast<int>(gridDim.x);
    struct unit_place {
        int mt, split, kb0, kb1, expert;
        int row0; /* the first weight row (output column) of the unit's 128 */
    };
    auto unit_at = [&](int u) {
        unit_place d;
        int in_chunk, per, chunk;
        if (u < full_units) {
            chunk = u / (per_mt * tiles);
            in_chunk = u % (per_mt * tiles);
            per = per_mt;
        } else {
            chunk = n_chunks - 1;
            in_chunk = u - full_units;
            per = n_last * splits;
        }
        d.mt = in_chunk / per;
        d.row0 = (chunk * kDecodeGroupN + (in_chunk % per) / splits) * 128;
        d.split = in_chunk % splits;
        d.kb0 = d.split * kb_per_split;
        d.kb1 = d.kb0 + kb_per_split < k_blocks ? d.kb0 + kb_per_split : k_blocks;
        d.expert = g.tile_expert[d.mt];
        return d;
    };
    const int first = static_cast<int>(blockIdx.x);
    if (first >= units)
        return; /* more CTAs than units in use */

    extern __shared__ __align__(1024) unsigned char sm90_decode_down_smem[];
    const uint32_t base = (mx_smem_addr(sm90_decode_down_smem) + 1023u) & ~1023u;
    const uint32_t bars = base + STAGES * STAGE_BYTES;
    auto full_bar = [&](int s) { return bars + 8u * static_cast<uint32_t>(s); };
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s)
            mbar_init(full_bar(s), 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        fence_proxy_async_smem();
    }
    __syncthreads();

    /* The producer's place: unit p_unit (p), k block p_kb, ring step p_step.
     * issue_w loads a stage's two weight boxes and announces the whole
     * stage's bytes; issue_a its A rows. */
    int p_unit = first, p_step = 0;
    unit_place p = unit_at(first);
    int p_kb = p.kb0;
    auto p_advance = [&]() {
        ++p_step;
        if (++p_kb == p.kb1) {
            p_unit += stride;
            if (p_unit < units) {
                p = unit_at(p_unit);
                p_kb = p.kb0;
            }
        }
    };
    auto slot_at = [&](int s) { return base + static_cast<uint32_t>(s) * STAGE_BYTES; };
    auto issue_w = [&]() {
        const int s = p_step % STAGES;
        mbar_arrive_expect_tx(full_bar(s), STAGE_BYTES);
        tma_load_w(slot_at(s), &tma_w, full_bar(s), p_kb, 128, p.row0, p.expert, g.w_packed);
        tma_load_w(slot_at(s) + BOX_BYTES, &tma_w, full_bar(s), p_kb, 128, p.row0 + 64, p.expert, g.w_packed);
    };
    auto issue_a = [&](int s, int kb, int mt) {
        tma_load_2d(slot_at(s) + W_BYTES, &tma_a, full_bar(s), kb * 128, mt * BT);
    };
    if (tid == 0) {
        tma_prefetch_map(&tma_w);
        tma_prefetch_map(&tma_a);
        /* the first stages: weights now, A once the kernel ahead is done */
        int fill_kb[STAGES], fill_mt[STAGES], fill = 0;
#pragma unroll 1
        for (; fill < STAGES && p_unit < units; ++fill) {
            fill_kb[fill] = p_kb;
            fill_mt[fill] = p.mt;
            issue_w();
            p_advance();
        }
        mx_griddep_wait();
        mx_griddep_launch_dependents();
#pragma unroll 1
        for (int f = 0; f < fill; ++f)
            issue_a(f, fill_kb[f], fill_mt[f]);
    } else {
        mx_griddep_wait();
        mx_griddep_launch_dependents();
    }

    const int r = warp * 16 + lane / 4; /* the thread's first weight row of each box */
    /* the row of the thread's token slot j past its first, 2q */
    auto slot_row = [](int j) { return 8 * (j / 2) + j % 2; };
    /* the sorted row of the thread's token slot j in unit d's tile */
    auto token_row = [&](const unit_place &d, int j) { return static_cast<int64_t>(d.mt) * BT + 2 * q + slot_row(j); };
    /* The thread's tokens of a unit: slot j is row 8 (j / 2) + 2q + j % 2 of
     * the tile; its pair (-1 for padding), routing weight, and the unit's
     * per-tensor scale. Loaded one unit ahead, in two steps: the pairs when
     * the unit before starts, what depends on them once its k blocks are
     * issued (unit_rows_finish). Loaded where they were used (pairs at the
     * unit's start, weights and scale in the epilogue, each weight load
     * behind the stores before it), they held over half of the warp samples
     * (ncu source sampling, qwen3moe fp8_tensor M = 512). Ahead, with the
     * block scales one k block ahead too: this GEMM2 at qwen3moe M = 512
     * 105 -> 88 us (fp8_tensor), 111 -> 97 us (fp8_block), M = 128 72 -> 69
     * us; M = 1 unchanged (H100, 2026-11-25,
     * logs/2026-11-25-nvidia-h100-ab-decode-down-ahead.txt). */
    struct unit_rows {
        int32_t pair[NTOK];
        float weight[NTOK];
        float scale;
    };
    auto unit_rows_start = [&](const unit_place &d, unit_rows &u) {
#pragma unroll
        for (int j = 0; j < NTOK; ++j)
            u.pair[j] = g.sorted_ids[token_row(d, j)];
    };
    auto unit_rows_finish = [&](const unit_place &d, unit_rows &u) {
#pragma unroll
        for (int j = 0; j < NTOK; ++j)
            u.weight[j] = g.scale_by_weight && u.pair[j] >= 0 ? g.topk_weights[u.pair[j]] : 1.0f;
        u.scale = QUANT == MX_QUANT_FP8_TENSOR ? sc.a_scale[0] * sc.w_scale[d.expert] : 1.0f;
    };
    /* block scales of k block kb: the thread's tokens' (a_s) and the weight
     * boxes'. row_off: the int32 offset of the scales of the thread's token
     * slot 0 (sm90_decode_down_grid keeps every offset in range); slot j's
     * row is slot_row(j) rows further. Addressed so, not by 64-bit row
     * products per slot and k block, and loaded while the k block's wgmmas
     * run (decode_fp8_k_block's `during`), not before its slot wait: the
     * block-scale GEMM2 at Mixtral M = 128 and qwen3moe M = 512 issued
     * 1.8x the per-tensor one's instructions (ncu, H200) and forwards were
     * 4.5 / 3.8% slower than now (H200, 2026-11-27,
     * logs/2026-11-27-nvidia-h200-ab-decode-down-block-scales.txt). */
    typedef decode_k_scales<BT> k_scales;
    const int32_t a_ld = static_cast<int32_t>(sc.a_ld);
    auto k_scales_at = [&](const unit_rows &u, int32_t row_off, const float *sw0, const float *sw1, int kb) {
        k_scales ks;
#pragma unroll
        for (int j = 0; j < NTOK; ++j)
            ks.a_s[j] = !kBlockScales     ? 1.0f
                        : u.pair[j] < 0 ? 0.0f
                                        : sc.a_scale[row_off + kb + slot_row(j) * a_ld];
        ks.w0 = kBlockScales ? sw0[kb] : 1.0f;
        ks.w1 = kBlockScales ? sw1[kb] : 1.0f;
        return ks;
    };

    unit_place next = unit_at(first);
    unit_rows next_rows;
    unit_rows_start(next, next_rows);
    unit_rows_finish(next, next_rows);
    int step = 0;
    for (int unit = first; unit < units; unit += stride) {
        const unit_place d = next;
        const unit_rows cur = next_rows;
        const bool more = unit + stride < units;
        if (more) {
            next = unit_at(unit + stride);
            unit_rows_start(next, next_rows);
        }
        const float *sw0 = nullptr, *sw1 = nullptr;
        if (kBlockScales) {
            sw0 = sm90_weight_block_scales(sc, d.expert, d.row0);
            sw1 = sm90_weight_block_scales(sc, d.expert, d.row0 + 64);
        }

        float acc0[NACC], acc1[NACC]; /* weight rows of box 0 / box 1 */
#pragma unroll
        for (int i = 0; i < NACC; ++i)
            acc0[i] = acc1[i] = 0.0f;
        /* block scales one k block ahead of the wgmmas that need them */
        const int32_t row_off = kBlockScales ? static_cast<int32_t>(token_row(d, 0)) * a_ld : 0;
        k_scales ks = k_scales_at(cur, row_off, sw0, sw1, d.kb0);
        for (int kb = d.kb0; kb < d.kb1; ++kb, ++step) {
            const int s = step % STAGES;
            const k_scales ks_now = ks;
            mbar_wait(full_bar(s), static_cast<uint32_t>(step / STAGES) & 1u);
            decode_fp8_k_block<BT>(acc0, acc1, slot_at(s), slot_at(s) + W_BYTES, BOX_BYTES, ks_now, [&] {
                if (kBlockScales && kb + 1 < d.kb1)
                    ks = k_scales_at(cur, row_off, sw0, sw1, kb + 1);
            });
            __syncthreads(); /* every warp's wgmmas on slot s have retired */
            if (tid == 0 && p_unit < units) { /* the next stage into the slot just left */
                issue_w();
                issue_a(p_step % STAGES, p_kb, p.mt);
                p_advance();
            }
        }
        if (more)
            unit_rows_finish(next, next_rows);

        /* epilogue: weight row h of box b is row0 + 64 b + r + 8h; the
         * accumulator of token slot j is e = 4 (j / 2) + 2h + j % 2 */
        const T *bias = g.bias && d.split == 0 ? static_cast<const T *>(g.bias) + static_cast<int64_t>(d.expert) * g.n_rows
                                               : nullptr;
        float bias0[2], bias1[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int64_t row = d.row0 + r + 8 * h;
            bias0[h] = bias && row < g.n_rows ? mx_to_float(bias[row]) : 0.0f;
            bias1[h] = bias && row + 64 < g.n_rows ? mx_to_float(bias[row + 64]) : 0.0f;
        }
        float *y = static_cast<float *>(g.out) + d.split * g.out_split_stride;
#pragma unroll
        for (int j = 0; j < NTOK; ++j) {
            if (cur.pair[j] < 0)
                continue;
            const float w = cur.weight[j];
            float *out = y + static_cast<int64_t>(cur.pair[j]) * g.ldo;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int e = 4 * (j / 2) + 2 * h + (j % 2);
                const int64_t col = d.row0 + r + 8 * h;
                if (col < g.out_cols)
                    out[col] = (acc0[e] * cur.scale + bias0[h]) * w;
                if (col + 64 < g.out_cols)
                    out[col + 64] = (acc1[e] * cur.scale + bias1[h]) * w;
            }
        }
    }
#else
    __trap(); /* launched only where mx_cuda_sm90_gemm_available() saw sm_90a code */
#endif
}

/* The down kernel's grid for this GEMM2 (the CTAs that fit the GPU at once,
 * at most one per unit), or 0 where the decode kernel, one CTA per unit,
 * should run it instead. Persistence pays where units are short (up to 8 k
 * blocks: the ring's drain at every unit is what it saves) or few (up to two
 * per CTA, about one wave). Many long units ran slower here than one CTA per
 * unit: deepseekv3 fp8_tensor M = 512 (16 k blocks, 54 units per CTA) 967
 * against 869 us, gptoss fp8_tensor M = 512 (23 k blocks) 315 against 299
 * us, while qwen3moe fp8_tensor M = 512 (6 k blocks) 84 against 97 us,
 * deepseekv3 fp8_block M = 1 (1.7 units per CTA) 26 against 31 us (H200,
 * 2026-11-22; most likely the hardware's CTA scheduler balances the SMs
 * better than a fixed share of units does, untested). */
template <typename T, typename Shape, int QUANT>
mx_status sm90_decode_down_grid(const mx_gemm_args &g, const mx_sm90_scales &sc, int64_t m_tiles, int64_t *grid)
{
    *grid = 0;
    if (QUANT == MX_QUANT_FP8_BLOCK && m_tiles * Shape::kBlockT * sc.a_ld > 0x7fffffff)
        return mx_status_ok(); /* the kernel's int32 scale offsets: the decode kernel takes it */
    const int64_t unit_k_blocks = mx_ceil_div(g.k_splits == 1 ? g.k : g.k_split_len, 128);
    const int64_t units = m_tiles * mx_ceil_div(g.n_rows, 128) * g.k_splits;
    auto kernel = grouped_gemm_sm90_decode_down_kernel<T, Shape, QUANT>;
    static const mx_kernel_name kernel_name("grouped_gemm_sm90_decode_down_kernel<%s, %d%s>", sm90_dtype<T>::name(),
                                            Shape::kBlockT, sm90_quant_names[QUANT]);
    static std::atomic<unsigned long long> configured{0};
    mx_status st = mx_opt_in_smem(kernel, Shape::kSmemBytes, configured, kernel_name.text);
    if (st.code != MX_OK)
        return st;
    static std::atomic<int> resident[64];
    int ctas = 0;
    st = mx_resident_ctas(kernel, Shape::kThreads, Shape::kSmemBytes, resident, kernel_name.text, &ctas);
    if (st.code != MX_OK)
        return st;
    if (unit_k_blocks <= 8 || units <= 2 * static_cast<int64_t>(ctas))
        *grid = units < ctas ? units : ctas;
    return mx_status_ok();
}

/* GEMM2 of FP8 experts over A = g.a [rows, K] (act_q, stride g.lda bytes)
 * on `grid` CTAs (from sm90_decode_down_grid); the caller checked the TMA
 * preconditions. m_tiles: the worst case of the tile table. */
template <typename T, typename Shape, int QUANT>
mx_status launch_sm90_decode_down(const mx_gemm_args &g, const mx_sm90_scales &sc, int64_t local_experts,
                                  int64_t m_tiles, int64_t grid, cudaStream_t stream)
{
    typedef __nv_fp8_e4m3 TA;
    auto kernel = grouped_gemm_sm90_decode_down_kernel<T, Shape, QUANT>;
    const int64_t n_tiles = mx_ceil_div(g.n_rows, 128);
    const int64_t k_blocks = mx_ceil_div(g.k, 128);
    const int64_t kb_per_split = g.k_splits == 1 ? k_blocks : g.k_split_len / 128;
    const char *name = "grouped_gemm_sm90_decode_down_kernel";
    if (g.k_splits < 1 || kb_per_split < 1 || (g.k_splits > 1 && g.k_split_len % 128) ||
        mx_ceil_div(k_blocks, kb_per_split) != g.k_splits)
        return mx_status_fail(MX_ERR_VALUE, "%s: %d k splits of %lld do not tile k = %lld", name, g.k_splits,
                              (long long)g.k_split_len, (long long)g.k);
    const int64_t units = m_tiles * n_tiles * g.k_splits;
    if (units > 0x3fffffff || m_tiles * Shape::kBlockT > 0x7fffffff || grid < 1 || grid > units)
        return mx_status_fail(MX_ERR_VALUE, "%s: %lld work units on %lld CTAs", name, (long long)units,
                              (long long)grid);
    mx_status st;
    CUtensorMap map_a, map_w;
    /* L2 promotion 128B on 16-token tiles (gemm_configs.cuh
     * kSm90DecodeDownShortRowBytes has the measurements; packed maps always
     * take 128B, sm90_weight_map) */
    const int promotion =
        Shape::kBlockT == 16 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
    if (!sm90_weight_map<TA>(g.w, g.k, g.n_rows, local_experts, 64, g.w_packed, &map_w, &st, promotion) ||
        !sm90_rows_map<TA>(g.a, g.lda, m_tiles * Shape::kBlockT, Shape::kBlockT, g.k, &map_a, &st))
        return st;
    return mx_check_call(mx_launch_dependent(kernel, dim3(static_cast<unsigned>(grid)), dim3(Shape::kThreads),
                                             Shape::kSmemBytes, stream, map_a, map_w, g, sc,
                                             static_cast<int>(n_tiles), static_cast<int>(kb_per_split)),
                         name);
}

} /* namespace */

#endif /* MOE_EXT_CUDA_GROUPED_GEMM_SM90_DECODE_DOWN_CUH */
