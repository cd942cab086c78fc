"""Online FP8 loading (seeds 000 and 002, api.md "Quantization configs and methods"): meta
parameters, quantization while loading vLLM-style checkpoints, in-place reload (RL weight
updates), the errors, and on CUDA the loading peak memory and CUDA graphs across a reload."""
import gc
import random

import pytest
import torch

import moe_ext
from moe_ext import Fp8OnlineConfig, FusedMoE, packing
from helpers import capture_forward, randn
import reference as ref
from test_fp8 import (E, FP8, FP8_TOL, H, I, K, METHODS, assert_bits_equal, assert_scales_equal,
                      compare, fp8_model, fp8_reference, u8)
from test_loading import STYLES, checkpoint, vllm_load

SCALES = {"tensor": ("w13_weight_scale", "w2_weight_scale"),
          "block": ("w13_weight_scale_inv", "w2_weight_scale_inv")}
METHOD_TYPES = {"tensor": moe_ext.Fp8PerTensorOnlineMoEMethod,
                "block": moe_ext.Fp8PerBlockOnlineMoEMethod}


def cdiv(a, b):
    return -(-a // b)


def expected_fp8(t, method, interleaved=False, gated=True, tp_size=1, tp_rank=0, ids=None,
                 dtype=torch.bfloat16):
    """(q13, s13, q2, s2): moe_ext's own quantizer applied per expert to this rank's
    full-precision w13 (gate rows then up rows, or interleaved) and w2 in the layer dtype."""
    it = I // tp_size
    sl = slice(tp_rank * it, (tp_rank + 1) * it)
    w13 = ref.gated_w13(t["w1"][:, sl], t["w3"][:, sl], interleaved) if gated else t["w1"][:, sl]
    w2 = t["w2"][:, :, sl]
    if ids is not None:
        w13, w2 = w13[ids], w2[ids]
    out = []
    for w in (w13, w2):
        qs = [moe_ext.scaled_fp8_quant(e.to(dtype)) if method == "tensor"
              else moe_ext.per_block_cast_to_fp8(e.to(dtype)) for e in w]
        q = torch.stack([q for q, _ in qs])
        s = torch.cat([s for _, s in qs]) if method == "tensor" else torch.stack([s for _, s in qs])
        out += [q, s]
    return out


def check_quantized(layer, method, expected):
    q13, s13, q2, s2 = expected
    n13, n2 = SCALES[method]
    assert layer.w13_weight.dtype == FP8 and layer.w2_weight.dtype == FP8
    assert tuple(layer.w13_weight.shape) == tuple(q13.shape)
    assert tuple(layer.w2_weight.shape) == tuple(q2.shape)
    assert_scales_equal(getattr(layer, n13), s13, n13)
    assert_scales_equal(getattr(layer, n2), s2, n2)
    assert_bits_equal(layer.w13_weight, q13, "w13_weight")
    assert_bits_equal(layer.w2_weight, q2, "w2_weight")


def snapshot(layer):
    """{name: (param object, data_ptr, raw bytes)} of every parameter."""
    return {n: (p, p.data_ptr(), u8(p)) for n, p in layer.named_parameters()}


def assert_unchanged(layer, before, what):
    now = dict(layer.named_parameters())
    assert now.keys() == before.keys(), f"{what}: parameters {sorted(now)} != {sorted(before)}"
    for n, (p, ptr, raw) in before.items():
        assert now[n] is p, f"{what}: {n} is a new parameter object"
        assert p.data_ptr() == ptr, f"{what}: {n} was reallocated"
        assert torch.equal(u8(p), raw), f"{what}: {n} changed"


def param_name(shard):
    """The mapped checkpoint name vLLM passes for a shard (as make_expert_params_mapping does)."""
    return "experts.w2_weight" if shard == "w2" else "experts.w13_weight"


def load_expert(layer, t, expert, shards=("w1", "w3", "w2"), overrides=None):
    """Loads one expert's checkpoint tensors through the parameters' weight_loader."""
    overrides = overrides or {}
    for shard in shards:
        param = layer.w2_weight if shard == "w2" else layer.w13_weight
        weight = overrides.get(shard, t[shard][expert])
        param.weight_loader(param, weight, param_name(shard), shard_id=shard, expert_id=expert)


def loaded(style, method, gen, device="cpu", ckpt_dtype=torch.bfloat16, **kw):
    model, layer = fp8_model(style, method, device, **kw)
    ckpt, t = checkpoint(gen, style, e=E, h=H, i=I, dtype=ckpt_dtype,
                         has_bias=kw.get("has_bias", False),
                         gated=kw.get("is_act_and_mul", True))
    vllm_load(model, ckpt, style)
    return model, layer, ckpt, t


def forward_check(layer, gen, activation="silu", gated=True, m=33):
    device = layer.w13_weight.device
    x = randn(gen, m, H, dtype=torch.bfloat16, device=device)
    logits = randn(gen, m, E, device=device, scale=2.0)
    out = layer(x, logits)
    want, margin = fp8_reference(layer, x, logits, activation, gated)
    compare(out, want, margin, FP8_TOL, "fp8 forward")
    return x, logits, out


# ================================================================ construction

@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("method", list(METHODS))
def test_method_types_and_meta_parameters(method, has_bias, device):
    if device == "cuda":
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, has_bias=has_bias,
                     quant_config=Fp8OnlineConfig(METHODS[method]), device=device)
    qm = layer.quant_method
    assert type(qm) is METHOD_TYPES[method]
    assert isinstance(qm, getattr(moe_ext, METHOD_TYPES[method].__name__))
    assert qm.uses_meta_device is True and qm.supports_eplb is True
    assert qm.weight_block_size == METHODS[method]
    assert layer.weight_block_size == METHODS[method]
    params = dict(layer.named_parameters())
    assert {"w13_weight", "w2_weight"} <= params.keys()
    assert ("w13_bias" in params) == ("w2_bias" in params) == has_bias
    for name, p in params.items():
        assert p.is_meta, f"{name} is materialized before any write ({p.device})"
        assert not p.requires_grad and callable(getattr(p, "weight_loader", None)), name
    # before loading, the weights have the full-precision shapes and dtype (seed 000)
    assert tuple(layer.w13_weight.shape) == (E, 2 * I, H)
    assert tuple(layer.w2_weight.shape) == (E, H, I)
    assert layer.w13_weight.dtype == layer.w2_weight.dtype == torch.bfloat16
    if has_bias:
        assert tuple(layer.w13_bias.shape) == (E, 2 * I)
        assert tuple(layer.w2_bias.shape) == (E, H)
    if device == "cuda":
        torch.cuda.synchronize()
        # <=: tensors of earlier tests may be freed meanwhile; nothing may be added
        assert torch.cuda.memory_allocated() <= allocated, "construction allocated GPU memory"


def test_quant_config_methods_for_other_layers():
    cfg = Fp8OnlineConfig()
    assert cfg.weight_block_size is None
    assert Fp8OnlineConfig([128, 128]).weight_block_size == [128, 128]
    assert Fp8OnlineConfig((128, 128)).weight_block_size == [128, 128]
    lin = moe_ext.Linear(64, 32, params_dtype=torch.bfloat16, quant_config=cfg)
    assert type(lin.quant_method) is moe_ext.Fp8PerTensorOnlineLinearMethod
    assert cfg.get_quant_method(torch.nn.Linear(4, 4), "x") is None


# ================================================================ loading checkpoints

LOAD_CONFIGS = [
    ("silu", dict(activation="silu"), False),
    ("swigluoai-bias", dict(activation="swigluoai", has_bias=True), True),
    ("relu2-nogate-bias", dict(activation="relu2", is_act_and_mul=False, has_bias=True), False),
    ("silu-tp2-rank1", dict(activation="silu", tp_size=2, tp_rank=1), False),
]


@pytest.mark.parametrize("cfg", LOAD_CONFIGS, ids=[c[0] for c in LOAD_CONFIGS])
@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("method", list(METHODS))
def test_load_checkpoint(method, style, cfg, device, gen):
    name, kw, interleaved = cfg
    gated = kw.get("is_act_and_mul", True)
    tp_size, tp_rank = kw.get("tp_size", 1), kw.get("tp_rank", 0)
    it = I // tp_size
    model, layer = fp8_model(style, method, device, **kw)
    params_before = dict(layer.named_parameters())
    ckpt, t = checkpoint(gen, style, e=E, h=H, i=I, has_bias=kw.get("has_bias", False),
                         gated=gated, dtype=torch.bfloat16)
    vllm_load(model, ckpt, style)
    # vLLM model code looks parameters up once, before loading: the objects must stay valid
    params = dict(layer.named_parameters())
    for n, p in params_before.items():
        assert params[n] is p, f"{n} was replaced while loading"
    rows = (2 if gated else 1) * it
    n13, n2 = SCALES[method]
    want_shapes = {"w13_weight": (E, rows, H), "w2_weight": (E, H, it)}
    if method == "tensor":
        want_shapes.update({n13: (E,), n2: (E,)})
    else:
        want_shapes.update({n13: (E, cdiv(rows, 128), cdiv(H, 128)),
                            n2: (E, cdiv(H, 128), cdiv(it, 128))})
    if kw.get("has_bias"):
        want_shapes.update(w13_bias=(E, rows), w2_bias=(E, H))
    assert {n: tuple(p.shape) for n, p in params.items()} == want_shapes
    for n, p in params.items():
        assert p.device.type == device and not p.is_meta, f"{n} on {p.device}"
        assert not p.requires_grad and isinstance(p, torch.nn.Parameter), n
    assert getattr(layer, n13).dtype == getattr(layer, n2).dtype == torch.float32
    check_quantized(layer, method, expected_fp8(t, method, interleaved, gated, tp_size, tp_rank))
    if kw.get("has_bias"):
        sl = slice(tp_rank * it, (tp_rank + 1) * it)
        b13 = ref.gated_w13(t["b1"][:, sl], t["b3"][:, sl], interleaved) if gated \
            else t["b1"][:, sl]
        assert layer.w13_bias.dtype == layer.w2_bias.dtype == torch.bfloat16, "biases stay bf16"
        assert torch.equal(layer.w13_bias.cpu(), b13)
        assert torch.equal(layer.w2_bias.cpu(), t["b2"] if tp_rank == 0
                           else torch.zeros_like(t["b2"]))
    state = layer.state_dict()
    assert state["w13_weight"].dtype == FP8 and n13 in state and n2 in state
    # process_weights_after_loading again: a no-op
    before = snapshot(layer)
    layer.process_weights_after_loading()
    layer.process_weights_after_loading()
    assert_unchanged(layer, before, "process_weights_after_loading")
    forward_check(layer, gen, kw["activation"], gated)


@pytest.mark.parametrize("method", list(METHODS))
def test_get_fused_moe_quant_config(method, gen):
    _, layer, _, _ = loaded("qwen", method, gen)
    cfg = layer.quant_method.get_fused_moe_quant_config(layer)
    assert cfg is not None
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    n13, n2 = SCALES[method]
    assert get("w1_scale") is getattr(layer, n13) and get("w2_scale") is getattr(layer, n2)
    assert get("block_shape") == METHODS[method]


@pytest.mark.parametrize("method", list(METHODS))
def test_load_float32_checkpoint_quantizes_the_bf16_weights(method, gen):
    """A float32 checkpoint is materialized in params_dtype first (bf16), then quantized."""
    _, layer, _, t = loaded("mixtral", method, gen, ckpt_dtype=torch.float32)
    check_quantized(layer, method, expected_fp8(t, method, dtype=torch.bfloat16))


@pytest.mark.parametrize("method", list(METHODS))
def test_load_order_does_not_matter(method, gen):
    model, layer = fp8_model("qwen", method)
    ckpt, t = checkpoint(gen, "qwen", e=E, h=H, i=I, dtype=torch.bfloat16)
    items = list(ckpt.items())
    random.Random(1234).shuffle(items)  # experts' shards interleaved: several partial at once
    vllm_load(model, dict(items), "qwen")
    check_quantized(layer, method, expected_fp8(t, method))
    forward_check(layer, gen)


@pytest.mark.parametrize("method", list(METHODS))
def test_partial_load_materializes_but_is_not_ready(method, gen):
    """The first write materializes FP8 storage on the target device; the layer stays not ready
    until every expert's w1, w3 and w2 arrived, and an expert is quantized once it is complete."""
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16,
                     quant_config=Fp8OnlineConfig(METHODS[method]))
    _, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, dtype=torch.bfloat16)
    load_expert(layer, t, 3, ("w1",))
    assert not layer.w13_weight.is_meta and layer.w13_weight.dtype == FP8
    for e in range(E):
        if e != 3:
            load_expert(layer, t, e)
    load_expert(layer, t, 3, ("w2",))
    with pytest.raises(RuntimeError):
        layer(randn(gen, 4, H, dtype=torch.bfloat16), randn(gen, 4, E))
    load_expert(layer, t, 3, ("w3",))
    layer.process_weights_after_loading()
    check_quantized(layer, method, expected_fp8(t, method))


@pytest.mark.parametrize("method", list(METHODS))
def test_load_weights_with_expert_mapping(method, gen):
    path, gate, down, up = STYLES["qwen"]
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name=gate,
                                                  ckpt_down_proj_name=down,
                                                  ckpt_up_proj_name=up, num_experts=E)
    layer = FusedMoE(E, K, H, I, prefix=path, expert_mapping=mapping,
                     params_dtype=torch.bfloat16, quant_config=Fp8OnlineConfig(METHODS[method]))
    ckpt, t = checkpoint(gen, "qwen", e=E, h=H, i=I, dtype=torch.bfloat16)
    names = [(n.removeprefix(path + "."), w) for n, w in ckpt.items()]
    loaded_names = list(layer.load_weights(names))
    assert loaded_names == [{gate: "w13_weight", up: "w13_weight", down: "w2_weight"}[
        n.split(".")[1]] for n, _ in names]
    layer.process_weights_after_loading()
    check_quantized(layer, method, expected_fp8(t, method))


@pytest.mark.parametrize("placement", [dict(), dict(tp_size=2, tp_rank=1),
                                       dict(ep_size=2, ep_rank=1)], ids=["full", "tp", "ep"])
@pytest.mark.parametrize("method", list(METHODS))
def test_full_3d_load(method, placement, device, gen):
    """3-D tensors [E, ...] load all experts at once (narrowed / selected for this rank)."""
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, device=device,
                     quant_config=Fp8OnlineConfig(METHODS[method]), **placement)
    _, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, dtype=torch.bfloat16)
    for shard in ("w1", "w3", "w2"):
        param = layer.w2_weight if shard == "w2" else layer.w13_weight
        layer.weight_loader(param, t[shard], param_name(shard), shard_id=shard, expert_id=0)
    layer.process_weights_after_loading()
    ids = None
    if layer.expert_map is not None:
        ids = [g for g in range(E) if int(layer.expert_map[g]) >= 0]
    check_quantized(layer, method, expected_fp8(t, method, tp_size=placement.get("tp_size", 1),
                                                tp_rank=placement.get("tp_rank", 0), ids=ids))
    forward_check(layer, gen)


@pytest.mark.parametrize("method", list(METHODS))
def test_expert_parallel_non_local_experts_write_nothing(method, gen):
    model, layer = fp8_model("mixtral", method, ep_size=2, ep_rank=1)
    ckpt, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, dtype=torch.bfloat16)
    local = [g for g in range(E) if int(layer.expert_map[g]) >= 0]
    remote = [g for g in range(E) if g not in local]
    for g in remote:  # first writes to experts of the other rank: nothing happens
        for shard in ("w1", "w3", "w2"):
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            ok = param.weight_loader(param, t[shard][g], param_name(shard), shard_id=shard,
                                     expert_id=g, return_success=True)
            assert ok is False
    assert all(p.is_meta for p in layer.parameters()), "a non-local expert materialized the layer"
    mapping = FusedMoE.make_expert_params_mapping(model, "w1", "w2", "w3", E)
    params = dict(model.named_parameters())
    for name, w in ckpt.items():
        prefix, weight_name, expert_id, shard_id = next(
            entry for entry in mapping if entry[1] in name)
        mapped = name.replace(weight_name, prefix)
        ok = params[mapped].weight_loader(params[mapped], w, mapped, shard_id=shard_id,
                                          expert_id=expert_id, return_success=True)
        assert ok is (expert_id in local), (name, ok)
    layer.process_weights_after_loading()
    check_quantized(layer, method, expected_fp8(t, method, ids=local))


# ================================================================ reload (RL weight update)

@pytest.mark.parametrize("cfg", LOAD_CONFIGS[:2], ids=[c[0] for c in LOAD_CONFIGS[:2]])
@pytest.mark.parametrize("method", list(METHODS))
def test_reload_requantizes_in_place(method, cfg, device, gen):
    name, kw, interleaved = cfg
    model, layer, _, _ = loaded("mixtral", method, gen, device, **kw)
    x, logits, old_out = forward_check(layer, gen, kw["activation"])
    before = snapshot(layer)
    ckpt, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, has_bias=kw.get("has_bias", False),
                         dtype=torch.bfloat16)
    for key in ckpt:  # new weights, also of a different magnitude (scales must change)
        ckpt[key] = ckpt[key] * 3
    t = {k: v * 3 for k, v in t.items()}
    vllm_load(model, ckpt, "mixtral")
    for n, (p, ptr, raw) in before.items():
        assert getattr(layer, n) is p, f"{n}: reload replaced the parameter"
        assert p.data_ptr() == ptr, f"{n}: reload reallocated the storage"
        assert not torch.equal(u8(p), raw), f"{n}: reload did not change it"
    check_quantized(layer, method, expected_fp8(t, method, interleaved))
    if kw.get("has_bias"):
        assert torch.equal(layer.w13_bias.cpu(), ref.gated_w13(t["b1"], t["b3"], interleaved))
    out = layer(x, logits)
    want, margin = fp8_reference(layer, x, logits, kw["activation"])
    compare(out, want, margin, FP8_TOL, f"fp8 {method} after reload")
    assert not torch.equal(out, old_out)


@pytest.mark.parametrize("method", list(METHODS))
def test_reload_one_expert_changes_only_that_expert(method, gen):
    _, layer, _, t = loaded("qwen", method, gen)
    before = snapshot(layer)
    _, t_new = checkpoint(gen, "qwen", e=E, h=H, i=I, dtype=torch.bfloat16)
    load_expert(layer, t_new, 4)
    t_mix = {k: v.clone() for k, v in t.items()}
    for k in ("w1", "w2", "w3"):
        t_mix[k][4] = t_new[k][4]
    check_quantized(layer, method, expected_fp8(t_mix, method))
    for n, (p, ptr, _) in before.items():
        assert getattr(layer, n) is p and p.data_ptr() == ptr, n
    forward_check(layer, gen)


@pytest.mark.parametrize("method", list(METHODS))
def test_reload_3d(method, gen):
    _, layer, _, _ = loaded("mixtral", method, gen)
    before = snapshot(layer)
    _, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, dtype=torch.bfloat16)
    for shard in ("w2", "w3", "w1"):
        param = layer.w2_weight if shard == "w2" else layer.w13_weight
        param.weight_loader(param, t[shard], param_name(shard), shard_id=shard, expert_id=0)
    check_quantized(layer, method, expected_fp8(t, method))
    for n, (p, ptr, _) in before.items():
        assert getattr(layer, n) is p and p.data_ptr() == ptr, n


# ================================================================ errors

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("method", list(METHODS))
def test_non_finite_w2_raises_and_keeps_the_expert(method, bad, gen):
    _, layer, _, t = loaded("mixtral", method, gen)
    before = snapshot(layer)
    w2 = randn(gen, H, I, dtype=torch.bfloat16)
    w2[17, 5] = bad
    with pytest.raises(ValueError):
        load_expert(layer, t, 2, ("w2",), {"w2": w2})
    assert_unchanged(layer, before, "non-finite w2")
    forward_check(layer, gen)


@pytest.mark.parametrize("shard", ["w1", "w3"])
@pytest.mark.parametrize("method", list(METHODS))
def test_non_finite_w13_raises_and_keeps_the_expert(method, shard, gen):
    """A NaN in w1 or w3 raises ValueError by the time the expert's w13 is complete (the call
    passing it, or the one completing the pair), without writing anything; the expert then
    loads normally."""
    _, layer, _, t = loaded("mixtral", method, gen)
    before = snapshot(layer)
    bad = t[shard][2].clone()
    bad[7, 11] = float("nan")
    with pytest.raises(ValueError):
        load_expert(layer, t, 2, ("w1", "w3"), {shard: bad})
    assert_unchanged(layer, before, f"NaN in {shard}")
    _, t_new = checkpoint(gen, "mixtral", e=E, h=H, i=I, dtype=torch.bfloat16)
    load_expert(layer, t_new, 2, ("w1", "w3"))
    t_mix = {k: v.clone() for k, v in t.items()}
    t_mix["w1"][2], t_mix["w3"][2] = t_new["w1"][2], t_new["w3"][2]
    check_quantized(layer, method, expected_fp8(t_mix, method))


@pytest.mark.parametrize("method", list(METHODS))
def test_non_finite_weight_during_first_load(method, gen):
    model, layer = fp8_model("mixtral", method)
    _, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, dtype=torch.bfloat16)
    bad = t["w2"][0].clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError):
        load_expert(layer, t, 0, ("w2",), {"w2": bad})
    for e in range(E):
        load_expert(layer, t, e, ("w1", "w3") if e == 0 else ("w1", "w3", "w2"))
    with pytest.raises(RuntimeError):  # expert 0's w2 never arrived correctly
        layer.process_weights_after_loading()
    load_expert(layer, t, 0, ("w2",))
    layer.process_weights_after_loading()
    check_quantized(layer, method, expected_fp8(t, method))


WRONG_SHAPES = [("w1", (I, H + 1)), ("w1", (I - 1, H)), ("w3", (I, H - 1)), ("w2", (H - 1, I)),
                ("w2", (H, I - 1)), ("w1", (E + 1, I, H)), ("w2", (E, H + 1, I)), ("w2", (H,))]


@pytest.mark.parametrize("shard,shape", WRONG_SHAPES, ids=str)
@pytest.mark.parametrize("method", list(METHODS))
def test_wrong_shape_raises_and_writes_nothing(method, shard, shape, gen):
    _, layer, _, t = loaded("qwen", method, gen)
    before = snapshot(layer)
    param = layer.w2_weight if shard == "w2" else layer.w13_weight
    with pytest.raises(ValueError):
        param.weight_loader(param, randn(gen, *shape, dtype=torch.bfloat16), param_name(shard),
                            shard_id=shard, expert_id=1)
    if shard != "w2":  # complete the pair: the bad shard must not have been kept
        other = "w3" if shard == "w1" else "w1"
        load_expert(layer, t, 1, (other,))
    assert_unchanged(layer, before, f"wrong {shard} shape {shape}")


@pytest.mark.parametrize("method", list(METHODS))
def test_wrong_shape_on_a_fresh_layer(method, gen):
    model, layer = fp8_model("qwen", method)
    ckpt, t = checkpoint(gen, "qwen", e=E, h=H, i=I, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        layer.weight_loader(layer.w2_weight, randn(gen, H - 1, I, dtype=torch.bfloat16),
                            "experts.w2_weight", shard_id="w2", expert_id=0)
    with pytest.raises(RuntimeError):
        layer.process_weights_after_loading()
    vllm_load(model, ckpt, "qwen")
    check_quantized(layer, method, expected_fp8(t, method))


@pytest.mark.parametrize("method", list(METHODS))
def test_checkpoint_scales_are_rejected(method, gen):
    """An online layer computes its own scales: loading one from a checkpoint is an error."""
    _, layer, _, _ = loaded("qwen", method, gen)
    before = snapshot(layer)
    for name, shard in zip(SCALES[method], ("w1", "w2")):
        param = getattr(layer, name)
        value = torch.rand(param.shape[1:], generator=gen) + 0.5
        with pytest.raises(ValueError):
            param.weight_loader(param, value, f"experts.{name}", shard_id=shard, expert_id=1)
    assert_unchanged(layer, before, "checkpoint scale")


@pytest.mark.parametrize("method", list(METHODS))
def test_not_ready_until_every_expert_arrived(method, gen):
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, prefix="model.layers.2.experts",
                     quant_config=Fp8OnlineConfig(METHODS[method]))
    x, logits = randn(gen, 5, H, dtype=torch.bfloat16), randn(gen, 5, E)
    with pytest.raises(RuntimeError):  # nothing loaded
        layer(x, logits)
    with pytest.raises(RuntimeError):
        layer.process_weights_after_loading()
    _, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, dtype=torch.bfloat16)
    for e in range(E):
        load_expert(layer, t, e, ("w1", "w3") if e == 5 else ("w1", "w3", "w2"))
    with pytest.raises(RuntimeError):
        layer(x, logits)
    weights, ids = FusedMoE.select_experts(x, logits, K, False, True)
    with pytest.raises(RuntimeError):
        layer.quant_method.apply(layer, x, weights, ids)
    with pytest.raises(RuntimeError, match=r"5\D.*w2|w2.*\D5\b"):
        layer.process_weights_after_loading()
    load_expert(layer, t, 5, ("w2",))
    layer.process_weights_after_loading()
    assert layer(x, logits).shape == (5, H)


def test_missing_w3_is_named(gen):
    layer = FusedMoE(E, K, H, I, params_dtype=torch.bfloat16, quant_config=Fp8OnlineConfig())
    _, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, dtype=torch.bfloat16)
    for e in range(E):
        load_expert(layer, t, e, ("w1", "w2") if e == 2 else ("w1", "w3", "w2"))
    with pytest.raises(RuntimeError, match=r"\b2\b"):
        layer.process_weights_after_loading()


@pytest.mark.parametrize("method", list(METHODS))
def test_float32_params_dtype_is_rejected(method):
    with pytest.raises(TypeError):
        FusedMoE(E, K, H, I, params_dtype=torch.float32,
                 quant_config=Fp8OnlineConfig(METHODS[method]))
    with pytest.raises(TypeError):
        moe_ext.Linear(H, I, params_dtype=torch.float32,
                       quant_config=Fp8OnlineConfig(METHODS[method]))


@pytest.mark.parametrize("block", [[64, 64], [128, 64], [256, 256]], ids=str)
def test_unsupported_block_size(block):
    with pytest.raises(NotImplementedError):
        Fp8OnlineConfig(weight_block_size=block)


def test_wna16_not_implemented():
    with pytest.raises(NotImplementedError):
        FusedMoE(E, K, 256, 256, params_dtype=torch.bfloat16, quant_config=moe_ext.WNA16Config())


# ================================================================ CUDA

@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not moe_ext.cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", list(METHODS))
def test_loading_peak_memory_mixtral_size(method):
    e, h, i = 8, 4096, 14336
    gen = torch.Generator().manual_seed(7)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer = FusedMoE(e, 2, h, i, params_dtype=torch.bfloat16, device="cuda",
                     quant_config=Fp8OnlineConfig(METHODS[method]))
    last = {}
    for expert in range(e):
        for shard, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            w = (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, w, param_name(shard), shard_id=shard, expert_id=expert)
            if expert == e - 1:
                last[shard] = w
            del w
    layer.process_weights_after_loading()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    final = sum(p.numel() * p.element_size() for p in layer.parameters())
    fp8_bytes = e * 3 * h * i
    assert fp8_bytes <= final < fp8_bytes + 64 * 2 ** 20
    bound = final + 3 * h * i * 2 + 64 * 2 ** 20
    print(f"peak loading memory ({method}): {peak / 2 ** 20:.0f} MiB; final FP8 layer "
          f"{final / 2 ** 20:.0f} MiB; bound {bound / 2 ** 20:.0f} MiB")
    assert peak <= bound, f"peak {peak / 2 ** 20:.0f} MiB > bound {bound / 2 ** 20:.0f} MiB"
    q2, s2 = (moe_ext.scaled_fp8_quant(last["w2"].cuda()) if method == "tensor"
              else moe_ext.per_block_cast_to_fp8(last["w2"].cuda()))
    w2 = packing.row_major(layer, "w2_weight")
    assert_bits_equal(w2[e - 1], q2, "last expert's w2")
    n2 = SCALES[method][1]
    assert_scales_equal(getattr(layer, n2)[e - 1].reshape(s2.shape), s2, n2)


@pytest.mark.gpu
@pytest.mark.skipif(not moe_ext.cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", list(METHODS))
def test_reload_keeps_a_captured_cuda_graph_valid(method, gen):
    model, layer, _, _ = loaded("mixtral", method, gen, "cuda", has_bias=True,
                                activation="swigluoai")
    m = 33
    static_x = randn(gen, m, H, dtype=torch.bfloat16, device="cuda")
    static_logits = randn(gen, m, E, device="cuda", scale=2.0)
    graph, static_out = capture_forward(layer, static_x, static_logits, warmup=2)
    graph.replay()
    torch.cuda.synchronize()
    old = static_out.clone()
    ckpt, t = checkpoint(gen, "mixtral", e=E, h=H, i=I, has_bias=True, dtype=torch.bfloat16)
    vllm_load(model, ckpt, "mixtral")  # RL weight update from CPU tensors
    check_quantized(layer, method, expected_fp8(t, method, interleaved=True))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(static_out, old), "replay after reload still gives the old output"
    want, margin = fp8_reference(layer, static_x, static_logits, "swigluoai")
    compare(static_out, want, margin, FP8_TOL, f"fp8 {method} graph replay after reload")
    assert torch.equal(static_out, layer(static_x, static_logits))
