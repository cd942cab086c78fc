"""FusedMoE forward and the functional fused_experts / fused_moe against the float64 reference."""
import pytest
import torch

import moe_ext
from moe_ext import FusedMoE
from helpers import expert_weights, keep_rows, make_layer, randn
import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (id, activation, is_act_and_mul, has_bias, weight scale)
ACTIVATIONS = [
    ("silu", "silu", True, False, 1.0),
    ("silu-bias", "silu", True, True, 1.0),
    ("gelu", "gelu", True, False, 1.0),
    ("swigluoai-bias", "swigluoai", True, True, 4.0),
    ("swigluoai", "swigluoai", True, False, 4.0),
    ("relu2-nogate", "relu2", False, False, 1.0),
    ("relu2-nogate-bias", "relu2", False, True, 1.0),
    ("silu-nogate", "silu", False, False, 1.0),
    ("gelu-nogate", "gelu", False, True, 1.0),
]

# (id, E, top_k, routing kwargs of the layer, correction bias?)
ROUTINGS = [
    ("softmax-renorm", 12, 3, dict(renormalize=True), False),
    ("softmax", 12, 3, dict(renormalize=False), False),
    ("softmax-scaled", 7, 2, dict(renormalize=False, routed_scaling_factor=2.5), False),
    ("sigmoid", 12, 3, dict(renormalize=False, scoring_func="sigmoid"), False),
    ("sigmoid-bias-renorm", 12, 3, dict(renormalize=True, scoring_func="sigmoid"), True),
    ("grouped-softmax", 48, 8, dict(renormalize=True, use_grouped_topk=True,
                                    num_expert_group=4, topk_group=2), False),
    ("grouped-sigmoid-bias-scaled", 48, 8,
     dict(renormalize=True, use_grouped_topk=True, num_expert_group=4, topk_group=2,
          scoring_func="sigmoid", routed_scaling_factor=2.5), True),
    ("grouped-softmax-bias-E12", 12, 2,
     dict(renormalize=False, use_grouped_topk=True, num_expert_group=4, topk_group=2), True),
]


def reference_for(x, logits, weights, top_k, dtype, renormalize=True, use_grouped_topk=False,
                  num_expert_group=None, topk_group=None, scoring_func="softmax",
                  routed_scaling_factor=1.0, e_score_correction_bias=None, activation="silu",
                  is_act_and_mul=True, apply_router_weight_on_input=False, expert_map=None,
                  swiglu_alpha=1.702, swiglu_limit=7.0):
    """Float64 output and near-tie margin for a layer configured with these keywords."""
    return ref.moe(
        x, logits, weights["w13_weight"], weights["w2_weight"], top_k, renormalize=renormalize,
        scoring_func=scoring_func, num_expert_group=num_expert_group if use_grouped_topk else 0,
        topk_group=topk_group if use_grouped_topk else 0,
        routed_scaling_factor=routed_scaling_factor,
        e_score_correction_bias=e_score_correction_bias, activation=activation,
        is_act_and_mul=is_act_and_mul, w13_bias=weights.get("w13_bias"),
        w2_bias=weights.get("w2_bias"), expert_map=expert_map,
        apply_router_weight_on_input=apply_router_weight_on_input, swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit, act_dtype=dtype)


def check_output(out, want, margin, x, dtype):
    assert out.dtype == x.dtype and out.device == x.device
    assert tuple(out.shape) == tuple(x.shape)
    assert torch.isfinite(out).all(), "non-finite output"
    keep = keep_rows(margin)
    err = ref.rel_err(out.cpu()[keep], want.cpu()[keep])
    assert err <= ref.TOL[dtype], f"rel_err {err:.3g} > {ref.TOL[dtype]:g}"
    return err


def run_case(gen, device, dtype, e, k, h, i, m, logits_dtype=None, scale=1.0, has_bias=False,
             bias_in_routing=False, **kw):
    """Builds a random layer with these keywords, runs it, checks it against the reference."""
    gated = kw.get("is_act_and_mul", True)
    weights = expert_weights(gen, e, h, i, gated=gated, has_bias=has_bias, dtype=dtype,
                             device=device, scale=scale)
    corr = randn(gen, e, device=device, scale=0.3) if bias_in_routing else None
    layer = make_layer(weights, num_experts=e, top_k=k, hidden_size=h, intermediate_size=i,
                       params_dtype=dtype, has_bias=has_bias, e_score_correction_bias=corr,
                       device=device, **kw)
    x = randn(gen, m, h, dtype=dtype, device=device)
    logits = randn(gen, m, e, dtype=logits_dtype or dtype, device=device, scale=2.0)
    out = layer(x, logits)
    want, margin = reference_for(x, logits, weights, k, dtype, e_score_correction_bias=corr,
                                 **kw)
    check_output(out, want, margin, x, dtype)
    return layer, weights, x, logits, out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
def test_activations(act, dtype, device, gen):
    _, activation, gated, has_bias, scale = act
    layer, weights, x, _, _ = run_case(gen, device, dtype, e=7, k=2, h=67, i=45, m=33,
                                       scale=scale, has_bias=has_bias, activation=activation,
                                       is_act_and_mul=gated)
    if activation == "swigluoai":  # the clamps at +-7 must be exercised
        h = x.double() @ weights["w13_weight"][0].double().T
        assert (h[:, 0::2] > 7).any() and (h[:, 1::2].abs() > 7).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("routing", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_routing_modes(routing, dtype, device, gen):
    _, e, k, kw, bias = routing
    run_case(gen, device, dtype, e=e, k=k, h=40, i=24, m=33, logits_dtype=torch.float32,
             bias_in_routing=bias, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("e,k,h,i", [(7, 1, 67, 45), (8, 8, 67, 45), (12, 8, 33, 17),
                                     (1, 1, 19, 5), (7, 2, 128, 64)])
@pytest.mark.parametrize("m", [0, 1, 5, 33])
def test_sizes(e, k, h, i, m, dtype, device, gen):
    run_case(gen, device, dtype, e=e, k=k, h=h, i=i, m=m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("e,k,h,i,m", [
    (4, 2, 2100, 40, 5),     # GEMM1 reduction longer than one 2048-wide K slice
    (4, 2, 40, 2085, 5),     # same for GEMM2
    (16, 8, 2100, 16, 2001),  # big per-token workspace: the tokens run in several chunks
])
def test_long_reductions_and_many_tokens(e, k, h, i, m, dtype, device, gen):
    run_case(gen, device, dtype, e=e, k=k, h=h, i=i, m=m, logits_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_tokens(dtype, device, gen):
    weights = expert_weights(gen, 7, 67, 45, dtype=dtype, device=device)
    layer = make_layer(weights, num_experts=7, top_k=2, hidden_size=67, intermediate_size=45,
                       params_dtype=dtype, device=device)
    out = layer(torch.empty(0, 67, dtype=dtype, device=device),
                torch.empty(0, 7, dtype=dtype, device=device))
    assert tuple(out.shape) == (0, 67) and out.dtype == dtype and out.device.type == device


@pytest.mark.parametrize("logits_dtype", DTYPES, ids=str)
def test_logits_dtypes(logits_dtype, device, gen):
    run_case(gen, device, torch.bfloat16, e=12, k=3, h=40, i=24, m=33, logits_dtype=logits_dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation,gated", [("silu", True), ("relu2", False)])
def test_apply_router_weight_on_input(activation, gated, dtype, device, gen):
    # sigmoid without renormalize: weights are not 1, so input- and output-side scaling differ
    run_case(gen, device, dtype, e=7, k=1, h=67, i=45, m=33, apply_router_weight_on_input=True,
             renormalize=False, scoring_func="sigmoid", activation=activation,
             is_act_and_mul=gated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shared_experts(dtype, device, gen):
    e, k, h, i, m = 7, 2, 67, 45, 5
    shared = torch.nn.Linear(h, h, bias=False, dtype=dtype, device=device)
    with torch.no_grad():
        shared.weight.copy_(randn(gen, h, h, dtype=dtype, device=device, scale=0.1))
    weights = expert_weights(gen, e, h, i, dtype=dtype, device=device)
    layer = make_layer(weights, num_experts=e, top_k=k, hidden_size=h, intermediate_size=i,
                       params_dtype=dtype, shared_experts=shared, device=device)
    assert layer.shared_experts is shared
    x = randn(gen, m, h, dtype=dtype, device=device)
    logits = randn(gen, m, e, dtype=dtype, device=device, scale=2.0)
    result = layer(hidden_states=x, router_logits=logits)
    assert isinstance(result, tuple) and len(result) == 2
    shared_out, routed_out = result
    assert torch.equal(shared_out, shared(x))
    want, margin = reference_for(x, logits, weights, k, dtype)
    check_output(routed_out, want, margin, x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_custom_routing_function(dtype, device, gen):
    e, k, h, i, m = 12, 3, 40, 24, 9
    perm = torch.randperm(e, generator=gen)
    calls = []

    def custom(hidden_states, gating_output, topk, renormalize):
        calls.append((topk, renormalize))
        # permuted experts and unnormalized sigmoid weights; int64 ids as torch.topk gives
        vals, idx = torch.topk(gating_output.float(), topk, dim=-1)
        return torch.sigmoid(vals), perm.to(idx.device)[idx]

    weights = expert_weights(gen, e, h, i, dtype=dtype, device=device)
    layer = make_layer(weights, num_experts=e, top_k=k, hidden_size=h, intermediate_size=i,
                       params_dtype=dtype, custom_routing_function=custom, renormalize=False,
                       device=device)
    x = randn(gen, m, h, dtype=dtype, device=device)
    logits = randn(gen, m, e, dtype=dtype, device=device)
    out = layer(x, logits)
    assert calls == [(k, False)]
    tw, ti = custom(x, logits, k, False)
    want = ref.experts(x, weights["w13_weight"], weights["w2_weight"], tw, ti, act_dtype=dtype)
    check_output(out, want, torch.ones(m), x, dtype)


def test_correction_bias_held_by_reference(device, gen):
    """vLLM creates the layer first and fills e_score_correction_bias while loading."""
    e, k, h, i, m = 12, 3, 40, 24, 33
    bias = torch.zeros(e, device=device)
    kw = dict(renormalize=True, scoring_func="sigmoid", use_grouped_topk=True,
              num_expert_group=4, topk_group=2)
    weights = expert_weights(gen, e, h, i, device=device)
    layer = make_layer(weights, num_experts=e, top_k=k, hidden_size=h, intermediate_size=i,
                       e_score_correction_bias=bias, device=device, **kw)
    bias.copy_(randn(gen, e, device=device, scale=0.5))
    x = randn(gen, m, h, device=device)
    logits = randn(gen, m, e, device=device, scale=2.0)
    out = layer(x, logits)
    want, margin = reference_for(x, logits, weights, k, torch.float32,
                                 e_score_correction_bias=bias, **kw)
    check_output(out, want, margin, x, torch.float32)
    unbiased, _ = reference_for(x, logits, weights, k, torch.float32, **kw)
    assert ref.rel_err(out, unbiased) > 1e-3, "the bias written after construction was ignored"


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_expert_parallel_rank(strategy, device, gen):
    e, k, h, i, m, ep = 7, 2, 67, 45, 33, 2
    full = expert_weights(gen, e, h, i, device=device)
    for rank in range(ep):
        local, expert_map, _ = moe_ext.determine_expert_map(ep, rank, e, strategy)
        ids = [g for g in range(e) if int(expert_map[g]) >= 0]
        order = sorted(ids, key=lambda g: int(expert_map[g]))
        weights = {name: value[order] for name, value in full.items()}
        layer = make_layer(weights, num_experts=e, top_k=k, hidden_size=h, intermediate_size=i,
                           ep_size=ep, ep_rank=rank, expert_placement_strategy=strategy,
                           device=device)
        x = randn(gen, m, h, device=device)
        logits = randn(gen, m, e, device=device, scale=2.0)
        out = layer(x, logits)
        want, margin = reference_for(x, logits, weights, k, torch.float32,
                                     expert_map=expert_map)
        check_output(out, want, margin, x, torch.float32)


@pytest.mark.parametrize("alpha,limit", [(1.702, 7.0), (1.5, 3.0)])
def test_swiglu_constants(alpha, limit, device, gen):
    run_case(gen, device, torch.float32, e=7, k=2, h=67, i=45, m=33, scale=3.0, has_bias=True,
             activation="swigluoai", swiglu_alpha=alpha, swiglu_limit=limit)


def test_forward_keeps_inputs_and_is_repeatable(device, gen):
    layer, weights, x, logits, out = run_case(gen, device, torch.bfloat16, e=7, k=2, h=67, i=45,
                                              m=5, has_bias=True)
    x0, logits0 = x.clone(), logits.clone()
    params0 = {n: p.clone() for n, p in layer.named_parameters()}
    again = layer(x, logits)
    layer.process_weights_after_loading()  # idempotent
    third = layer(x, logits)
    assert torch.equal(x, x0) and torch.equal(logits, logits0)
    for n, p in layer.named_parameters():
        assert torch.equal(p, params0[n]), n
    assert torch.equal(out, again) and torch.equal(out, third)
    assert again.data_ptr() != x.data_ptr()


def test_inputs_with_storage_offset(device, gen):
    """Contiguous views that start inside their storage (DLPack data + byte_offset)."""
    e, k, h, i = 7, 2, 67, 45
    full = expert_weights(gen, e + 3, h, i, has_bias=True, device=device)
    weights = {n: v[2:2 + e] for n, v in full.items()}  # experts 2..8 of a bigger stack
    layer = make_layer({n: v.clone() for n, v in weights.items()}, num_experts=e, top_k=k,
                       hidden_size=h, intermediate_size=i, has_bias=True, device=device)
    big_x = randn(gen, 40, h, device=device)
    big_logits = randn(gen, 40, e, device=device, scale=2.0)
    x, logits = big_x[7:30], big_logits[7:30]
    assert x.storage_offset() and logits.storage_offset() and x.is_contiguous()
    out = layer(x, logits)
    assert torch.equal(out, layer(x.clone(), logits.clone()))
    want, margin = reference_for(x, logits, weights, k, torch.float32)
    check_output(out, want, margin, x, torch.float32)
    w, ids = FusedMoE.select_experts(x, logits, k, False, True)
    w2, ids2 = FusedMoE.select_experts(x, logits.clone(), k, False, True)
    assert torch.equal(w, w2) and torch.equal(ids, ids2)
    got = moe_ext.fused_experts(x, weights["w13_weight"], weights["w2_weight"], w, ids,
                                w1_bias=weights["w13_bias"], w2_bias=weights["w2_bias"])
    assert torch.equal(got, out)


# ---------------------------------------------------------------- functional API

FUNCTIONAL_ACTS = [
    ("silu", True, False), ("gelu", True, False), ("swigluoai", True, True),
    ("silu_no_mul", False, False), ("gelu_no_mul", False, True), ("relu2_no_mul", False, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", FUNCTIONAL_ACTS, ids=[a[0] for a in FUNCTIONAL_ACTS])
def test_fused_experts(act, dtype, device, gen):
    name, gated, has_bias = act
    e, k, h, i, m = 7, 2, 67, 45, 33
    w = expert_weights(gen, e, h, i, gated=gated, has_bias=has_bias, dtype=dtype, device=device,
                       scale=3.0 if name == "swigluoai" else 1.0)
    x = randn(gen, m, h, dtype=dtype, device=device)
    logits = randn(gen, m, e, device=device, scale=2.0)
    tw, ti, _ = ref.route(logits, k)
    tw, ti = tw.float(), ti  # int64 ids, as vLLM's callers may pass
    out = moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], tw, ti, activation=name,
                                w1_bias=w.get("w13_bias"), w2_bias=w.get("w2_bias"))
    want = ref.experts(x, w["w13_weight"], w["w2_weight"], tw, ti,
                       activation=name.removesuffix("_no_mul"), is_act_and_mul=gated,
                       w13_bias=w.get("w13_bias"), w2_bias=w.get("w2_bias"), act_dtype=dtype)
    check_output(out, want, torch.ones(m), x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_experts_inplace(dtype, device, gen):
    e, k, h, i, m = 7, 2, 67, 45, 9
    w = expert_weights(gen, e, h, i, dtype=dtype, device=device)
    x = randn(gen, m, h, dtype=dtype, device=device)
    x0 = x.clone()
    tw, ti, _ = ref.route(randn(gen, m, e, device=device), k)
    expected = moe_ext.fused_experts(x0, w["w13_weight"], w["w2_weight"], tw.float(), ti.int())
    out = moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], tw.float(), ti.int(),
                                inplace=True)
    assert out.data_ptr() == x.data_ptr(), "inplace=True must write into hidden_states"
    assert torch.equal(x, expected)
    want = ref.experts(x0, w["w13_weight"], w["w2_weight"], tw, ti, act_dtype=dtype)
    check_output(x, want, torch.ones(m), x0, dtype)


@pytest.mark.parametrize("apply_on_input", [False, True])
def test_fused_experts_expert_map(apply_on_input, device, gen):
    e, h, i, m = 8, 67, 45, 33
    k = 1 if apply_on_input else 3
    full = expert_weights(gen, e, h, i, device=device)
    _, expert_map, _ = moe_ext.determine_expert_map(3, 1, e, "round_robin")  # experts 1, 4, 7
    local = {n: v[[1, 4, 7]] for n, v in full.items()}
    x = randn(gen, m, h, device=device)
    tw, ti, _ = ref.route(randn(gen, m, e, device=device, scale=2.0), k, renormalize=False,
                          scoring_func="sigmoid")
    out = moe_ext.fused_experts(x, local["w13_weight"], local["w2_weight"], tw.float(), ti.int(),
                                global_num_experts=e, expert_map=expert_map.to(device),
                                apply_router_weight_on_input=apply_on_input)
    want = ref.experts(x, local["w13_weight"], local["w2_weight"], tw, ti, expert_map=expert_map,
                       apply_router_weight_on_input=apply_on_input)
    hit = (expert_map[ti.cpu()] >= 0).any(dim=1)
    assert hit.any() and not hit.all()
    assert torch.equal(out[~hit.to(device)], torch.zeros_like(out[~hit.to(device)]))
    check_output(out, want, torch.ones(m), x, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("routing", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_fused_moe(routing, dtype, device, gen):
    _, e, k, kw, has_corr = routing
    kw = dict(kw)
    h, i, m = 40, 24, 33
    w = expert_weights(gen, e, h, i, dtype=dtype, device=device)
    x = randn(gen, m, h, dtype=dtype, device=device)
    logits = randn(gen, m, e, device=device, scale=2.0)
    corr = randn(gen, e, device=device, scale=0.3) if has_corr else None
    out = moe_ext.fused_moe(x, w["w13_weight"], w["w2_weight"], logits, k,
                            kw.pop("renormalize"), e_score_correction_bias=corr, **kw)
    want, margin = reference_for(x, logits, w, k, dtype, renormalize=routing[3]["renormalize"],
                                 e_score_correction_bias=corr, **kw)
    check_output(out, want, margin, x, dtype)


def test_fused_moe_custom_routing(device, gen):
    e, k, h, i, m = 7, 2, 67, 45, 9
    w = expert_weights(gen, e, h, i, device=device)
    x = randn(gen, m, h, device=device)
    logits = randn(gen, m, e, device=device)

    def custom(hidden_states, gating_output, topk, renormalize):
        vals, idx = torch.topk(-gating_output, topk, dim=-1)  # the smallest logits
        return torch.softmax(vals, dim=-1), idx.to(torch.int32)

    out = moe_ext.fused_moe(x, w["w13_weight"], w["w2_weight"], logits, k, True,
                            custom_routing_function=custom)
    tw, ti = custom(x, logits, k, True)
    want = ref.experts(x, w["w13_weight"], w["w2_weight"], tw, ti)
    check_output(out, want, torch.ones(m), x, torch.float32)


# ---------------------------------------------------------------- CUDA sizes

@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 64, 1024, 4096, 16384])
def test_large_m_cuda(m, gen):
    run_case(gen, "cuda", torch.bfloat16, e=64, k=6, h=1024, i=512, m=m,
             logits_dtype=torch.float32)


# perf.md grid (bf16), at decode sizes; weights random normal * 0.02 as there
GRID = [
    ("mixtral", 8, 2, 4096, 14336, dict(renormalize=True), False),
    ("qwen3moe", 128, 8, 2048, 768, dict(renormalize=True), False),
    ("gptoss", 128, 4, 2880, 2880, dict(renormalize=True, activation="swigluoai"), True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("grid", GRID, ids=[g[0] for g in GRID])
def test_perf_grid_shapes_cuda(grid, m, gen):
    _, e, k, h, i, kw, has_bias = grid
    dtype = torch.bfloat16
    rows = 2 * i
    cuda_gen = torch.Generator(device="cuda")  # GiBs of weights: draw them on the GPU
    cuda_gen.manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))

    def normal(*shape):
        return (torch.randn(*shape, generator=cuda_gen, device="cuda") * 0.02).to(dtype)

    weights = {"w13_weight": normal(e, rows, h), "w2_weight": normal(e, h, i)}
    if has_bias:
        weights["w13_bias"] = normal(e, rows)
        weights["w2_bias"] = normal(e, h)
    layer = make_layer(weights, num_experts=e, top_k=k, hidden_size=h, intermediate_size=i,
                       params_dtype=dtype, has_bias=has_bias, device="cuda", **kw)
    x = randn(gen, m, h, dtype=dtype, device="cuda")
    logits = randn(gen, m, e, dtype=dtype, device="cuda")
    out = layer(x, logits)
    want, margin = reference_for(x, logits, weights, k, dtype, **kw)
    check_output(out, want, margin, x, dtype)
    del layer, weights
    torch.cuda.empty_cache()
