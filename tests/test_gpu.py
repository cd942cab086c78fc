"""CUDA engine: graph capture/replay, no host sync, CPU/CUDA agreement, loading to GPU."""
import pytest
import torch

import moe_ext
from moe_ext import FusedMoE
from helpers import capture_forward, expert_weights, keep_rows, make_layer, randn, replay
import reference as ref
from test_loading import build_model, checkpoint, reference_w, vllm_load

pytestmark = pytest.mark.gpu

CONFIGS = [
    ("silu", 12, 3, dict(), False),
    ("swigluoai-bias", 12, 4, dict(activation="swigluoai", has_bias=True), False),
    ("relu2-nogate", 7, 2, dict(activation="relu2", is_act_and_mul=False), False),
    ("grouped-sigmoid-bias", 48, 8,
     dict(use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
          routed_scaling_factor=2.5), True),
    ("ep-round-robin", 12, 3, dict(ep_size=3, ep_rank=1, expert_placement_strategy="round_robin"),
     False),
]


def cuda_case(gen, dtype, e, kw, corr, h=67, i=45, device="cuda"):
    """A random layer on `device` and a closure computing the float64 reference."""
    kw = dict(kw)
    has_bias = kw.pop("has_bias", False)
    local = e
    expert_map = None
    if kw.get("ep_size", 1) > 1:
        local, expert_map, _ = moe_ext.determine_expert_map(
            kw["ep_size"], kw["ep_rank"], e, kw.get("expert_placement_strategy", "linear"))
    weights = expert_weights(gen, local, h, i, gated=kw.get("is_act_and_mul", True),
                             has_bias=has_bias, dtype=dtype, device=device)
    bias = randn(gen, e, device=device, scale=0.3) if corr else None
    layer = make_layer(weights, num_experts=e, hidden_size=h, intermediate_size=i,
                       params_dtype=dtype, has_bias=has_bias, e_score_correction_bias=bias,
                       device=device, **kw)

    def reference(x, logits):
        return ref.moe(
            x, logits, weights["w13_weight"], weights["w2_weight"], layer.top_k,
            renormalize=True, scoring_func=kw.get("scoring_func", "softmax"),
            num_expert_group=kw.get("num_expert_group", 0), topk_group=kw.get("topk_group", 0),
            routed_scaling_factor=kw.get("routed_scaling_factor", 1.0),
            e_score_correction_bias=bias, activation=kw.get("activation", "silu"),
            is_act_and_mul=kw.get("is_act_and_mul", True), w13_bias=weights.get("w13_bias"),
            w2_bias=weights.get("w2_bias"), expert_map=expert_map, act_dtype=dtype)

    return layer, weights, reference


def check(out, want, margin, dtype):
    assert torch.isfinite(out).all()
    keep = keep_rows(margin)
    got, want = out.cpu()[keep], want.cpu()[keep]
    if not want.any():  # EP with few tokens: all their experts may live on other ranks
        assert not got.any(), "rows routed only to other EP ranks must be zero"
        return
    err = ref.rel_err(got, want)
    assert err <= ref.TOL[dtype], f"rel_err {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_cuda_graph_capture_and_replay(cfg, dtype, gen):
    _, e, k, kw, corr = cfg
    layer, _, reference = cuda_case(gen, dtype, e, dict(kw, top_k=k), corr)
    m = 33
    static_x = randn(gen, m, layer.hidden_size, dtype=dtype, device="cuda")
    static_logits = randn(gen, m, e, device="cuda", scale=2.0)
    graph, static_out = capture_forward(layer, static_x, static_logits)
    for _ in range(3):
        x = randn(gen, m, layer.hidden_size, dtype=dtype, device="cuda")
        logits = randn(gen, m, e, device="cuda", scale=2.0)
        replay(graph, static_x, static_logits, x, logits)
        want, margin = reference(x, logits)
        check(static_out, want, margin, dtype)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_no_host_sync_in_forward(cfg, gen):
    _, e, k, kw, corr = cfg
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr)
    x = randn(gen, 64, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, 64, e, dtype=torch.bfloat16, device="cuda", scale=2.0)
    layer(x, logits)  # warm-up (first-call allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want, margin = reference(x, logits)
    check(out, want, margin, torch.bfloat16)


def test_no_host_sync_with_custom_routing(gen):
    e, k = 12, 3

    def custom(hidden_states, gating_output, topk, renormalize):
        w, ids = torch.topk(torch.softmax(gating_output.float(), -1), topk, dim=-1)
        return w, ids.to(torch.int32)

    weights = expert_weights(gen, e, 64, 32, dtype=torch.bfloat16, device="cuda")
    layer = make_layer(weights, num_experts=e, top_k=k, hidden_size=64, intermediate_size=32,
                       params_dtype=torch.bfloat16, custom_routing_function=custom,
                       device="cuda")
    x = randn(gen, 16, 64, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, 16, e, device="cuda")
    layer(x, logits)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("m", [1, 33, 300])
def test_cpu_and_cuda_agree(cfg, dtype, m, gen):
    _, e, k, kw, corr = cfg
    cpu_gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    cuda_gen = torch.Generator().manual_seed(cpu_gen.initial_seed())
    cpu_layer, _, _ = cuda_case(cpu_gen, dtype, e, dict(kw, top_k=k), corr, device="cpu")
    cuda_layer, _, reference = cuda_case(cuda_gen, dtype, e, dict(kw, top_k=k), corr)
    for a, b in zip(cpu_layer.parameters(), cuda_layer.parameters()):
        assert torch.equal(a, b.cpu())
    x = randn(gen, m, cpu_layer.hidden_size, dtype=dtype)
    logits = randn(gen, m, e, dtype=dtype, scale=2.0)
    out_cpu = cpu_layer(x, logits)
    out_cuda = cuda_layer(x.cuda(), logits.cuda())
    assert out_cuda.device.type == "cuda" and out_cuda.dtype == dtype
    want, margin = reference(x.cuda(), logits.cuda())
    check(out_cuda, want, margin, dtype)
    check(out_cuda, out_cpu.to(torch.float64), margin, dtype)  # CPU vs CUDA
    w_cpu, ids_cpu = FusedMoE.select_experts(x, logits, k, False, True)
    w_gpu, ids_gpu = FusedMoE.select_experts(x.cuda(), logits.cuda(), k, False, True)
    _, _, rmargin = ref.route(logits, k)
    keep = keep_rows(rmargin)
    a_w, a_id = ref.sorted_by_id(w_cpu, ids_cpu)
    b_w, b_id = ref.sorted_by_id(w_gpu.cpu(), ids_gpu.cpu())
    assert torch.equal(a_id[keep], b_id[keep])
    torch.testing.assert_close(a_w[keep], b_w[keep], rtol=1e-5, atol=1e-6)


def test_forward_on_a_side_stream(gen):
    layer, _, reference = cuda_case(gen, torch.bfloat16, 12, dict(top_k=3), False, h=512, i=256)
    x = randn(gen, 128, 512, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, 128, 12, device="cuda", scale=2.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # the kernels must queue behind this on `side`
        out = layer(x, logits)
    side.synchronize()
    want, margin = reference(x, logits)
    check(out, want, margin, torch.bfloat16)


@pytest.mark.parametrize("m", [0, 1, 5])
def test_small_m_cuda(m, gen):
    layer, _, reference = cuda_case(gen, torch.bfloat16, 12, dict(top_k=3), False)
    x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, 12, dtype=torch.bfloat16, device="cuda", scale=2.0)
    out = layer(x, logits)
    assert tuple(out.shape) == (m, layer.hidden_size) and out.device.type == "cuda"
    if m:
        want, margin = reference(x, logits)
        check(out, want, margin, torch.bfloat16)


@pytest.mark.parametrize("style,kw,interleaved", [
    ("mixtral", dict(), False),
    ("qwen", dict(activation="swigluoai", has_bias=True, tp_size=2, tp_rank=1), True),
])
def test_weight_loader_cpu_checkpoint_into_cuda_layer(style, kw, interleaved, gen):
    e, h, i = 7, 67, 44
    model, layer = build_model(style, num_experts=e, top_k=2, hidden_size=h, intermediate_size=i,
                               device="cuda", **kw)
    assert layer.w13_weight.device.type == "cuda"
    ckpt, t = checkpoint(gen, style, has_bias=kw.get("has_bias", False))
    assert all(w.device.type == "cpu" for w in ckpt.values())
    vllm_load(model, ckpt, style)
    tp, rank = kw.get("tp_size", 1), kw.get("tp_rank", 0)
    sl = slice(rank * i // tp, (rank + 1) * i // tp)
    local = {n: (v[:, sl] if n in ("w1", "w3", "b1", "b3") else v) for n, v in t.items()}
    local["w2"] = t["w2"][:, :, sl]
    if "b2" in local and rank:
        local["b2"] = torch.zeros_like(local["b2"])
    w13, w2, b13, b2 = reference_w(local, interleaved)
    assert torch.equal(layer.w13_weight.cpu(), w13)
    assert torch.equal(layer.w2_weight.cpu(), w2)
    if b13 is not None:
        assert torch.equal(layer.w13_bias.cpu(), b13) and torch.equal(layer.w2_bias.cpu(), b2)
    x = randn(gen, 33, h, device="cuda")
    logits = randn(gen, 33, e, device="cuda", scale=2.0)
    out = layer(x, logits)
    want, margin = ref.moe(x, logits, w13, w2, 2, activation=kw.get("activation", "silu"),
                           w13_bias=b13, w2_bias=b2)
    check(out, want, margin, torch.float32)


def test_fused_moe_cuda_graph(gen):
    e, k, h, i, m = 12, 3, 67, 45, 17
    w = expert_weights(gen, e, h, i, dtype=torch.bfloat16, device="cuda")
    x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_ext.fused_moe(x, w["w13_weight"], w["w2_weight"], logits, k, True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_ext.fused_moe(x, w["w13_weight"], w["w2_weight"], logits, k, True)
    fresh = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    want, margin = ref.moe(fresh, logits, w["w13_weight"], w["w2_weight"], k,
                           act_dtype=torch.bfloat16)
    check(out, want, margin, torch.bfloat16)


def out_of_range_case(gen, e, k, h, i, m, bad_cells, bad_dtype=torch.int64):
    """bf16 experts whose ids at bad_cells are out of range (e, -1, 2^20 by slot; the ids tensor
    int32, or int64 after mixing in bad_dtype's): (run, want), run() the forward through
    moe_ext.fused_experts, want the float64 reference without those slots."""
    w = expert_weights(gen, e, h, i, dtype=torch.bfloat16, device="cuda")
    x = randn(gen, m, h, dtype=torch.bfloat16, device="cuda")
    tw, ids, _ = ref.route(randn(gen, m, e, device="cuda", scale=2.0), k)
    ids = ids.to(torch.int32)
    bad = torch.zeros(m, k, dtype=torch.bool, device="cuda")
    for cell in bad_cells:
        bad[cell] = True
    ids = torch.where(bad, torch.tensor([e, -1, 1 << 20], dtype=bad_dtype, device="cuda").repeat(m, 1)[:, :k],
                      ids)
    tw32 = tw.float()
    clean_w = torch.where(bad, torch.zeros_like(tw), tw)
    clean_ids = torch.where(bad, torch.zeros_like(ids), ids)
    want = ref.experts(x, w["w13_weight"], w["w2_weight"], clean_w, clean_ids,
                       act_dtype=torch.bfloat16)
    return (lambda: moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], tw32, ids)), want


def test_out_of_range_ids_contribute_nothing_on_cuda(gen):
    """abi.h: without a host sync to report them, out-of-range ids contribute nothing on the GPU."""
    m = 33
    run, want = out_of_range_case(gen, 7, 3, 67, 45, m, [(3, 0), (10, 2), (20, 1)])
    out = run()
    torch.cuda.synchronize()
    check(out, want, torch.ones(m), torch.bfloat16)
