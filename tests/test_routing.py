"""Routing (select_experts, fused_topk, grouped_topk) against the float64 reference."""
import pytest
import torch

import moe_ext
from moe_ext import FusedMoE
from helpers import keep_rows, randn
import reference as ref

LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (id, E, top_k, routing kwargs, bias dtype or None)
CASES = [
    ("softmax-E7-k1", 7, 1, dict(renormalize=True), None),
    ("softmax-E7-k2-norenorm", 7, 2, dict(renormalize=False), None),
    ("softmax-E12-k8", 12, 8, dict(renormalize=True), None),
    ("softmax-E8-k8-all", 8, 8, dict(renormalize=False), None),
    ("softmax-E12-k3-scaled", 12, 3, dict(renormalize=False, routed_scaling_factor=2.5), None),
    ("sigmoid-E12-k3", 12, 3, dict(renormalize=True, scoring_func="sigmoid"), None),
    ("sigmoid-E7-k2-norenorm", 7, 2, dict(renormalize=False, scoring_func="sigmoid"), None),
    ("sigmoid-bias-E12-k3", 12, 3, dict(renormalize=True, scoring_func="sigmoid"),
     torch.float32),
    ("sigmoid-bias-E7-k2-norenorm-scaled", 7, 2,
     dict(renormalize=False, scoring_func="sigmoid", routed_scaling_factor=1.5), torch.bfloat16),
    ("grouped-softmax-E48-g4-2-k8", 48, 8,
     dict(renormalize=True, num_expert_group=4, topk_group=2), None),
    ("grouped-softmax-E12-g4-2-k3-norenorm", 12, 3,
     dict(renormalize=False, num_expert_group=4, topk_group=2), None),
    ("grouped-softmax-bias-E48-g4-2-k1", 48, 1,
     dict(renormalize=True, num_expert_group=4, topk_group=2), torch.float32),
    ("grouped-sigmoid-bias-E48-g4-2-k8-scaled", 48, 8,
     dict(renormalize=True, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
          routed_scaling_factor=2.5), torch.float32),
    ("grouped-sigmoid-E12-g3-1-k2", 12, 2,
     dict(renormalize=True, scoring_func="sigmoid", num_expert_group=3, topk_group=1), None),
    ("grouped-sigmoid-bias-E12-g6-3-k4", 12, 4,
     dict(renormalize=False, scoring_func="sigmoid", num_expert_group=6, topk_group=3),
     torch.bfloat16),
]


def check_routing(weights, ids, logits, top_k, bias=None, **kw):
    """Asserts dtypes/shapes and that weights/ids match the reference on non-near-tie tokens."""
    m = logits.shape[0]
    assert weights.dtype == torch.float32 and tuple(weights.shape) == (m, top_k)
    assert tuple(ids.shape) == (m, top_k)
    assert weights.device == logits.device and ids.device == logits.device
    rw, rid, margin = ref.route(logits, top_k, e_score_correction_bias=bias, **kw)
    keep = keep_rows(margin)
    assert keep.float().mean() > 0.5, "too many near-ties: degenerate inputs"
    assert torch.isfinite(weights).all()
    got_w, got_id = ref.sorted_by_id(weights.cpu(), ids.cpu())
    want_w, want_id = ref.sorted_by_id(rw.cpu(), rid.cpu())
    assert torch.equal(got_id[keep], want_id[keep]), "expert ids differ from the reference"
    torch.testing.assert_close(got_w[keep], want_w[keep], rtol=1e-5, atol=1e-6)
    # every row is a set of distinct valid experts, near-tie rows included
    assert (ids >= 0).all() and (ids < logits.shape[1]).all()
    assert (got_id[:, 1:] != got_id[:, :-1]).all()


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_select_experts(case, dtype, m, device, gen):
    _, e, k, kw, bias_dtype = case
    logits = randn(gen, m, e, dtype=dtype, device=device, scale=2.0)
    x = randn(gen, m, 16, device=device)
    bias = None if bias_dtype is None else randn(gen, e, dtype=bias_dtype, device=device,
                                                 scale=0.3)
    before = logits.clone()
    grouped = "num_expert_group" in kw
    w, ids = FusedMoE.select_experts(
        x, logits, k, grouped, kw["renormalize"], topk_group=kw.get("topk_group"),
        num_expert_group=kw.get("num_expert_group"), scoring_func=kw.get("scoring_func",
                                                                         "softmax"),
        routed_scaling_factor=kw.get("routed_scaling_factor", 1.0),
        e_score_correction_bias=bias)
    assert ids.dtype == torch.int32
    assert torch.equal(logits, before), "select_experts modified router_logits"
    check_routing(w, ids, logits, k, bias=bias, **kw)


@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("e,k,m", [(7, 2, 5), (12, 8, 33), (48, 1, 1)])
def test_fused_topk(e, k, m, renormalize, scoring_func, dtype, device, gen):
    logits = randn(gen, m, e, dtype=dtype, device=device, scale=2.0)
    x = randn(gen, m, 8, device=device)
    w, ids, token_expert_indices = moe_ext.fused_topk(x, logits, k, renormalize,
                                                      scoring_func=scoring_func)
    assert ids.dtype == torch.int32
    check_routing(w, ids, logits, k, renormalize=renormalize, scoring_func=scoring_func)
    # vLLM's topk kernels: token_expert_indices[t, j] = j * M + t
    assert tuple(token_expert_indices.shape) == (m, k)
    assert token_expert_indices.dtype == torch.int32
    t = torch.arange(m)[:, None]
    j = torch.arange(k)[None, :]
    assert torch.equal(token_expert_indices.cpu().long(), j * m + t)


@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
@pytest.mark.parametrize("e,groups,kept,k,scoring,bias", [
    (48, 4, 2, 8, "sigmoid", True),
    (48, 4, 2, 8, "softmax", False),
    (12, 4, 2, 3, "softmax", True),
    (12, 2, 1, 6, "sigmoid", False),
    (7, 7, 3, 2, "sigmoid", True),
])
@pytest.mark.parametrize("m", [1, 33])
def test_grouped_topk(e, groups, kept, k, scoring, bias, m, dtype, device, gen):
    logits = randn(gen, m, e, dtype=dtype, device=device, scale=2.0)
    x = randn(gen, m, 8, device=device)
    b = randn(gen, e, device=device, scale=0.3) if bias else None
    w, ids = moe_ext.grouped_topk(x, logits, k, True, num_expert_group=groups, topk_group=kept,
                                  scoring_func=scoring, routed_scaling_factor=2.5,
                                  e_score_correction_bias=b)
    assert ids.dtype == torch.int32
    check_routing(w, ids, logits, k, bias=b, renormalize=True, scoring_func=scoring,
                  num_expert_group=groups, topk_group=kept, routed_scaling_factor=2.5)


def test_grouped_masks_with_minus_inf(device, gen):
    """With all s + b < 0, masking the dropped groups with 0 (not -inf) would pick them."""
    m, e, groups, kept, k = 33, 48, 8, 2, 8
    logits = randn(gen, m, e, device=device, scale=2.0)
    bias = torch.full((e,), -3.0, device=device) + randn(gen, e, device=device, scale=0.1)
    w, ids = moe_ext.grouped_topk(randn(gen, m, 8, device=device), logits, k, True,
                                  num_expert_group=groups, topk_group=kept,
                                  scoring_func="sigmoid", e_score_correction_bias=bias)
    check_routing(w, ids, logits, k, bias=bias, renormalize=True, scoring_func="sigmoid",
                  num_expert_group=groups, topk_group=kept)
    group_of = ids.cpu().long() // (e // groups)
    assert all(len(set(row.tolist())) <= kept for row in group_of)


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=str)
def test_ties_go_to_lower_index(scoring_func, dtype, device, gen):
    m, e, k = 16, 12, 3
    logits = randn(gen, m, e, scale=0.5)
    lows = []
    for t in range(m):
        i, j = sorted(torch.randperm(e, generator=gen)[:2].tolist())
        logits[t, i] = logits[t, j] = 4.0  # equal maxima at i < j
        lows.append((i, j))
    logits[0] = 1.0  # a fully tied row: experts 0, 1, 2
    lows[0] = (0, 1)
    logits = logits.to(dtype).to(device)
    w, ids = FusedMoE.select_experts(logits, logits, k, False, True, scoring_func=scoring_func)
    ids = ids.cpu()
    assert sorted(ids[0].tolist()) == [0, 1, 2]
    w1, ids1 = FusedMoE.select_experts(logits, logits, 1, False, True, scoring_func=scoring_func)
    assert ids1.cpu()[:, 0].tolist() == [i for i, _ in lows]
    for t in range(1, m):
        assert set(lows[t]) <= set(ids[t].tolist())
    torch.testing.assert_close(w1.cpu(), torch.ones(m, 1))


def test_grouped_group_ties_go_to_lower_group(device, gen):
    m, e, groups = 8, 12, 4
    logits = randn(gen, m, e, scale=0.3)
    logits[:, 3] = 5.0  # group 1's max
    logits[:, 9] = 5.0  # group 3's max, tied
    logits = logits.to(device)
    _, ids = moe_ext.grouped_topk(logits, logits, 1, True, num_expert_group=groups, topk_group=1)
    assert ids.cpu()[:, 0].tolist() == [3] * m


@pytest.mark.parametrize("fn", ["select_experts", "fused_topk", "grouped_topk"])
@pytest.mark.parametrize("k", [1, 8])
def test_zero_tokens(fn, k, device):
    logits = torch.empty(0, 16, device=device)
    x = torch.empty(0, 32, device=device)
    if fn == "select_experts":
        out = FusedMoE.select_experts(x, logits, k, False, True)
    elif fn == "fused_topk":
        out = moe_ext.fused_topk(x, logits, k, True)
    else:
        out = moe_ext.grouped_topk(x, logits, k, True, num_expert_group=4, topk_group=2)
    w, ids = out[0], out[1]
    assert tuple(w.shape) == (0, k) and w.dtype == torch.float32
    assert tuple(ids.shape) == (0, k) and ids.dtype == torch.int32
    if fn == "fused_topk":
        assert tuple(out[2].shape) == (0, k)


@pytest.mark.parametrize("indices_type", [torch.int64, torch.int32, torch.uint32], ids=str)
def test_indices_type(indices_type, device, gen):
    m, e, k = 9, 12, 4
    logits = randn(gen, m, e, device=device)
    w0, ids0 = FusedMoE.select_experts(logits, logits, k, False, True)
    w, ids = FusedMoE.select_experts(logits, logits, k, False, True, indices_type=indices_type)
    assert ids.dtype == indices_type
    assert torch.equal(ids.cpu().long(), ids0.cpu().long())
    assert torch.equal(w, w0)
    _, ids2, _ = moe_ext.fused_topk(logits, logits, k, True, indices_type=indices_type)
    assert ids2.dtype == indices_type
    assert torch.equal(ids2.cpu().long(), ids0.cpu().long())


def test_custom_routing_function(device, gen):
    m, e, k = 7, 12, 3
    x = randn(gen, m, 16, device=device)
    logits = randn(gen, m, e, device=device)
    calls = []

    def custom(hidden_states, gating_output, topk, renormalize):
        calls.append((hidden_states, gating_output, topk, renormalize))
        # the k *smallest* logits, weights from a softmax over them; int64 ids, f16 weights
        vals, idx = torch.topk(-gating_output, topk, dim=-1)
        return torch.softmax(vals, dim=-1).to(torch.float16), idx

    w, ids = FusedMoE.select_experts(x, logits, k, False, False, custom_routing_function=custom)
    assert len(calls) == 1
    hs, go, topk, renorm = calls[0]
    assert hs is x and go is logits and topk == k and renorm is False
    vals, idx = torch.topk(-logits, k, dim=-1)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), idx)
    assert torch.equal(w, torch.softmax(vals, dim=-1).to(torch.float16).float())
