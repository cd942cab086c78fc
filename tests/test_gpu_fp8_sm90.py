"""FP8 layers with H, I multiples of 16, so that a Hopper GPU runs the FP8 wgmma kernels
(gemm_configs_fp8.cuh, mx_fp8_select_sm90_config): the persistent kernel from 64 rows per local
expert (its GEMM1 reading x_q by token below 128 rows per local expert, by sorted row from there:
mx_fp8_sm90_gemm1_a_by_token), the decode kernel (16- / 32- / 48- / 64-token tiles, split-K)
below; from 24 to 127 rows per local expert with H, I <= 2048 (any H, I from 32 local experts)
the persistent kernel's ping-pong 64-row units (with block scales not for a gated GEMM1 whose
I % 128 != 0); other GPUs run the mma.sync tiles through the same checks. A profiler trace shows
which kernels ran.
H and I are mostly not multiples of 128, so partial scale blocks, k tails and partial n tiles run.

Per-tensor layers are checked with compare_tensor: the activation scale is the max over the
rounded activations, so the engine's GEMM landing one bf16 ulp away on that single largest value
(wgmma's FP8 accumulation is not exact float32) re-rounds every activation on a grid shifted by
0.4%, ~2% of the output (seen at M = 699: 0.0216 against the reference's own amax). The test
accepts the reference with its amax one ulp up or down too, and prints all three errors."""
import re

import pytest
import torch

import moe_ext
from helpers import capture_forward, down_splits, kernels_of, on_hopper, randn, replay
from test_fp8 import CONFIGS, FP8_TOL, METHODS, compare, fp8_model, fp8_reference
import test_gpu_sm90
from test_gpu_sm90 import PAIR_SHAPE, PERSISTENT_KERNEL, PING_PONG_SHAPE, deals_units, expected_gemm_kernel
from test_loading import checkpoint, vllm_load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not moe_ext.cuda_available(), reason="needs CUDA")]

WGMMA_FP8 = "grouped_gemm_sm90_kernel<__nv_fp8_e4m3"
DECODE_FP8 = "grouped_gemm_sm90_decode_kernel<__nv_fp8_e4m3"
DECODE_DOWN_FP8 = "grouped_gemm_sm90_decode_down_kernel<"  # FP8 GEMM2 at decode (persistent)
WIDE_SHAPE = "mx_sm90_shape<256, 4, 1, 8, false>"  # the persistent kernel's 128x256 tiles
NARROW_SHAPE = "mx_sm90_shape<128, 6, 1, 8, false>"  # its 128x128 tiles (block scales, gated GEMM1, I % 128 != 0)
# the persistent FP8 GEMM1 (kinds 0-2; 3 is GEMM2): its template arguments A_BY_TOKEN, then DEALT
PERSISTENT_GEMM1_FP8 = re.compile(r"grouped_gemm_sm90_kernel<__nv_fp8_e4m3, .*mx_sm90_shape<[^>]*>, [012], [12], "
                                  r"(true|false), (?:true|false)>")


def ping_pong_units(method, cfg, rows_per_expert, h, i, experts):
    """Whether the FP8 rule puts the persistent kernel on ping-pong 64-row units
    (gemm_configs_fp8.cuh kFp8Sm90PingPongMinRowsPerExpert): 24 (16 with block scales or K past
    2048) to 127 rows per local expert, H and I at most 2048 unless there are 32 local experts or
    more, not the interleaved GEMM1; with block scales a gated GEMM1 needs I % 128 == 0 (its
    128-row up box in one scale block)."""
    min_rows = 16 if method == "block" or max(h, i) > 2048 else 24
    return ((method == "tensor" or not cfg[3] or i % 128 == 0)
            and test_gpu_sm90.ping_pong_units(rows_per_expert, h, i, experts, cfg[0] == "swigluoai-bias",
                                              min_rows, max_rows=128))


def check_persistent_shapes(names, ping_pong):
    """Both GEMMs ran on the persistent FP8 kernel, on ping-pong units or not."""
    wgmma = [n for n in names if WGMMA_FP8 in n]
    assert len(wgmma) == 2 and all((PING_PONG_SHAPE in n) == ping_pong for n in wgmma), names


def persistent_gemm1_reads_by_token(names, rows_per_expert):
    """Checks that the persistent FP8 GEMM1 ran once and read its A rows as the rule says for
    this many rows per local expert: by token below 128, by sorted row from there."""
    forms = [m.group(1) for n in names for m in [PERSISTENT_GEMM1_FP8.search(n)] if m]
    assert len(forms) == 1, f"one persistent FP8 GEMM1 expected: {names}"
    want = "true" if rows_per_expert < 128 else "false"
    assert forms[0] == want, f"{rows_per_expert} rows per expert: A_BY_TOKEN {forms[0]}, want {want}: {names}"


def compare_tensor(layer, out, x, logits, cfg, what):
    """compare() against the fake-quant reference; per tensor also with the activation amax one
    act-dtype ulp up and down (reference.fp8_experts act_amax_ulps): the smallest error counts."""
    import reference as ref
    from helpers import keep_rows
    shifts = (0, -1, 1) if layer.quant_method.weight_block_size is None else (0,)
    errs = []
    for ulps in shifts:
        want, margin = fp8_reference(layer, x, logits, cfg[1]["activation"], cfg[3], act_amax_ulps=ulps)
        keep = keep_rows(margin)
        errs.append(ref.rel_err(out.cpu()[keep], want.cpu()[keep]))
    print(f"{what}: rel_err {errs} (amax shifts {shifts}, bound {FP8_TOL})")
    assert min(errs) <= FP8_TOL, f"{what}: rel_err {errs} > {FP8_TOL}"


def checked_forward(gen, layer, m, e, what, x_offset=0, cfg=CONFIGS[0], dtype=torch.bfloat16):
    """A forward of m random tokens of `layer` (qwen style, made with `cfg`), checked for
    determinism and against the reference; returns the kernel names it ran (None off Hopper).
    x_offset: x starts that many elements into its allocation (rows off 16-byte boundaries)."""
    h = layer.hidden_size
    x = randn(gen, m * h + x_offset, dtype=dtype, device="cuda")[x_offset:].view(m, h)
    assert (x.data_ptr() % 16 == 0) == (x_offset % 8 == 0)
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    out = layer(x, logits)
    assert torch.equal(out, layer(x, logits)), "the forward must be deterministic"
    compare_tensor(layer, out, x, logits, cfg, what)
    return kernels_of(lambda: layer(x, logits)) if on_hopper() else None


def loaded(gen, style, method, dtype, e, k, h, i, cfg):
    name, kw, has_bias, gated, _ = cfg
    model, layer = fp8_model(style, method, "cuda", dtype=dtype, e=e, k=k, h=h, i=i, **kw)
    ckpt, _ = checkpoint(gen, style, e=e, h=h, i=i, has_bias=has_bias, gated=gated, dtype=dtype)
    vllm_load(model, ckpt, style, num_experts=e)
    return layer


@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_prefill_single_ctas(method, gen):
    """Past the 16-bit path's pair threshold (1024 rows per expert) FP8 stays on single-CTA tiles
    (gemm_configs_fp8.cuh: pairs measured slower for FP8)."""
    e, k, h, i = 4, 2, 256, 192
    layer = loaded(gen, "qwen", method, torch.bfloat16, e, k, h, i, CONFIGS[0])
    m = 2100
    x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    compare_tensor(layer, layer(x, logits), x, logits, CONFIGS[0], f"fp8 {method} M={m}")
    if on_hopper():
        names = kernels_of(lambda: layer(x, logits))
        assert any(WGMMA_FP8 in n for n in names), f"no {WGMMA_FP8} ran: {names}"
        assert not any(PAIR_SHAPE in n for n in names), f"a {PAIR_SHAPE} kernel ran: {names}"


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=[CONFIGS[0][0], CONFIGS[3][0]])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_ping_pong_units(method, cfg, gen):
    """24 to 127 rows per local expert with short K run the persistent kernel's ping-pong 64-row
    units, each math warpgroup every other unit of its CTA on the one ring; with block scales not
    the gated GEMM1 with I % 128 != 0 (silu here: the 128-row tiles). ~100 rows per expert (two
    64-row tiles, the second partial), H = 2000 and I = 1088 (GEMM1 9 n tiles, 16 k blocks with a
    tail; GEMM2 8 n tiles, the last past H, 9 k blocks, per tensor promoted in pairs with a
    zero-filled 10th) make 288 / 256 units: on 132 SMs both warpgroups of a CTA take units, some
    CTAs three."""
    e, k, h, i = 16, 4, 2000, 1088
    layer = loaded(gen, "qwen", method, torch.bfloat16, e, k, h, i, cfg)
    names = checked_forward(gen, layer, 400, e, f"fp8 {method} {cfg[0]} ping-pong units", cfg=cfg)
    if on_hopper():
        ping_pong = ping_pong_units(method, cfg, 100, h, i, e)
        assert ping_pong == (method == "tensor" or cfg[0] == "relu2-nogate")
        check_persistent_shapes(names, ping_pong)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]], ids=[CONFIGS[0][0], CONFIGS[2][0]])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_dealt_units_many_per_cta(method, cfg, gen):
    """The FP8 persistent kernels on single CTAs take their units from a counter through a 4-slot
    shared-memory ring (csrc/cuda/sm90_units.cuh), many per CTA: 200 rows of 64 local experts
    (128 m tiles), H = 1040 and I = 1088 (a multiple of 64, not of 128: block scales keep the
    wgmma kernels, on 128-wide tiles for the gated GEMM1) give GEMM1 9 n tiles (block-scale gated:
    17) and GEMM2 5 or 9, so each CTA of 132 takes 4-17 units per GEMM and the ring wraps; GEMM2
    takes the counter from zero only if GEMM1's last taker reset it. The rule
    (gemm_configs.cuh mx_sm90_deals_units): per tensor round robin from 256 rows per expert (400
    rows of 32 experts); block scales with 32 or more local experts dealt up to 1024 rows (400
    rows of 32 experts dealt, 1100 round robin), with fewer round robin from 256 (400 rows of 16)."""
    e, k, h, i = 64, 4, 1040, 1088
    block = method == "block"
    cases = [(200, e, True), (400, e // 2, block)] + ([(400, e // 4, False), (1100, e // 2, False)] if block else [])
    for rows, experts, dealt in cases:
        layer = loaded(gen, "qwen", method, torch.bfloat16, experts, k, h, i, cfg)
        names = checked_forward(gen, layer, rows * experts // k, experts, f"fp8 {method} {cfg[0]} {rows} rows",
                                cfg=cfg)
        if on_hopper():
            wgmma = [n for n in names if WGMMA_FP8 in n]
            assert len(wgmma) == 2 and not any(PAIR_SHAPE in n for n in wgmma), names
            assert all(deals_units(n) == dealt for n in wgmma), names


SILU_BIAS = ("silu-bias", dict(activation="silu", has_bias=True), True, True, False)


@pytest.mark.parametrize("rows_per_expert", [40, 150])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_persistent_gated_bias(method, rows_per_expert, gen):
    """w13 / w2 biases with the plain gated GEMM1 (silu; the other bias configs are interleaved):
    ~40 rows per expert run ping-pong units (the gate and up biases added in the act epilogue,
    with block scales before act is quantized there; w2's bias in GEMM2's staged stores), ~150 the
    128-row tiles. 16 experts, H = 400, I = 256."""
    e, k, h, i = 16, 4, 400, 256
    layer = loaded(gen, "qwen", method, torch.bfloat16, e, k, h, i, SILU_BIAS)
    m = rows_per_expert * e // k
    names = checked_forward(gen, layer, m, e, f"fp8 {method} silu + bias M={m}", cfg=SILU_BIAS)
    if on_hopper():
        check_persistent_shapes(names, ping_pong_units(method, SILU_BIAS, rows_per_expert, h, i, e))


@pytest.mark.parametrize("rows_per_expert", [20, 40])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_ping_pong_units_long_k(method, rows_per_expert, gen):
    """From 32 local experts the ping-pong units take any K, and past K = 2048 from 16 rows per
    expert: H = 2064 (17 k blocks, the last a 16-column tail), I = 640 (a multiple of 128, so
    block scales take them for the gated GEMM1 too, quantizing act in its epilogue; 5 k blocks,
    per tensor promoted in pairs with a zero-filled 6th), ~20 / ~40 rows per expert of 32: GEMM1
    5 n tiles, GEMM2 9 (the last past H), so 160 / 288 units."""
    e, k, h, i = 32, 4, 2064, 640
    layer = loaded(gen, "qwen", method, torch.bfloat16, e, k, h, i, CONFIGS[0])
    m = rows_per_expert * e // k
    names = checked_forward(gen, layer, m, e, f"fp8 {method} ping-pong units at K = {h}, M = {m}")
    if on_hopper():
        assert ping_pong_units(method, CONFIGS[0], rows_per_expert, h, i, e)
        check_persistent_shapes(names, True)
        persistent_gemm1_reads_by_token(names, rows_per_expert)
        quantizers = [n for n in names if "group_quant" in n]
        assert len(quantizers) == (0 if method == "tensor" else 1), names


@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_no_ping_pong_past_short_k(method, gen):
    """Past K = 2048 (H = 2064) with 16 local experts the same rows per expert keep the 128-row
    tiles."""
    e, k, h, i = 16, 4, 2064, 1088
    layer = loaded(gen, "qwen", method, torch.bfloat16, e, k, h, i, CONFIGS[0])
    names = checked_forward(gen, layer, 400, e, f"fp8 {method} 128-row tiles at K = {h}")
    if on_hopper():
        check_persistent_shapes(names, False)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]], ids=[CONFIGS[0][0], CONFIGS[2][0]])
@pytest.mark.parametrize("i", [320, 4160])
def test_fp8_block_persistent_y_layouts(cfg, i, gen):
    """Block scales on the persistent kernel: GEMM2 stores y by sorted row through TMA boxes up to
    I = 4096 (gemm_configs_fp8.cuh kFp8Sm90DownBoxesMaxK), by pair from the fragments past it, launched
    without the boxes' shared memory (its barriers sit where the boxes would be). At 100 rows per
    expert GEMM1 reads x_q by token, so y by sorted row is the only user of pair_rows."""
    e, k, h = 2, 2, 272
    layer = loaded(gen, "qwen", "block", torch.bfloat16, e, k, h, i, cfg)
    m = 100  # 100 rows per expert: the persistent kernel
    names = checked_forward(gen, layer, m, e, f"fp8 block {cfg[0]} I={i} M={m}", cfg=cfg)
    if on_hopper():
        assert any(WGMMA_FP8 in n for n in names), f"no {WGMMA_FP8} ran: {names}"
        persistent_gemm1_reads_by_token(names, m * k / e)


@pytest.mark.parametrize("h,i,m,cfg", [(400, 256, 350, CONFIGS[0]), (1168, 384, 800, CONFIGS[1]),
                                       (400, 320, 800, CONFIGS[0])], ids=["silu-i256", "gelu-i384", "silu-i320"])
def test_fp8_block_persistent_tile_widths(h, i, m, cfg, gen):
    """Block scales on the persistent kernel (gemm_configs_fp8.cuh mx_fp8_sm90_block_wide): GEMM1
    on the 128x256 tiles (128-row weight boxes, each k block promoted per box; act quantized in the
    epilogue, one 128-column group per tile row) except the gated kind with I % 128 != 0, whose up
    box would straddle two scale blocks (128x128 tiles); GEMM2 on 128x256 from 512 rows per
    expert. M = 350 / 800: ~233 / ~533 rows per expert. H = 1168: nine
    k blocks with a tail, and a partial n tile in GEMM2."""
    e, k = 3, 2
    layer = loaded(gen, "qwen", "block", torch.bfloat16, e, k, h, i, cfg)
    names = checked_forward(gen, layer, m, e, f"fp8 block {cfg[0]} H={h} I={i} M={m}", cfg=cfg)
    if on_hopper():
        gemm1 = WIDE_SHAPE if i % 128 == 0 else NARROW_SHAPE
        gemm2 = WIDE_SHAPE if m * k >= 512 * e else NARROW_SHAPE
        # both by sorted row (A_BY_TOKEN false) from 128 rows per expert
        assert any(WGMMA_FP8 in n and f"{gemm1}, 0, 2, false, " in n for n in names), f"GEMM1 not on {gemm1}: {names}"
        assert any(WGMMA_FP8 in n and f"{gemm2}, 3, 2, false, " in n for n in names), f"GEMM2 not on {gemm2}: {names}"
        # the wide gated GEMM1 quantizes act in its epilogue: x's group quantizer is the only one
        quantizers = [n for n in names if "group_quant" in n]
        assert len(quantizers) == (1 if gemm1 == WIDE_SHAPE else 2), names


def test_fp8_block_gated_unaligned_intermediate_falls_back(gen):
    """Block scales with I % 64 != 0: a 64-row gate/up box would straddle two scale blocks, so the
    layer runs the mma.sync tiles (and stays correct)."""
    e, k, h, i = 6, 2, 400, 208
    layer = loaded(gen, "mixtral", "block", torch.bfloat16, e, k, h, i, CONFIGS[0])
    m = 600
    x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    want, margin = fp8_reference(layer, x, logits)
    compare(layer(x, logits), want, margin, FP8_TOL, f"fp8 block I={i}")
    if on_hopper():
        names = kernels_of(lambda: layer(x, logits))
        assert not any(WGMMA_FP8 in n for n in names), f"unexpected FP8 wgmma kernel: {names}"


# decode kernel: 16-token tiles (1 token), 16-, 32-, 48-, 64-token tiles; persistent kernel: 100
# (GEMM1's A rows by token), 233 (by sorted row)
@pytest.mark.parametrize("rows_per_expert", [0.5, 5, 16, 30, 48, 100, 233])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_matches_reference(method, cfg, dtype, rows_per_expert, gen):
    e, k, h, i = 6, 2, 400, 320  # I % 64 == 0: block-scale boxes of GATE_UP
    layer = loaded(gen, "qwen", method, dtype, e, k, h, i, cfg)
    m = max(1, int(rows_per_expert * e / k))
    names = checked_forward(gen, layer, m, e, f"fp8 {method} {cfg[0]} {dtype} M={m}", cfg=cfg, dtype=dtype)
    if on_hopper():
        tile = expected_gemm_kernel(m * k / e)
        ping_pong = ping_pong_units(method, cfg, m * k / e, h, i, e)
        if tile == PERSISTENT_KERNEL or ping_pong:
            check_persistent_shapes(names, ping_pong)
            persistent_gemm1_reads_by_token(names, m * k / e)
        else:
            assert any(DECODE_FP8 in n and tile in n for n in names), f"no {DECODE_FP8} {tile}: {names}"
            assert any(DECODE_DOWN_FP8 in n and tile in n for n in names), f"no {DECODE_DOWN_FP8} {tile}: {names}"
            # block scales: on 16- and 32-token tiles GEMM1's epilogue quantizes act, so the only
            # group quantizer left is x's
            quantizers = [n for n in names if "group_quant" in n]
            act_in_gemm1 = any(f"<{t}," in tile for t in (16, 32))
            assert len(quantizers) == (0 if method == "tensor" else 1 if act_in_gemm1 else 2), names


# 32 tokens: the one-block sort after route_kernel; 100: the same at more rows per expert; 300:
# the split sort (2400 pairs); x one element past a 16-byte boundary: the quantizers' scalar forms
@pytest.mark.parametrize("m, x_offset", [(32, 0), (100, 0), (300, 0), (100, 1)])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_persistent_expert_parallel(method, m, x_offset, gen):
    """Expert parallel on the persistent kernel: from 128 rows per local expert (100 and 300
    tokens) the x quantizer writes each token's row to the sorted rows of its local pairs
    (moe_align's pair_rows), so the pairs of other ranks' experts must get none; at 32 tokens
    (64 rows: ping-pong units, with either scales as I = 256) GEMM1 reads x_q by token, rows of
    tokens without a local expert unwritten. 4 of 64 experts local, top-8: the rules count all
    M k pairs per local expert, while only about an eighth of the tokens have a local expert."""
    e, k, h, i = 64, 8, 272, 256
    model, layer = fp8_model("qwen", method, "cuda", e=e, k=k, h=h, i=i, ep_size=16, ep_rank=5)
    ckpt, _ = checkpoint(gen, "qwen", e=e, h=h, i=i, dtype=torch.bfloat16)
    vllm_load(model, ckpt, "qwen", num_experts=e)
    assert layer.local_num_experts == 4
    names = checked_forward(gen, layer, m, e, f"fp8 {method} persistent ep M={m} x offset {x_offset}",
                            x_offset)
    if on_hopper():
        assert expected_gemm_kernel(m * k / layer.local_num_experts) == PERSISTENT_KERNEL
        check_persistent_shapes(names, ping_pong_units(method, CONFIGS[0], m * k / layer.local_num_experts, h, i,
                                                       layer.local_num_experts))
        persistent_gemm1_reads_by_token(names, m * k / layer.local_num_experts)


@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_persistent_down_split_k(method, splits, gen):
    """The persistent kernel's per-tensor FP8 GEMM2 in k slices (gemm_configs.cuh
    mx_sm90_down_split), bias on slice 0: ~150 rows per expert, I = 4224 (33 k blocks, 34 in
    promoted pairs, so slices of 18 and 16), y by pair (I > 4096). The kernel picks 2 (splits 0);
    1 and 3 forced (_set_sm90_down_splits). Block scales take no slices, forced or not."""
    e, k, h, i = 4, 2, 272, 4224
    layer = loaded(gen, "mixtral", method, torch.bfloat16, e, k, h, i, CONFIGS[2])  # swigluoai + bias
    with down_splits(splits):
        names = checked_forward(gen, layer, 300, e, f"fp8 {method} GEMM2 {splits} slices", cfg=CONFIGS[2])
    if on_hopper():
        assert any(WGMMA_FP8 in n and ", 3, " in n for n in names), f"no persistent FP8 GEMM2 ran: {names}"


@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_decode_split_k_and_fp16(method, gen):
    """One token, few experts, long I: GEMM2 runs in split-K slices (fp16 act dtype)."""
    e, k, h, i = 4, 2, 256, 2048
    layer = loaded(gen, "mixtral", method, torch.float16, e, k, h, i, CONFIGS[2])  # swigluoai + bias
    for m in (1, 3):
        x = randn(gen, m, h, dtype=torch.float16, device="cuda")
        logits = randn(gen, m, e, device="cuda", scale=2.0)
        compare_tensor(layer, layer(x, logits), x, logits, CONFIGS[2], f"fp8 {method} split-K M={m}")
        if on_hopper():
            names = kernels_of(lambda: layer(x, logits))
            assert any(DECODE_DOWN_FP8 in n for n in names), f"no {DECODE_DOWN_FP8} ran: {names}"


@pytest.mark.parametrize("i", [256, 1280])  # 2 and 10 k blocks per unit
@pytest.mark.parametrize("rows_per_expert", [5, 30])  # 16- and 48-token tiles
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_decode_down_walks_many_units(method, rows_per_expert, i, gen):
    """FP8 GEMM2 with more work units than CTAs that fit the GPU and a partial chunk of n tiles
    (H = 2064: 17 n tiles; past K = 2048 with fewer than 32 local experts, so at 30 rows per expert
    it stays on the decode kernel, not ping-pong units: 31 x 17 = 527 units). Units of up to 8 k
    blocks (I = 256) run the persistent down kernel, each CTA walking several units with its ring
    running on across them (2 k blocks per unit, fewer than the stages); longer ones (I = 1280) the
    decode kernel, one CTA per unit."""
    e, k, h = 31, 2, 2064
    layer = loaded(gen, "qwen", method, torch.bfloat16, e, k, h, i, CONFIGS[0])
    m = int(rows_per_expert * e / k)
    names = checked_forward(gen, layer, m, e, f"fp8 {method} down I={i} M={m}")
    if names is not None:
        tile = expected_gemm_kernel(m * k / e)
        persistent = any(DECODE_DOWN_FP8 in n and tile in n for n in names)
        down_kind = f">, 3, {1 if method == 'tensor' else 2}>"  # after the shape: MX_GEMM_DOWN, quant
        decode_down = any(DECODE_FP8 in n and tile in n and down_kind in n for n in names)
        assert (persistent, decode_down) == (i == 256, i == 1280), names


@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_decode_paired_loads(method, gen):
    """FP8 GEMM1 on a 16-token grid that fills the deep ring's slots (~432 CTAs) pairs its weight
    loads (gemm_configs.cuh mx_sm90_decode_paired): H = 1392 is 11 k blocks, the last one alone
    and partial (a k tail and a partial scale block)."""
    e, k, h, i, m = 16, 2, 1392, 2560, 8
    layer = loaded(gen, "qwen", method, torch.bfloat16, e, k, h, i, CONFIGS[0])
    names = checked_forward(gen, layer, m, e, f"fp8 {method} paired M={m}")
    if names is not None:
        assert any(DECODE_FP8 in n and "mx_sm90_decode_shape<16, 6, true>, 0," in n for n in names), names


# decode kernel, persistent kernel (swigluoai + bias: 128-row tiles), ping-pong units (silu, I =
# 256: with either scales, 32 rows per expert)
@pytest.mark.parametrize("m, cfg, i", [(4, CONFIGS[2], 192), (512, CONFIGS[2], 192), (96, CONFIGS[0], 256)],
                         ids=["decode", "persistent", "ping-pong"])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_graph_replay(method, m, cfg, i, gen):
    e, k, h = 6, 2, 256
    layer = loaded(gen, "mixtral", method, torch.bfloat16, e, k, h, i, cfg)
    static_x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    static_logits = randn(gen, m, e, device="cuda", scale=2.0)
    graph, static_out = capture_forward(layer, static_x, static_logits, warmup=2)
    for scale in (0.3, 3.0):
        x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda", scale=scale)
        logits = randn(gen, m, e, device="cuda", scale=2.0)
        replay(graph, static_x, static_logits, x, logits)
        compare_tensor(layer, static_out, x, logits, cfg, f"fp8 {method} {cfg[0]} graph replay M={m}")
    if on_hopper() and m == 96:
        names = kernels_of(lambda: layer(static_x, static_logits))
        check_persistent_shapes(names, ping_pong_units(method, cfg, m * k / e, h, i, e))


@pytest.mark.parametrize("rows", [1, 19, 300])  # 16-row tiles, several of them, 64-row tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("method", list(METHODS))
def test_linear_fp8_on_hopper_wgmma(method, bias, rows, gen):
    """moe_ext.Linear with in_features % 16 == 0: the dense FP8 GEMM runs on the decode kernel's
    wgmma on Hopper (out_features not a multiple of 128: partial n tiles and scale blocks)."""
    import moe_ext
    from moe_ext import Fp8OnlineConfig
    import reference as ref
    from test_fp8 import FP8_VS_BF16, dequantized_linear
    n_in, n_out = 400, 200
    lin = moe_ext.Linear(n_in, n_out, bias=bias, params_dtype=torch.bfloat16,
                         quant_config=Fp8OnlineConfig(METHODS[method]), device="cuda")
    w = randn(gen, n_out, n_in, dtype=torch.bfloat16, scale=n_in ** -0.5)
    lin.weight.weight_loader(lin.weight, w)
    b = randn(gen, n_out, dtype=torch.bfloat16, scale=0.5) if bias else None
    if bias:
        lin.bias.weight_loader(lin.bias, b)
    lin.process_weights_after_loading()
    x = randn(gen, rows, n_in, dtype=torch.bfloat16, device="cuda")
    out = lin(x)
    xc = x.cpu()
    xq = ref.fake_quant_group(xc) if method == "block" else ref.fake_quant_tensor(xc)
    want = xq @ dequantized_linear(lin).cpu().T + (b.double() if bias else 0)
    err = ref.rel_err(out.cpu(), want)
    assert err <= FP8_TOL, f"linear {method} rows={rows}: rel_err {err:.4g}"
    assert ref.rel_err(out.cpu(), xc.double() @ w.double().T + (b.double() if bias else 0)) <= FP8_VS_BF16
    if on_hopper():
        names = kernels_of(lambda: lin(x))
        assert any(DECODE_FP8 in n for n in names), f"no FP8 wgmma kernel ran: {names}"
