"""The one-launch decode forward (csrc/cuda/decode_fused.cu): one or two tokens with 16-bit
weights (16-byte rows, at most 8 token-slot pairs), one token with gated FP8 weights (H, I
multiples of 128). Each test checks
that exactly one kernel, decode_fused_kernel, ran (on Hopper), and compares with the float64
reference and with the multi-launch pipeline (moe_ext._C._set_decode_fused(False)). The 16-bit
H and I are not multiples of a lane step's 512 bytes, so the k tails run; the FP8 I = 384 is not
a multiple of 256, so a K split over warps gets uneven block counts."""
import pytest
import torch

import moe_ext
from moe_ext import _C
from helpers import capture_forward, decode_fused, expert_weights, kernels_of, on_hopper, randn, replay
import reference as ref
from test_fp8 import CONFIGS as FP8_CONFIGS, METHODS, functional_fp8, row_major_weights
from test_gpu import CONFIGS, check, cuda_case, out_of_range_case
from test_gpu_fp8_sm90 import compare_tensor, loaded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not moe_ext.cuda_available(), reason="needs CUDA")]

FUSED = "decode_fused_kernel"


def only_fused(fn):
    """fn's kernels are the fused kernel alone (on Hopper), or none of it elsewhere."""
    names = kernels_of(fn)
    if on_hopper():
        assert len(names) == 1 and FUSED in names[0], f"expected one {FUSED} launch: {names}"
    else:
        assert not any(FUSED in n for n in names), names


def only_pipeline(fn):
    """fn's kernels are the pipeline's: several, none of them the fused kernel."""
    names = kernels_of(fn)
    assert len(names) > 1 and not any(FUSED in n for n in names), names


def pipeline_out(fn):
    with decode_fused(False):
        names = kernels_of(fn)
        assert not any(FUSED in n for n in names), names
        return fn()


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_fused_matches_reference(cfg, dtype, m, gen):
    _, e, k, kw, corr = cfg
    layer, _, reference = cuda_case(gen, dtype, e, dict(kw, top_k=k), corr, h=264, i=200)
    x = randn(gen, m, layer.hidden_size, dtype=dtype, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    out = layer(x, logits)
    assert torch.equal(out, layer(x, logits)), "the forward must be deterministic"
    want, margin = reference(x, logits)
    check(out, want, margin, dtype)
    check(out, pipeline_out(lambda: layer(x, logits)).double(), margin, dtype)
    # 16-bit weights: at most 8 (token, slot) pairs (grouped-sigmoid-bias at M = 2 has 16)
    (only_fused if m * k <= 8 else only_pipeline)(lambda: layer(x, logits))


def test_three_tokens_take_the_pipeline(gen):
    layer, _, reference = cuda_case(gen, torch.bfloat16, 12, dict(top_k=3), False, h=264, i=200)
    x = randn(gen, 3, 264, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, 3, 12, device="cuda", scale=2.0)
    only_pipeline(lambda: layer(x, logits))
    want, margin = reference(x, logits)
    check(layer(x, logits), want, margin, torch.bfloat16)
    only_fused(lambda: layer(x[:2], logits[:2]))


FP8_GATED = [c for c in FP8_CONFIGS if c[3] and not c[4]]  # gate rows then up rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cfg", FP8_GATED, ids=[c[0] for c in FP8_GATED])
@pytest.mark.parametrize("method", list(METHODS))
def test_fused_fp8_matches_reference(method, cfg, dtype, gen):
    e, k, h, i = 9, 3, 256, 384
    layer = loaded(gen, "mixtral", method, dtype, e, k, h, i, cfg)
    x = randn(gen, 1, h, dtype=dtype, device="cuda")
    logits = randn(gen, 1, e, device="cuda", scale=2.0)
    out = layer(x, logits)
    assert torch.equal(out, layer(x, logits)), "the forward must be deterministic"
    compare_tensor(layer, out, x, logits, cfg, f"fused fp8 {method}")
    compare_tensor(layer, pipeline_out(lambda: layer(x, logits)), x, logits, cfg, "pipeline")
    only_fused(lambda: layer(x, logits))


@pytest.mark.parametrize("method", list(METHODS))
def test_fused_fp8_caller_ids(method, gen):
    """fused_experts with the caller's ids at one token: the one launch reads them instead of
    routing (block scales: x quantized meanwhile by the other warps) and gives the layer's
    forward on the same routing."""
    e, k, h, i = 9, 3, 256, 384
    layer = loaded(gen, "mixtral", method, torch.bfloat16, e, k, h, i, FP8_GATED[0])
    x = randn(gen, 1, h, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, 1, e, device="cuda", scale=2.0)
    topk_weights, topk_ids = moe_ext.FusedMoE.select_experts(x, logits, k, False, layer.renormalize)
    weights = row_major_weights(layer)  # made here: their copies are not the forward's launches

    def run():
        return functional_fp8(layer, method, x, topk_weights, topk_ids, weights)

    out = run()
    compare_tensor(layer, out, x, logits, FP8_GATED[0], f"fused fp8 {method} caller ids")
    assert torch.equal(out, layer(x, logits)), "caller ids and in-kernel routing differ"
    only_fused(run)


@pytest.mark.parametrize("case", ["two tokens", "swigluoai", "h % 128", "h > 2048"])
@pytest.mark.parametrize("method", list(METHODS))
def test_other_fp8_layers_take_the_pipeline(method, case, gen):
    cfg = FP8_CONFIGS[2] if case == "swigluoai" else FP8_CONFIGS[0]
    h = {"h % 128": 400, "h > 2048": 2176}.get(case, 256)
    m = 2 if case == "two tokens" else 1
    layer = loaded(gen, "mixtral", method, torch.bfloat16, 9, 3, h, 256, cfg)
    x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, 9, device="cuda", scale=2.0)
    only_pipeline(lambda: layer(x, logits))
    compare_tensor(layer, layer(x, logits), x, logits, cfg, f"pipeline fp8 {method} {case}")


@pytest.mark.parametrize("method", list(METHODS))
def test_fused_fp8_graph_replay_and_nan(method, gen):
    e, k, h, i = 6, 2, 256, 256
    layer = loaded(gen, "mixtral", method, torch.bfloat16, e, k, h, i, FP8_CONFIGS[0])
    static_x = randn(gen, 1, h, dtype=torch.bfloat16, device="cuda")
    static_logits = randn(gen, 1, e, device="cuda", scale=2.0)
    graph, static_out = capture_forward(layer, static_x, static_logits, warmup=2)
    for scale in (0.3, 3.0):
        x = randn(gen, 1, h, dtype=torch.bfloat16, device="cuda", scale=scale)
        logits = randn(gen, 1, e, device="cuda", scale=2.0)
        replay(graph, static_x, static_logits, x, logits, static_out)
        compare_tensor(layer, static_out, x, logits, FP8_CONFIGS[0], f"fused fp8 {method} graph replay")
    static_x[0, 5] = float("nan")
    graph.replay()
    torch.cuda.synchronize()
    assert static_out.isnan().all()
    assert torch.equal(static_out.isnan(), pipeline_out(lambda: layer(static_x, static_logits)).isnan())


def test_unaligned_rows_take_the_pipeline(gen):
    layer, _, _ = cuda_case(gen, torch.bfloat16, 12, dict(top_k=3), False, h=260, i=200)
    x = randn(gen, 2, 260, dtype=torch.bfloat16, device="cuda")
    names = kernels_of(lambda: layer(x, randn(gen, 2, 12, device="cuda")))
    assert not any(FUSED in n for n in names), names


@pytest.mark.parametrize("m", [1, 2])
def test_fused_graph_replay(m, gen):
    e, k, h, i = 6, 2, 256, 192
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(top_k=k), False, h=h, i=i)
    static_x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    static_logits = randn(gen, m, e, device="cuda", scale=2.0)
    graph, static_out = capture_forward(layer, static_x, static_logits, warmup=2)
    for scale in (0.3, 3.0):
        x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda", scale=scale)
        logits = randn(gen, m, e, device="cuda", scale=2.0)
        replay(graph, static_x, static_logits, x, logits, static_out)
        want, margin = reference(x, logits)
        check(static_out, want, margin, torch.bfloat16)


def test_nan_in_x_propagates_to_its_token_only(gen):
    e, k, h, i = 6, 2, 256, 192
    layer, _, _ = cuda_case(gen, torch.bfloat16, e, dict(top_k=k), False, h=h, i=i)
    x = randn(gen, 2, h, dtype=torch.bfloat16, device="cuda")
    x[1, 17] = float("nan")
    logits = randn(gen, 2, e, device="cuda", scale=2.0)
    out = layer(x, logits)
    assert out[1].isnan().all() and torch.isfinite(out[0]).all()
    assert torch.equal(out.isnan(), pipeline_out(lambda: layer(x, logits)).isnan())


def test_out_of_range_and_foreign_ids_contribute_nothing(gen):
    m = 2
    run, want = out_of_range_case(gen, 7, 3, 264, 200, m, [(0, 0), (1, 2), (1, 1)], bad_dtype=torch.int32)
    out = run()
    check(out, want, torch.ones(m), torch.bfloat16)
    only_fused(run)


def test_router_weight_on_input(gen):
    e, h, i, m = 5, 264, 200, 2
    w = expert_weights(gen, e, h, i, dtype=torch.bfloat16, device="cuda")
    x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    tw, ids, _ = ref.route(randn(gen, m, e, device="cuda", scale=2.0), 1)
    ids = ids.to(torch.int32)
    tw32 = tw.float()
    run = lambda: moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], tw32, ids,
                                        apply_router_weight_on_input=True)
    out = run()
    want = ref.experts(x, w["w13_weight"], w["w2_weight"], tw, ids, apply_router_weight_on_input=True,
                       act_dtype=torch.bfloat16)
    check(out, want, torch.ones(m), torch.bfloat16)
    assert torch.equal(out, pipeline_out(run)), "x * w is rounded as moe_scale_input rounds it"
    only_fused(run)


def test_set_decode_fused_returns_the_previous_setting():
    assert _C._set_decode_fused(False) is True
    assert _C._set_decode_fused(True) is False
    assert _C._set_decode_fused(True) is True
