"""Leak loops: 10,000 forwards, failing calls and weight_loader calls must not grow memory."""
import gc
import os
import sys

import pytest
import torch

import moe_ext
from moe_ext import FusedMoE
from helpers import expert_weights, make_layer, randn

E, K, H, I, M = 4, 2, 64, 16, 4
N = 10_000
WARM = 1_000
RSS_LIMIT = 4 << 20  # a leaked [M, H] float32 output per call would be ~10 MiB


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_growth(fn, n=N, warm=WARM):
    """Bytes of resident memory gained over n calls of fn, after `warm` warm-up calls."""
    for _ in range(warm):
        fn()
    gc.collect()
    before = rss()
    for _ in range(n):
        fn()
    gc.collect()
    return rss() - before


def refcounts(*objs):
    return [sys.getrefcount(o) for o in objs]


@pytest.fixture
def layer(gen):
    return make_layer(expert_weights(gen, E, H, I, has_bias=True), num_experts=E, top_k=K,
                      hidden_size=H, intermediate_size=I, has_bias=True)


def test_forward(layer, gen):
    x, logits = randn(gen, M, H), randn(gen, M, E)
    params = list(layer.parameters())
    counts = refcounts(x, logits, *params)
    out = layer(x, logits)
    assert sys.getrefcount(out) == 2, "the output tensor has an extra reference"
    del out
    growth = rss_growth(lambda: layer(x, logits))
    assert refcounts(x, logits, *params) == counts
    assert growth < RSS_LIMIT, f"RSS grew by {growth / 2**20:.1f} MiB over {N} forwards"


def test_functional(gen):
    w = expert_weights(gen, E, H, I)
    x, logits = randn(gen, M, H), randn(gen, M, E)
    bias = randn(gen, E)
    tw, ids, _ = moe_ext.fused_topk(x, logits, K, True)
    args = (x, logits, w["w13_weight"], w["w2_weight"], tw, ids, bias)
    counts = refcounts(*args)

    def step():
        moe_ext.fused_topk(x, logits, K, True)
        moe_ext.grouped_topk(x, logits, K, True, num_expert_group=2, topk_group=1,
                             scoring_func="sigmoid", e_score_correction_bias=bias)
        moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], tw, ids)

    out = moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], tw, ids)
    assert sys.getrefcount(out) == 2
    weights, topk = FusedMoE.select_experts(x, logits, K, False, True)
    assert sys.getrefcount(weights) == 2 and sys.getrefcount(topk) == 2
    del out, weights, topk
    growth = rss_growth(step, n=N // 3, warm=WARM // 3)
    assert refcounts(*args) == counts
    assert growth < RSS_LIMIT, f"RSS grew by {growth / 2**20:.1f} MiB"


def test_error_paths(layer, gen):
    x, logits = randn(gen, M, H), randn(gen, M, E)
    x64 = x.double()
    strided = randn(gen, M, 2 * H)[:, ::2]
    bad_logits = randn(gen, M, E + 1)
    meta = x.to("meta")
    bad_w = randn(gen, I, H + 1)
    objs = (x, logits, x64, strided, bad_logits, meta, bad_w, layer.w13_weight)
    counts = refcounts(*objs)
    calls = [
        (lambda: layer(x64, logits), TypeError),
        (lambda: layer(strided, logits), ValueError),
        (lambda: layer(x, bad_logits), ValueError),
        (lambda: layer(meta, logits), (ValueError, TypeError)),
        (lambda: layer(x, None), TypeError),
        (lambda: layer.weight_loader(layer.w13_weight, bad_w, "experts.w13_weight",
                                     shard_id="w1", expert_id=1), ValueError),
        (lambda: moe_ext._C.route(logits.int(), K), TypeError),
    ]
    state = {"i": 0}

    def step():
        fn, kind = calls[state["i"] % len(calls)]
        state["i"] += 1
        try:
            fn()
        except kind:
            return
        raise AssertionError("no exception")

    growth = rss_growth(step, n=N, warm=WARM)
    assert refcounts(*objs) == counts, "an error path leaked or dropped a reference"
    assert growth < RSS_LIMIT, f"RSS grew by {growth / 2**20:.1f} MiB over {N} failing calls"


def test_weight_loader(layer, gen):
    w1 = randn(gen, I, H)
    w2 = randn(gen, H, I)
    b1 = randn(gen, I)
    params = list(layer.parameters())
    counts = refcounts(w1, w2, b1, *params)
    state = {"e": 0}

    def step():
        e = state["e"] % E
        state["e"] += 1
        layer.weight_loader(layer.w13_weight, w1, "experts.w13_weight", shard_id="w3",
                            expert_id=e)
        layer.weight_loader(layer.w2_weight, w2, "experts.w2_weight", shard_id="w2",
                            expert_id=e)
        layer.weight_loader(layer.w13_bias, b1, "experts.w13_bias", shard_id="w1", expert_id=e)

    growth = rss_growth(step, n=N // 3, warm=WARM // 3)
    assert refcounts(w1, w2, b1, *params) == counts
    assert torch.equal(layer.w13_weight[:, I:], w1.expand(E, I, H))
    assert growth < RSS_LIMIT, f"RSS grew by {growth / 2**20:.1f} MiB"


@pytest.mark.parametrize("block", [None, [128, 128]], ids=["tensor", "block"])
def test_fp8_forward_apply_linear_and_errors(gen, block):
    """The FP8 C method types (apply fetches the layer's attributes) and the quantizers."""
    config = moe_ext.Fp8OnlineConfig(weight_block_size=block)
    h, i = 256, 192
    layer = FusedMoE(E, K, h, i, params_dtype=torch.bfloat16, quant_config=config)
    for e in range(E):
        for shard, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, randn(gen, *shape, scale=0.05), "experts.weight",
                                shard_id=shard, expert_id=e)
    linear = moe_ext.Linear(h, 64, params_dtype=torch.bfloat16, quant_config=config)
    linear.weight.weight_loader(linear.weight, randn(gen, 64, h, scale=0.05))
    x, logits = randn(gen, M, h, dtype=torch.bfloat16), randn(gen, M, E)
    weights, ids = FusedMoE.select_experts(x, logits, K, False, True)
    params = list(layer.parameters()) + list(linear.parameters())
    counts = refcounts(x, logits, weights, ids, *params)

    def calls():
        layer(x, logits)
        layer.quant_method.apply(layer, x, weights, ids)
        layer.quant_method.get_fused_moe_quant_config(layer)
        linear(x)
        moe_ext.per_token_group_quant_fp8(x, 128)
        with pytest.raises(TypeError):
            layer.quant_method.apply(layer, x.float(), weights, ids)

    growth = rss_growth(calls, n=N // 2, warm=WARM // 2)
    assert refcounts(x, logits, weights, ids, *params) == counts
    assert growth < RSS_LIMIT, f"RSS grew by {growth / 2**20:.1f} MiB over {N // 2} rounds"
