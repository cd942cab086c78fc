"""Checkpoint loading as vLLM model code drives it, TP/EP sharding, layer metadata."""
import pytest
import torch

import moe_ext
from moe_ext import FusedMoE
from helpers import keep_rows, randn
import reference as ref

E, K, H, I, M = 7, 2, 67, 44, 33

STYLES = {
    # style: (module path of the layer, gate, down, up checkpoint names)
    "mixtral": ("model.layers.0.block_sparse_moe.experts", "w1", "w2", "w3"),
    "qwen": ("model.layers.0.mlp.experts", "gate_proj", "down_proj", "up_proj"),
}


class Block(torch.nn.Module):
    """A model's MoE block: owns self.experts, as vLLM model code does."""

    def __init__(self, **kwargs):
        super().__init__()
        self.experts = FusedMoE(**kwargs)

    def forward(self, x, logits):
        return self.experts(hidden_states=x, router_logits=logits)


def build_model(style, **kwargs):
    """A tiny nn.Module tree whose named_parameters() match the checkpoint's module path."""
    path = STYLES[style][0]
    *parents, block_name, _ = path.split(".")  # model, layers, 0 / mlp / experts
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    block = Block(prefix=path, **kwargs)
    setattr(root.model.layers[0], block_name, block)
    return root, block.experts


def checkpoint(gen, style, e=E, h=H, i=I, has_bias=False, gated=True, dtype=torch.float32):
    """Per-expert unsharded tensors as a HF checkpoint holds them, plus their stacked forms."""
    path, gate, down, up = STYLES[style]
    t = {"w1": randn(gen, e, i, h, dtype=dtype, scale=h ** -0.5),
         "w2": randn(gen, e, h, i, dtype=dtype, scale=i ** -0.5)}
    if gated:
        t["w3"] = randn(gen, e, i, h, dtype=dtype, scale=h ** -0.5)
    if has_bias:
        t["b1"] = randn(gen, e, i, dtype=dtype, scale=0.5)
        t["b2"] = randn(gen, e, h, dtype=dtype, scale=0.5)
        if gated:
            t["b3"] = randn(gen, e, i, dtype=dtype, scale=0.5)
    ckpt = {}
    for x in range(e):
        ckpt[f"{path}.{x}.{gate}.weight"] = t["w1"][x].clone()
        ckpt[f"{path}.{x}.{down}.weight"] = t["w2"][x].clone()
        if gated:
            ckpt[f"{path}.{x}.{up}.weight"] = t["w3"][x].clone()
        if has_bias:
            ckpt[f"{path}.{x}.{gate}.bias"] = t["b1"][x].clone()
            ckpt[f"{path}.{x}.{down}.bias"] = t["b2"][x].clone()
            if gated:
                ckpt[f"{path}.{x}.{up}.bias"] = t["b3"][x].clone()
    return ckpt, t


def vllm_load(model, ckpt, style, num_experts=E, return_success=False):
    """The loop of a vLLM model's load_weights; returns the weight_loader results per name."""
    _, gate, down, up = STYLES[style]
    mapping = FusedMoE.make_expert_params_mapping(
        model, ckpt_gate_proj_name=gate, ckpt_down_proj_name=down, ckpt_up_proj_name=up,
        num_experts=num_experts)
    params = dict(model.named_parameters())
    results = {}
    for name, loaded_weight in ckpt.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            mapped = name.replace(weight_name, param_name)
            param = params[mapped]
            if return_success:
                ok = param.weight_loader(param, loaded_weight, mapped, shard_id=shard_id,
                                         expert_id=expert_id, return_success=True)
                results[name] = ok
                if ok:
                    break
            else:
                param.weight_loader(param, loaded_weight, mapped, shard_id=shard_id,
                                    expert_id=expert_id)
                results[name] = None
                break
        else:
            raise AssertionError(f"no mapping entry matched {name}")
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return results


def reference_w(t, interleaved=False, gated=True):
    w13 = ref.gated_w13(t["w1"], t["w3"], interleaved) if gated else t["w1"]
    b13 = None
    if "b1" in t:
        b13 = ref.gated_w13(t["b1"], t["b3"], interleaved) if gated else t["b1"]
    return w13, t["w2"], b13, t.get("b2")


def check_forward(layer, t, gen, activation="silu", interleaved=False, gated=True, tol=1e-5):
    x = randn(gen, M, H, dtype=layer.w13_weight.dtype, device=layer.w13_weight.device)
    logits = randn(gen, M, layer.global_num_experts, device=x.device, scale=2.0)
    out = layer(x, logits)
    w13, w2, b13, b2 = reference_w(t, interleaved, gated)
    want, margin = ref.moe(x, logits, w13, w2, layer.top_k, activation=activation,
                           is_act_and_mul=gated, w13_bias=b13, w2_bias=b2,
                           act_dtype=x.dtype)
    keep = keep_rows(margin)
    err = ref.rel_err(out.cpu()[keep], want.cpu()[keep])
    assert err <= tol, f"rel_err {err:.3g}"
    return x, logits, out


def bits(t):
    """The raw bits of a tensor (NaN-safe bit-for-bit comparison)."""
    size = t.element_size()
    return t.detach().contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8,
                                         8: torch.int64}[size]).clone()


# ---------------------------------------------------------------- per-expert checkpoints

@pytest.mark.parametrize("num_experts", [E, 12])  # 12: "experts.1." is a prefix of "experts.11."
@pytest.mark.parametrize("return_success", [False, True])
@pytest.mark.parametrize("style", ["mixtral", "qwen"])
def test_load_checkpoint_and_forward(style, return_success, num_experts, gen):
    model, layer = build_model(style, num_experts=num_experts, top_k=K, hidden_size=H,
                               intermediate_size=I)
    ckpt, t = checkpoint(gen, style, e=num_experts)
    results = vllm_load(model, ckpt, style, num_experts=num_experts,
                        return_success=return_success)
    if return_success:
        assert all(v is True for v in results.values())
    assert torch.equal(layer.w13_weight[:, :I], t["w1"])
    assert torch.equal(layer.w13_weight[:, I:], t["w3"])
    assert torch.equal(layer.w2_weight, t["w2"])
    check_forward(layer, t, gen)


@pytest.mark.parametrize("ckpt_dtype,layer_dtype", [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16), (torch.bfloat16, torch.float32)], ids=str)
def test_load_converts_dtype(ckpt_dtype, layer_dtype, gen):
    model, layer = build_model("qwen", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                               params_dtype=layer_dtype)
    ckpt, t = checkpoint(gen, "qwen", dtype=ckpt_dtype)
    vllm_load(model, ckpt, "qwen")
    assert layer.w13_weight.dtype == layer_dtype
    assert torch.equal(bits(layer.w13_weight[:, :I]), bits(t["w1"].to(layer_dtype)))
    assert torch.equal(bits(layer.w13_weight[:, I:]), bits(t["w3"].to(layer_dtype)))
    assert torch.equal(bits(layer.w2_weight), bits(t["w2"].to(layer_dtype)))
    t = {k: v.to(layer_dtype) for k, v in t.items()}
    check_forward(layer, t, gen, tol=ref.TOL[layer_dtype])


def test_load_non_contiguous_checkpoint_tensors(gen):
    model, layer = build_model("mixtral", num_experts=E, top_k=K, hidden_size=H,
                               intermediate_size=I)
    ckpt, t = checkpoint(gen, "mixtral")
    strided = {n: w.t().contiguous().t() for n, w in ckpt.items()}  # same values, col-major
    assert not any(w.is_contiguous() for w in strided.values())
    vllm_load(model, strided, "mixtral")
    assert torch.equal(layer.w13_weight, torch.cat([t["w1"], t["w3"]], dim=1))
    assert torch.equal(layer.w2_weight, t["w2"])


def test_load_non_gated(gen):
    model, layer = build_model("qwen", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                               activation="relu2", is_act_and_mul=False, has_bias=True)
    assert tuple(layer.w13_weight.shape) == (E, I, H)
    assert tuple(layer.w13_bias.shape) == (E, I)
    ckpt, t = checkpoint(gen, "qwen", gated=False, has_bias=True)
    vllm_load(model, ckpt, "qwen")
    assert torch.equal(layer.w13_weight, t["w1"]) and torch.equal(layer.w13_bias, t["b1"])
    check_forward(layer, t, gen, activation="relu2", gated=False)


def test_load_weights_with_expert_mapping(gen):
    path, gate, down, up = STYLES["qwen"]
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name=gate,
                                                  ckpt_down_proj_name=down,
                                                  ckpt_up_proj_name=up, num_experts=E)
    layer = FusedMoE(E, K, H, I, prefix=path, expert_mapping=mapping)
    ckpt, t = checkpoint(gen, "qwen")
    names = [(n.removeprefix(path + "."), w) for n, w in ckpt.items()]
    loaded = list(layer.load_weights(names))
    expected = [{gate: "w13_weight", up: "w13_weight", down: "w2_weight"}[n.split(".")[1]]
                for n, _ in names]
    assert loaded == expected
    layer.process_weights_after_loading()
    check_forward(layer, t, gen)


def test_load_weights_with_expert_mapping_ep(gen):
    path, gate, down, up = STYLES["qwen"]
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name=gate,
                                                  ckpt_down_proj_name=down,
                                                  ckpt_up_proj_name=up, num_experts=E)
    layer = FusedMoE(E, K, H, I, prefix=path, expert_mapping=mapping, ep_size=2, ep_rank=1)
    ckpt, t = checkpoint(gen, "qwen")
    names = [(n.removeprefix(path + "."), w) for n, w in ckpt.items()]
    loaded = list(layer.load_weights(names))
    local = [x for x in range(E) if int(layer.expert_map[x]) >= 0]
    assert len(loaded) == 3 * len(local) == 3 * layer.local_num_experts
    assert torch.equal(layer.w13_weight[:, :I], t["w1"][local])
    assert torch.equal(layer.w2_weight, t["w2"][local])


def test_load_without_expert_mapping_raises():
    layer = FusedMoE(E, K, H, I, prefix="x.experts")
    with pytest.raises(ValueError, match="expert_mapping"):
        list(layer.load_weights([("0.w1.weight", torch.ones(I, H))]))


@pytest.mark.parametrize("tp", [(1, 0), (2, 1), (4, 3)])
def test_full_3d_load(tp, gen):
    tp_size, tp_rank = tp
    layer = FusedMoE(E, K, H, I, tp_size=tp_size, tp_rank=tp_rank)
    _, t = checkpoint(gen, "mixtral")
    it = I // tp_size
    sl = slice(tp_rank * it, (tp_rank + 1) * it)
    layer.weight_loader(layer.w13_weight, t["w1"], "experts.w13_weight", shard_id="w1",
                        expert_id=0)
    layer.weight_loader(layer.w13_weight, t["w3"], "experts.w13_weight", shard_id="w3",
                        expert_id=0)
    layer.weight_loader(layer.w2_weight, t["w2"], "experts.w2_weight", shard_id="w2",
                        expert_id=0)
    assert torch.equal(layer.w13_weight, torch.cat([t["w1"][:, sl], t["w3"][:, sl]], dim=1))
    assert torch.equal(layer.w2_weight, t["w2"][:, :, sl])


@pytest.mark.parametrize("style", ["mixtral", "qwen"])
def test_swigluoai_interleaving_and_biases(style, gen):
    model, layer = build_model(style, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                               activation="swigluoai", has_bias=True)
    ckpt, t = checkpoint(gen, style, has_bias=True)
    vllm_load(model, ckpt, style)
    assert torch.equal(layer.w13_weight[:, 0::2], t["w1"])
    assert torch.equal(layer.w13_weight[:, 1::2], t["w3"])
    assert torch.equal(layer.w13_bias[:, 0::2], t["b1"])
    assert torch.equal(layer.w13_bias[:, 1::2], t["b3"])
    assert torch.equal(layer.w2_bias, t["b2"])
    check_forward(layer, t, gen, activation="swigluoai", interleaved=True)


# ---------------------------------------------------------------- tensor parallelism

TP_CONFIGS = [
    ("silu", dict(activation="silu"), False),
    ("silu-bias", dict(activation="silu", has_bias=True), False),
    ("swigluoai-bias", dict(activation="swigluoai", has_bias=True), True),
    ("relu2-nogate-bias", dict(activation="relu2", is_act_and_mul=False, has_bias=True), False),
]


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("cfg", TP_CONFIGS, ids=[c[0] for c in TP_CONFIGS])
def test_tensor_parallel_sum(cfg, tp_size, gen):
    _, kw, interleaved = cfg
    gated = kw.get("is_act_and_mul", True)
    has_bias = kw.get("has_bias", False)
    ckpt, t = checkpoint(gen, "qwen", has_bias=has_bias, gated=gated)
    full_model, full = build_model("qwen", num_experts=E, top_k=K, hidden_size=H,
                                   intermediate_size=I, **kw)
    vllm_load(full_model, ckpt, "qwen")
    x, logits, full_out = check_forward(full, t, gen, activation=kw["activation"],
                                        interleaved=interleaved, gated=gated)
    it = I // tp_size
    total = torch.zeros_like(full_out)
    for rank in range(tp_size):
        model, layer = build_model("qwen", num_experts=E, top_k=K, hidden_size=H,
                                   intermediate_size=I, tp_size=tp_size, tp_rank=rank, **kw)
        assert layer.intermediate_size_per_partition == it
        assert (layer.tp_size, layer.tp_rank) == (tp_size, rank)
        vllm_load(model, ckpt, "qwen")
        sl = slice(rank * it, (rank + 1) * it)
        if not gated:
            assert torch.equal(layer.w13_weight, t["w1"][:, sl])
        elif interleaved:
            assert torch.equal(layer.w13_weight[:, 0::2], t["w1"][:, sl])
            assert torch.equal(layer.w13_weight[:, 1::2], t["w3"][:, sl])
        else:
            assert torch.equal(layer.w13_weight, torch.cat([t["w1"][:, sl], t["w3"][:, sl]], 1))
        assert torch.equal(layer.w2_weight, t["w2"][:, :, sl])
        if has_bias:
            b13 = layer.w13_bias
            if not gated:
                assert torch.equal(b13, t["b1"][:, sl])
            elif interleaved:
                assert torch.equal(b13[:, 0::2], t["b1"][:, sl])
                assert torch.equal(b13[:, 1::2], t["b3"][:, sl])
            else:
                assert torch.equal(b13, torch.cat([t["b1"][:, sl], t["b3"][:, sl]], 1))
            want_b2 = t["b2"] if rank == 0 else torch.zeros_like(t["b2"])
            assert torch.equal(layer.w2_bias, want_b2), "w2_bias: only tp_rank 0 keeps it"
        out = layer(x, logits)
        assert torch.isfinite(out).all()
        total += out
    err = ref.rel_err(total, full_out)
    assert err <= 1e-5, f"sum over {tp_size} TP ranks differs from the unsharded output: {err:.3g}"


# ---------------------------------------------------------------- expert parallelism

def expected_placement(ep_size, ep_rank, num_experts, strategy):
    """Global ids on a rank, in local order, from api.md's words."""
    if strategy == "round_robin":
        return [x for x in range(num_experts) if x % ep_size == ep_rank]
    counts = [num_experts // ep_size + (1 if r < num_experts % ep_size else 0)
              for r in range(ep_size)]
    start = sum(counts[:ep_rank])
    return list(range(start, start + counts[ep_rank]))


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize("num_experts,ep_size", [(7, 2), (7, 3), (8, 3), (12, 5), (3, 3), (2, 3),
                                                 (16, 4)])
def test_determine_expert_map(num_experts, ep_size, strategy):
    seen = []
    for rank in range(ep_size):
        local, expert_map, mask = moe_ext.determine_expert_map(ep_size, rank, num_experts,
                                                               strategy)
        ids = expected_placement(ep_size, rank, num_experts, strategy)
        assert local == len(ids)
        assert mask is None
        assert expert_map.dtype == torch.int32 and tuple(expert_map.shape) == (num_experts,)
        want = torch.full((num_experts,), -1, dtype=torch.int32)
        want[ids] = torch.arange(len(ids), dtype=torch.int32)
        assert torch.equal(expert_map, want)
        seen += ids
    assert sorted(seen) == list(range(num_experts))


def test_determine_expert_map_single_rank():
    local, expert_map, mask = moe_ext.determine_expert_map(1, 0, 9)
    assert local == 9 and expert_map is None and mask is None


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_size", [2, 3])
def test_expert_parallel_sum(ep_size, strategy, gen):
    ckpt, t = checkpoint(gen, "mixtral", has_bias=True)
    kw = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, has_bias=True)
    full_model, full = build_model("mixtral", **kw)
    vllm_load(full_model, ckpt, "mixtral")
    x, logits, full_out = check_forward(full, t, gen)
    total = torch.zeros_like(full_out)
    for rank in range(ep_size):
        model, layer = build_model("mixtral", ep_size=ep_size, ep_rank=rank,
                                   expert_placement_strategy=strategy, **kw)
        ids = expected_placement(ep_size, rank, E, strategy)
        assert layer.use_ep and layer.local_num_experts == len(ids)
        assert layer.global_num_experts == E
        _, want_map, _ = moe_ext.determine_expert_map(ep_size, rank, E, strategy)
        assert torch.equal(layer.expert_map, want_map)
        assert tuple(layer.w13_weight.shape) == (len(ids), 2 * I, H)
        # expert by expert: non-local experts return False and write nothing
        mapping = FusedMoE.make_expert_params_mapping(model, "w1", "w2", "w3", E)
        params = dict(model.named_parameters())
        for name, w in ckpt.items():
            param_name, weight_name, expert_id, shard_id = next(
                entry for entry in mapping if entry[1] in name)
            mapped = name.replace(weight_name, param_name)
            before = {n: bits(p) for n, p in params.items()}
            ok = params[mapped].weight_loader(params[mapped], w, mapped, shard_id=shard_id,
                                              expert_id=expert_id, return_success=True)
            assert ok is (expert_id in ids), (name, ok)
            if not ok:
                for n, p in params.items():
                    assert torch.equal(bits(p), before[n]), f"{name} wrote into {n}"
        layer.process_weights_after_loading()
        assert torch.equal(layer.w13_weight, torch.cat([t["w1"], t["w3"]], 1)[ids])
        assert torch.equal(layer.w2_weight, t["w2"][ids])
        assert torch.equal(layer.w2_bias, t["b2"][ids])
        out = layer(x, logits)
        total += out
    err = ref.rel_err(total, full_out)
    assert err <= 1e-5, f"sum over {ep_size} EP ranks differs from the full output: {err:.3g}"


# ---------------------------------------------------------------- mapping and metadata

def seed_mapping(gate, down, up, num_experts, num_redundant=0, base_layer=""):
    physical_to_logical = list(range(num_experts)) + [r % num_experts
                                                      for r in range(num_redundant)]
    out = []
    for x in range(num_experts + num_redundant):
        for shard, name in (("w1", gate), ("w2", down), ("w3", up)):
            param = f"experts.{base_layer}w2_" if shard == "w2" else f"experts.{base_layer}w13_"
            out.append((param, f"experts.{physical_to_logical[x]}.{name}.{base_layer}", x, shard))
    return out


def test_make_expert_params_mapping_format():
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="w1",
                                                  ckpt_down_proj_name="w2",
                                                  ckpt_up_proj_name="w3", num_experts=4)
    assert ("experts.w13_", "experts.3.w1.", 3, "w1") in mapping
    assert mapping[:3] == [("experts.w13_", "experts.0.w1.", 0, "w1"),
                           ("experts.w2_", "experts.0.w2.", 0, "w2"),
                           ("experts.w13_", "experts.0.w3.", 0, "w3")]
    assert mapping == seed_mapping("w1", "w2", "w3", 4)
    assert all(type(entry) is tuple for entry in mapping)


def test_make_expert_params_mapping_with_model():
    model, _ = build_model("qwen", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    mapping = FusedMoE.make_expert_params_mapping(model, "gate_proj", "down_proj", "up_proj", E)
    assert mapping == seed_mapping("gate_proj", "down_proj", "up_proj", E)
    lora = torch.nn.Module()
    lora.experts = torch.nn.Module()
    lora.experts.base_layer = torch.nn.Linear(2, 2)  # a parameter named *.base_layer.*
    mapping = FusedMoE.make_expert_params_mapping(lora, "gate_proj", "down_proj", "up_proj", 3)
    assert mapping == seed_mapping("gate_proj", "down_proj", "up_proj", 3, base_layer="base_layer.")
    assert mapping[0] == ("experts.base_layer.w13_", "experts.0.gate_proj.base_layer.", 0, "w1")


def test_make_expert_params_mapping_redundant_experts():
    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3",
        num_experts=4, num_redundant_experts=2)
    assert mapping == seed_mapping("w1", "w2", "w3", 4, num_redundant=2)
    assert ("experts.w13_", "experts.1.w3.", 5, "w3") in mapping


@pytest.mark.parametrize("kw,local,rows", [
    (dict(), 8, 2 * 48),
    (dict(tp_size=2, tp_rank=1), 8, 2 * 24),
    (dict(ep_size=3, ep_rank=2), 2, 2 * 48),
    (dict(is_act_and_mul=False, activation="relu2", has_bias=True), 8, 48),
    (dict(activation="swigluoai", has_bias=True, params_dtype=torch.bfloat16), 8, 2 * 48),
])
def test_layer_metadata(kw, local, rows):
    prefix = "model.layers.3.mlp.experts"
    layer = FusedMoE(8, 2, 64, 48, prefix=prefix, **kw)
    tp_size, ep_size = kw.get("tp_size", 1), kw.get("ep_size", 1)
    it = 48 // tp_size
    dtype = kw.get("params_dtype", torch.get_default_dtype())
    assert layer.global_num_experts == 8 and layer.logical_num_experts == 8
    assert layer.local_num_experts == local and layer.top_k == 2 and layer.hidden_size == 64
    assert layer.intermediate_size_per_partition == it
    assert (layer.tp_size, layer.tp_rank) == (tp_size, kw.get("tp_rank", 0))
    assert (layer.ep_size, layer.ep_rank) == (ep_size, kw.get("ep_rank", 0))
    assert layer.use_ep == (ep_size > 1)
    assert (layer.expert_map is None) == (ep_size == 1)
    if ep_size > 1:
        assert layer.expert_map.dtype == torch.int32
    assert layer.layer_name == prefix
    assert layer.quant_method is not None
    assert layer.extra_repr() == (
        f"global_num_experts=8, local_num_experts={local}, top_k=2, "
        f"intermediate_size_per_partition={it}, tp_size={tp_size},\n"
        f"ep_size={ep_size}, reduce_results=False, ")
    assert repr(layer).startswith("FusedMoE(\n  global_num_experts=8, ")
    shapes = {"w13_weight": (local, rows, 64), "w2_weight": (local, 64, it)}
    if kw.get("has_bias"):
        shapes.update(w13_bias=(local, rows), w2_bias=(local, 64))
    params = dict(layer.named_parameters())
    assert {n: tuple(p.shape) for n, p in params.items()} == shapes
    for name, p in params.items():
        assert isinstance(p, torch.nn.Parameter) and not p.requires_grad, name
        assert p.dtype == dtype, name
        assert callable(getattr(p, "weight_loader", None)), f"{name} has no weight_loader"
    keys = set(layer.state_dict())
    assert set(shapes) <= keys
    assert keys - set(shapes) <= {"_expert_map"}
    views = layer.get_expert_weights()
    assert len(views) == len(shapes)
    assert all(v.shape[0] == local for v in views)


def test_process_weights_after_loading_idempotent(gen):
    model, layer = build_model("qwen", num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    ckpt, t = checkpoint(gen, "qwen")
    vllm_load(model, ckpt, "qwen")
    x, logits, out = check_forward(layer, t, gen)
    params = {n: p for n, p in layer.named_parameters()}
    layer.process_weights_after_loading()
    layer.process_weights_after_loading()
    after = dict(layer.named_parameters())
    assert after.keys() == params.keys()
    assert all(after[n] is params[n] for n in params), "parameters were replaced"
    assert torch.equal(layer(x, logits), out)


# ---------------------------------------------------------------- quantization tensors (seed 001)

def quant_param(layer, name, shape, dtype=torch.float32, **attrs):
    """A parameter the way a quant method registers one: weight_loader and attributes set."""
    param = torch.nn.Parameter(torch.full(shape, -7.0).to(dtype), requires_grad=False)
    param.weight_loader = layer.weight_loader
    for key, value in attrs.items():
        setattr(param, key, value)
    layer.register_parameter(name, param)
    return param


TP_SIZE, TP_RANK, QE, QH, QI, G = 2, 1, 4, 64, 32, 8
QIT = QI // TP_SIZE
QSL = slice(TP_RANK * QIT, (TP_RANK + 1) * QIT)


def quant_layer():
    return FusedMoE(QE, 2, QH, QI, tp_size=TP_SIZE, tp_rank=TP_RANK)


def test_per_tensor_scales(gen):
    layer = quant_layer()
    w13 = quant_param(layer, "w13_weight_scale", (QE, 2), quant_method="tensor")
    w2 = quant_param(layer, "w2_weight_scale", (QE,), quant_method="tensor")
    s = randn(gen, 3).abs() + 0.1
    layer.weight_loader(w13, s[0].clone(), "experts.w13_weight_scale", shard_id="w1", expert_id=2)
    layer.weight_loader(w13, s[1].clone(), "experts.w13_weight_scale", shard_id="w3", expert_id=2)
    layer.weight_loader(w2, s[2].clone(), "experts.w2_weight_scale", shard_id="w2", expert_id=2)
    assert w13[2].tolist() == [s[0].item(), s[1].item()] and w2[2].item() == s[2].item()
    assert (w13[[0, 1, 3]] == -7).all() and (w2[[0, 1, 3]] == -7).all()


def test_per_channel_scales(gen):
    layer = quant_layer()
    w13 = quant_param(layer, "w13_weight_scale", (QE, 2 * QIT, 1), quant_method="channel")
    w2 = quant_param(layer, "w2_weight_scale", (QE, QH, 1), quant_method="channel")
    s1, s3, s2 = randn(gen, QI, 1), randn(gen, QI, 1), randn(gen, QH, 1)
    layer.weight_loader(w13, s1, "experts.w13_weight_scale", shard_id="w1", expert_id=1)
    layer.weight_loader(w13, s3, "experts.w13_weight_scale", shard_id="w3", expert_id=1)
    layer.weight_loader(w2, s2, "experts.w2_weight_scale", shard_id="w2", expert_id=1)
    assert torch.equal(w13[1], torch.cat([s1[QSL], s3[QSL]]))
    assert torch.equal(w2[1], s2)  # per output channel of w2: not narrowed


@pytest.mark.parametrize("load_full_w2", [False, True])
def test_group_scales_and_zero_points(load_full_w2, gen):
    layer = quant_layer()
    w13 = quant_param(layer, "w13_weight_scale", (QE, 2 * QIT, QH // G), quant_method="group")
    w2_cols = QI // G if load_full_w2 else QIT // G
    w2 = quant_param(layer, "w2_qzeros", (QE, QH, w2_cols), quant_method="group",
                     load_full_w2=load_full_w2)
    s1, s3, z2 = randn(gen, QI, QH // G), randn(gen, QI, QH // G), randn(gen, QH, QI // G)
    layer.weight_loader(w13, s1, "experts.w13_weight_scale", shard_id="w1", expert_id=3)
    layer.weight_loader(w13, s3, "experts.w13_weight_scale", shard_id="w3", expert_id=3)
    layer.weight_loader(w2, z2, "experts.w2_qzeros", shard_id="w2", expert_id=3)
    assert torch.equal(w13[3], torch.cat([s1[QSL], s3[QSL]]))
    want = z2 if load_full_w2 else z2[:, TP_RANK * w2_cols:(TP_RANK + 1) * w2_cols]
    assert torch.equal(w2[3], want)


def test_input_scale(gen):
    layer = quant_layer()
    a13 = quant_param(layer, "w13_input_scale", (QE,))
    s = randn(gen, 1).abs() + 0.1
    layer.weight_loader(a13, s[0].clone(), "experts.w13_input_scale", shard_id="w1", expert_id=0)
    assert a13[0].item() == s.item() and (a13[1:] == -7).all()


def test_g_idx(gen):
    layer = quant_layer()
    g13 = quant_param(layer, "w13_weight_g_idx", (QE, QH), dtype=torch.int32)
    g2 = quant_param(layer, "w2_weight_g_idx", (QE, QIT), dtype=torch.int32)
    idx13 = torch.randperm(QH, generator=gen).to(torch.int32) // G
    idx2 = torch.randperm(QI, generator=gen).to(torch.int32) // G
    layer.weight_loader(g13, idx13, "experts.w13_weight_g_idx", shard_id="w1", expert_id=2)
    layer.weight_loader(g2, idx2, "experts.w2_weight_g_idx", shard_id="w2", expert_id=2)
    assert torch.equal(g13[2], idx13)  # w1/w3 g_idx: whole
    assert torch.equal(g2[2], idx2[QSL])  # w2 g_idx: this rank's slice of the input dim


def test_combined_w13_scale(gen):
    layer = quant_layer()
    param = quant_param(layer, "w13_weight_scale", (QE, 2 * QIT // 4, 2),
                        quant_method="block")
    combined = randn(gen, 2 * QIT // 4 * TP_SIZE, 2)  # w1 and w3 block scales in one tensor
    layer.weight_loader(param, combined, "experts.w13_weight_scale", shard_id="w1", expert_id=1)
    rows = param.shape[1]
    assert torch.equal(param[1], combined[TP_RANK * rows:(TP_RANK + 1) * rows])


def test_unknown_scale_kind_raises(gen):
    layer = quant_layer()
    param = quant_param(layer, "w13_weight_scale", (QE, 2))
    with pytest.raises(ValueError, match="quant"):
        layer.weight_loader(param, randn(gen, 1)[0], "experts.w13_weight_scale", shard_id="w1",
                            expert_id=0)


def test_is_transposed_flips_the_shard_dim(gen):
    """GPTQ-style packed weights are stored [in, out]: w1/w3 shard on dim 1, w2 on dim 0."""
    layer = quant_layer()
    w13 = quant_param(layer, "w13_qweight", (QE, QH, 2 * QIT), dtype=torch.int32,
                      is_transposed=True)
    w2 = quant_param(layer, "w2_qweight", (QE, QIT, QH), dtype=torch.int32, is_transposed=True)
    q1, q3 = (torch.randint(-2**31, 2**31 - 1, (QH, QI), generator=gen, dtype=torch.int32)
              for _ in range(2))
    q2 = torch.randint(-2**31, 2**31 - 1, (QI, QH), generator=gen, dtype=torch.int32)
    layer.weight_loader(w13, q1, "experts.w13_qweight", shard_id="w1", expert_id=1)
    layer.weight_loader(w13, q3, "experts.w13_qweight", shard_id="w3", expert_id=1)
    layer.weight_loader(w2, q2, "experts.w2_qweight", shard_id="w2", expert_id=1)
    assert torch.equal(w13[1], torch.cat([q1[:, QSL], q3[:, QSL]], dim=1))
    assert torch.equal(w2[1], q2[QSL])


def test_sizes_default_to_torch_distributed(monkeypatch):
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 3)
    layer = FusedMoE(8, 2, 64, 48)
    assert (layer.tp_size, layer.tp_rank) == (4, 3)
    assert layer.intermediate_size_per_partition == 12
    assert not layer.use_ep and layer.expert_map is None
    explicit = FusedMoE(8, 2, 64, 48, tp_size=1, tp_rank=0)
    assert (explicit.tp_size, explicit.tp_rank) == (1, 0)


def test_sizes_without_torch_distributed():
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    layer = FusedMoE(8, 2, 64, 48)
    assert (layer.tp_size, layer.tp_rank, layer.ep_size, layer.ep_rank) == (1, 0, 1, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_params_dtype_defaults_to_torch_default(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = FusedMoE(8, 2, 64, 48, has_bias=True)
    finally:
        torch.set_default_dtype(previous)
    assert all(p.dtype == dtype for p in layer.parameters())


def test_get_expert_weights_skips_the_routing_bias():
    """vLLM models pass e_score_correction_bias as a Parameter of their gate; held by the
    layer it is a per-logical-expert tensor, not an expert weight (seed 001)."""
    bias = torch.nn.Parameter(torch.zeros(16), requires_grad=False)
    layer = FusedMoE(16, 4, 64, 32, use_grouped_topk=True, num_expert_group=4, topk_group=2,
                     scoring_func="sigmoid", e_score_correction_bias=bias, ep_size=2, ep_rank=1)
    views = layer.get_expert_weights()
    assert [tuple(v.shape) for v in views] == [(8, 2 * 32 * 64), (8, 64 * 32)]
    assert all(v.data_ptr() == p.data_ptr() for v, p in zip(views, (layer.w13_weight,
                                                                     layer.w2_weight)))


def test_reduction_hooks_used_by_vllm_models(gen):
    layer = FusedMoE(4, 2, 32, 16)
    out = torch.randn(3, 32, generator=gen)
    assert layer.must_reduce_shared_expert_outputs() is False
    assert layer.maybe_all_reduce_tensor_model_parallel(out) is out
    sharded = FusedMoE(4, 2, 32, 16, tp_size=2, tp_rank=1)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        sharded.maybe_all_reduce_tensor_model_parallel(out)
