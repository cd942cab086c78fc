"""Error branches: clear exceptions naming the argument, nothing written, no crash."""
import pytest
import torch

import moe_ext
from moe_ext import FusedMoE
from helpers import expert_weights, make_layer, randn

E, K, H, I, M = 7, 2, 24, 16, 5


@pytest.fixture
def layer(gen):
    return make_layer(expert_weights(gen, E, H, I), num_experts=E, top_k=K, hidden_size=H,
                      intermediate_size=I, prefix="model.layers.0.mlp.experts")


@pytest.fixture
def inputs(gen):
    return randn(gen, M, H), randn(gen, M, E)


def bits(t):
    size = t.element_size()
    return t.detach().contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8,
                                         8: torch.int64}[size]).clone()


def snapshot(layer):
    return {n: bits(p) for n, p in layer.named_parameters()}


def assert_unchanged(layer, before):
    for n, p in layer.named_parameters():
        assert torch.equal(bits(p), before[n]), f"{n} was written by a failing call"


# ---------------------------------------------------------------- forward inputs

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.bool], ids=str)
def test_hidden_states_dtype(layer, inputs, dtype):
    x, logits = inputs
    with pytest.raises(TypeError, match="hidden_states"):
        layer((x * 10).to(dtype), logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_hidden_states_dtype_differs_from_weights(layer, inputs, dtype):
    x, logits = inputs
    with pytest.raises(TypeError, match="hidden_states|w13|w2"):
        layer(x.to(dtype), logits)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64], ids=str)
def test_router_logits_dtype(layer, inputs, dtype):
    x, logits = inputs
    with pytest.raises(TypeError, match="router_logits"):
        layer(x, (logits * 10).to(dtype))


def test_hidden_states_shape(layer, inputs):
    x, logits = inputs
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[0], logits)  # 1-D
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[None], logits)  # 3-D
    with pytest.raises(ValueError, match="hidden_states|w13"):
        layer(torch.cat([x, x[:, :1]], dim=1), logits)  # H + 1


def test_router_logits_shape(layer, inputs, gen):
    x, logits = inputs
    with pytest.raises(ValueError, match="router_logits"):
        layer(x, randn(gen, M, E + 1))  # wrong number of experts
    with pytest.raises(ValueError, match="router_logits"):
        layer(x, randn(gen, M, E - 1))
    with pytest.raises(ValueError, match="router_logits"):
        layer(x, randn(gen, M + 1, E))  # wrong number of tokens
    with pytest.raises(ValueError, match="router_logits"):
        layer(x, logits[0])  # 1-D


def test_hidden_states_non_contiguous(layer, inputs, gen):
    _, logits = inputs
    wide = randn(gen, M, 2 * H)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(wide[:, ::2], logits)
    tall = randn(gen, H, M)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(tall.t(), logits)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(randn(gen, 1, H).expand(M, H), logits)  # stride 0


def test_meta_tensors(layer, inputs):
    x, logits = inputs
    with pytest.raises((ValueError, TypeError), match="hidden_states"):
        layer(x.to("meta"), logits)
    with pytest.raises((ValueError, TypeError), match="router_logits"):
        layer(x, logits.to("meta"))
    meta_layer = FusedMoE(E, K, H, I, device="meta")
    with pytest.raises((ValueError, TypeError), match="w13|w2"):
        meta_layer(x, logits)


@pytest.mark.parametrize("bad", [None, 3.0, "x", [[1.0] * H] * M], ids=["None", "float", "str",
                                                                         "list"])
def test_non_tensor_arguments(layer, inputs, bad):
    x, logits = inputs
    with pytest.raises(TypeError, match="hidden_states"):
        layer(bad, logits)
    with pytest.raises(TypeError, match="router_logits"):
        layer(x, bad)


def test_correction_bias_bad(gen, inputs):
    x, logits = inputs
    for bad, kind in [(randn(gen, E + 1), ValueError), (randn(gen, E, 1), ValueError),
                      (torch.arange(E), TypeError)]:
        layer = make_layer(expert_weights(gen, E, H, I), num_experts=E, top_k=K, hidden_size=H,
                           intermediate_size=I, scoring_func="sigmoid",
                           e_score_correction_bias=bad)
        with pytest.raises(kind, match="e_score_correction_bias"):
            layer(x, logits)


def test_custom_routing_out_of_range(gen, inputs):
    x, logits = inputs
    for bad_id in (E, -1, 1000):
        def custom(hidden_states, gating_output, topk, renormalize, bad_id=bad_id):
            w, ids = torch.topk(gating_output, topk, dim=-1)
            ids[M // 2, 0] = bad_id
            return torch.softmax(w, dim=-1), ids

        layer = make_layer(expert_weights(gen, E, H, I), num_experts=E, top_k=K, hidden_size=H,
                           intermediate_size=I, custom_routing_function=custom)
        with pytest.raises(ValueError, match="custom_routing_function|topk_ids"):
            layer(x, logits)
        with pytest.raises(ValueError, match="custom_routing_function|topk_ids"):
            FusedMoE.select_experts(x, logits, K, False, True, custom_routing_function=custom)


def test_select_experts_errors(inputs):
    x, logits = inputs
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE.select_experts(x, logits, E + 1, False, True)
    with pytest.raises(ValueError, match="num_expert_group|topk_group"):
        FusedMoE.select_experts(x, logits, K, True, True)
    with pytest.raises(ValueError, match="num_expert_group"):
        FusedMoE.select_experts(x, logits, K, True, True, topk_group=1, num_expert_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        moe_ext.grouped_topk(x, logits, K, True, num_expert_group=7, topk_group=8)
    with pytest.raises(ValueError, match="scoring_func"):
        FusedMoE.select_experts(x, logits, K, False, True, scoring_func="tanh")
    with pytest.raises(TypeError, match="router_logits|gating_output"):
        moe_ext.fused_topk(x, logits.to(torch.int32), K, True)


def test_fused_experts_errors(gen, inputs):
    x, logits = inputs
    w = expert_weights(gen, E, H, I)
    w1, w2 = w["w13_weight"], w["w2_weight"]
    tw, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    ids = ids.to(torch.int32)
    with pytest.raises(TypeError, match="w13|w1|hidden_states"):
        moe_ext.fused_experts(x, w1.to(torch.bfloat16), w2, tw, ids)
    with pytest.raises(ValueError, match="w2|w13|w1"):
        moe_ext.fused_experts(x, w1, w2[:, :-1], tw, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_ext.fused_experts(x, w1, w2, tw, ids[:-1])
    with pytest.raises(ValueError, match="topk_weights"):
        moe_ext.fused_experts(x, w1, w2, tw[:, :1], ids)
    with pytest.raises(ValueError, match="hidden_states"):
        moe_ext.fused_experts(randn(gen, M, 2 * H)[:, ::2], w1, w2, tw, ids)
    with pytest.raises(ValueError, match="activation"):
        moe_ext.fused_experts(x, w1, w2, tw, ids, activation="tanh")


@pytest.mark.parametrize("name", ["w1_scale", "w2_scale", "a1_scale", "a2_scale", "block_shape"])
def test_fused_experts_quantization_args_not_implemented(name, gen, inputs):
    x, logits = inputs
    w = expert_weights(gen, E, H, I)
    tw, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    value = [128, 128] if name == "block_shape" else torch.ones(E)
    with pytest.raises(NotImplementedError, match=name):
        moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], tw, ids.to(torch.int32),
                              **{name: value})


@pytest.mark.parametrize("bad_id", [E, -1, 2 ** 31 - 1])
def test_fused_experts_out_of_range_ids_cpu(gen, inputs, bad_id):
    """abi.h: the CPU engine returns MX_ERR_VALUE naming the first out-of-range id."""
    x, logits = inputs
    w = expert_weights(gen, E, H, I)
    tw, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    ids = ids.to(torch.int32)
    ids[M - 1, 1] = bad_id
    with pytest.raises(ValueError, match=str(bad_id)):
        moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], tw, ids)


# ---------------------------------------------------------------- NaN / Inf

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_non_finite_hidden_row(poison, dtype, gen):
    m = 9
    layer = make_layer(expert_weights(gen, E, H, I, dtype=dtype), num_experts=E, top_k=K,
                       hidden_size=H, intermediate_size=I, params_dtype=dtype)
    x = randn(gen, m, H, dtype=dtype)
    logits = randn(gen, m, E, dtype=dtype)
    x[4, 3] = poison
    out = layer(x, logits)
    bad = torch.zeros(m, dtype=torch.bool)
    bad[4] = True
    assert torch.isfinite(out[~bad]).all(), "a non-finite input row leaked into other rows"
    if poison != poison:  # NaN
        assert torch.isnan(out[4]).all()
    else:
        assert not torch.isfinite(out[4]).any()


def test_nan_router_logits_row(gen):
    m = 9
    layer = make_layer(expert_weights(gen, E, H, I), num_experts=E, top_k=K, hidden_size=H,
                       intermediate_size=I)
    x, logits = randn(gen, m, H), randn(gen, m, E)
    logits[6, 2] = float("nan")
    out = layer(x, logits)
    keep = torch.arange(m) != 6
    assert torch.isfinite(out[keep]).all()
    assert torch.isnan(out[6]).all()
    w, ids = FusedMoE.select_experts(x, logits, K, False, True)
    assert ((ids >= 0) & (ids < E)).all(), "NaN scores must still give valid expert ids"
    assert torch.isfinite(w[keep]).all()


# ---------------------------------------------------------------- weight_loader

@pytest.mark.parametrize("shard_id", ["w4", "w13", "", None, 1])
def test_weight_loader_bad_shard_id(layer, gen, shard_id):
    before = snapshot(layer)
    with pytest.raises(ValueError, match="shard_id|w1"):
        layer.weight_loader(layer.w13_weight, randn(gen, I, H), "experts.w13_weight",
                            shard_id=shard_id, expert_id=0)
    assert_unchanged(layer, before)


WRONG_SHAPES = [
    ("w13_weight", "w1", (I, H + 1)),
    ("w13_weight", "w3", (I, H - 1)),
    ("w13_weight", "w1", (I - 1, H)),
    ("w13_weight", "w3", (I * H,)),
    ("w13_weight", "w1", (I, H, 1)),
    ("w2_weight", "w2", (H + 1, I)),
    ("w2_weight", "w2", (H, I - 1)),
    ("w2_weight", "w2", (E + 1, H, I)),
    ("w13_weight", "w1", (E - 1, I, H + 2)),
    ("w13_bias", "w1", (I - 1,)),
    ("w13_bias", "w3", (I, 2)),
    ("w2_bias", "w2", (H + 1,)),
]


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("pname,shard,shape", WRONG_SHAPES,
                         ids=[f"{p}-{s}-{'x'.join(map(str, sh))}" for p, s, sh in WRONG_SHAPES])
def test_weight_loader_wrong_shape(pname, shard, shape, activation, gen):
    layer = make_layer(expert_weights(gen, E, H, I, has_bias=True), num_experts=E, top_k=K,
                       hidden_size=H, intermediate_size=I, has_bias=True, activation=activation)
    param = getattr(layer, pname)
    before = snapshot(layer)
    with pytest.raises(ValueError) as info:
        layer.weight_loader(param, randn(gen, *shape), f"experts.{pname}", shard_id=shard,
                            expert_id=3)
    assert_unchanged(layer, before)
    message = str(info.value)
    assert "loaded_weight" in message or pname in message, message


def test_weight_loader_unknown_name(layer, gen):
    before = snapshot(layer)
    for name in ("model.layers.0.mlp.experts.w13_qux", "experts.w2_gamma"):
        with pytest.raises(ValueError, match="qux|gamma|weight_name"):
            layer.weight_loader(layer.w13_weight, randn(gen, I, H), name, shard_id="w1",
                                expert_id=0)
    assert_unchanged(layer, before)


def test_weight_loader_bad_arguments(layer, gen):
    before = snapshot(layer)
    with pytest.raises(TypeError, match="loaded_weight"):
        layer.weight_loader(layer.w13_weight, [[0.5] * H] * I, "experts.w13_weight",
                            shard_id="w1", expert_id=0)
    with pytest.raises((ValueError, IndexError), match="expert_id"):
        layer.weight_loader(layer.w13_weight, randn(gen, I, H), "experts.w13_weight",
                            shard_id="w1", expert_id=E)
    assert_unchanged(layer, before)


def test_weight_loader_meta_loaded_weight(layer, gen):
    before = snapshot(layer)
    with pytest.raises((ValueError, TypeError), match="loaded_weight"):
        layer.weight_loader(layer.w13_weight, randn(gen, I, H).to("meta"),
                            "experts.w13_weight", shard_id="w1", expert_id=0)
    assert_unchanged(layer, before)


def test_weight_loader_w3_in_non_gated_layer(gen):
    layer = FusedMoE(E, K, H, I, activation="relu2", is_act_and_mul=False)
    with pytest.raises(ValueError, match="w3|shard_id"):
        layer.weight_loader(layer.w13_weight, randn(gen, I, H), "experts.w13_weight",
                            shard_id="w3", expert_id=0)


# ---------------------------------------------------------------- constructor

BAD_CONFIGS = [
    ("intermediate_size", dict(intermediate_size=45, tp_size=2)),
    ("activation", dict(activation="tanh")),
    ("activation", dict(activation="relu2")),  # non-gated only
    ("activation", dict(activation="swigluoai", is_act_and_mul=False)),
    ("scoring_func", dict(scoring_func="tanh")),
    ("num_expert_group|topk_group", dict(use_grouped_topk=True)),
    ("num_expert_group|topk_group", dict(use_grouped_topk=True, num_expert_group=4)),
    ("num_expert_group", dict(use_grouped_topk=True, num_expert_group=3, topk_group=1)),
    ("topk_group", dict(use_grouped_topk=True, num_expert_group=4, topk_group=5)),
    ("top_k", dict(top_k=9)),
    ("top_k", dict(top_k=0)),
    ("num_experts", dict(num_experts=0)),
    ("hidden_size", dict(hidden_size=0)),
    ("apply_router_weight_on_input", dict(apply_router_weight_on_input=True)),
    ("tp_rank", dict(tp_size=2, tp_rank=2)),
    ("ep_rank", dict(ep_size=3, ep_rank=3)),
    ("expert_placement_strategy", dict(ep_size=2, expert_placement_strategy="random")),
]


@pytest.mark.parametrize("match,kw", BAD_CONFIGS, ids=[f"{m.split('|')[0]}-{i}"
                                                         for i, (m, _) in enumerate(BAD_CONFIGS)])
def test_constructor_value_errors(match, kw):
    args = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=48)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        FusedMoE(**args)


UNSUPPORTED = [
    ("quant_config", dict(quant_config=object())),
    ("dp_size", dict(dp_size=2)),
    ("enable_eplb", dict(enable_eplb=True)),
    ("num_redundant_experts", dict(num_redundant_experts=1)),
    ("is_sequence_parallel", dict(is_sequence_parallel=True)),
    ("gate", dict(gate=torch.nn.Linear(64, 8))),
    ("routed_input_transform", dict(routed_input_transform=torch.nn.Identity())),
    ("pcp_size", dict(pcp_size=2)),
    ("reduce_results", dict(reduce_results=True, tp_size=2)),
]


@pytest.mark.parametrize("name,kw", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_constructor_not_implemented(name, kw):
    with pytest.raises(NotImplementedError, match=name):
        FusedMoE(num_experts=8, top_k=2, hidden_size=64, intermediate_size=48, **kw)


def test_defaults_of_unsupported_features_are_accepted():
    layer = FusedMoE(8, 2, 64, 48, quant_config=None, dp_size=1, pcp_size=1, enable_eplb=False,
                     num_redundant_experts=0, is_sequence_parallel=False, gate=None,
                     routed_input_transform=None)
    assert layer.local_num_experts == 8


def test_quantization_not_implemented():
    with pytest.raises(NotImplementedError, match="WNA16"):
        moe_ext.WNA16Config(bits=4, group_size=128, sym=True, desc_act=False)
    with pytest.raises(NotImplementedError, match="weight_block_size"):
        moe_ext.Fp8OnlineConfig(weight_block_size=[64, 64])


def test_determine_expert_map_errors():
    with pytest.raises(ValueError, match="ep_rank"):
        moe_ext.determine_expert_map(2, 2, 8)
    with pytest.raises(ValueError, match="expert_placement_strategy"):
        moe_ext.determine_expert_map(2, 0, 8, "random")


@pytest.mark.gpu
def test_mixed_devices(gen):
    layer = make_layer(expert_weights(gen, E, H, I), num_experts=E, top_k=K, hidden_size=H,
                       intermediate_size=I)
    x, logits = randn(gen, M, H), randn(gen, M, E)
    with pytest.raises(ValueError, match="device|w13|hidden_states"):
        layer(x.cuda(), logits.cuda())
    cuda_layer = make_layer(expert_weights(gen, E, H, I, device="cuda"), num_experts=E, top_k=K,
                            hidden_size=H, intermediate_size=I, device="cuda")
    with pytest.raises(ValueError, match="router_logits|device"):
        cuda_layer(x.cuda(), logits)
