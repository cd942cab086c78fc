"""CUDA engine: routing and the sort by expert run as one kernel up to 16 tokens (E / 32 warps a
token past 128 experts: up to 32 warps) (csrc/cuda/route_align.cu), as route_kernel +
moe_align_kernel beyond; same results."""
import pytest
import torch

from helpers import kernels_of, randn
from test_gpu import CONFIGS, check, cuda_case

# these tests check the multi-launch pipeline's kernels (conftest.py pipeline_only)
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("pipeline_only")]


FUSED = "route_align"  # route_align_kernel<EPL> or route_align_split_kernel
DEEPSEEK_ROUTING = dict(use_grouped_topk=True, num_expert_group=8, topk_group=4,
                        scoring_func="sigmoid", routed_scaling_factor=2.5, top_k=8)


def launches(layer, x, logits):
    """(fused kernel ran, separate route and align kernels ran)."""
    names = kernels_of(lambda: layer(x, logits))
    fused = any(FUSED in n for n in names)
    separate = any("route_kernel" in n for n in names) and any("moe_align_kernel" in n for n in names)
    return fused, separate


@pytest.mark.parametrize("m", [1, 5, 16, 17, 80])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_routing_fused_with_sort_up_to_16_tokens(cfg, m, gen):
    _, e, k, kw, corr = cfg
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr, h=96, i=64)
    x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    want, margin = reference(x, logits)
    check(layer(x, logits), want, margin, torch.bfloat16)
    assert launches(layer, x, logits) == (m <= 16, m > 16)


@pytest.mark.parametrize("m", [1, 16])
def test_fused_routing_with_256_experts(m, gen):
    """DeepSeek-V3's routing (E = 256, k = 8, groups, bias): 16 tokens take 65 KB of shared
    memory, over the 48 KB default (the kernel opts in)."""
    layer, _, reference = cuda_case(gen, torch.bfloat16, 256, DEEPSEEK_ROUTING, True, h=64, i=32)
    x = randn(gen, m, 64, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, 256, device="cuda", scale=2.0)
    want, margin = reference(x, logits)
    check(layer(x, logits), want, margin, torch.bfloat16)
    assert launches(layer, x, logits) == (True, False)


@pytest.mark.parametrize("m", [1, 4, 24])
def test_routing_outputs_match_standalone_route(m, gen):
    """The experts' routing is the one select_experts returns (route_kernel, a warp per token):
    forward_routed with those ids and weights gives the same bits as the fused forward, which
    up to 4 tokens routes each token with 8 warps (route_token_split.cuh)."""
    layer, _, _ = cuda_case(gen, torch.bfloat16, 256, DEEPSEEK_ROUTING, True, h=64, i=32)
    x = randn(gen, m, 64, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, 256, device="cuda", scale=2.0)
    names = kernels_of(lambda: layer(x, logits))
    assert any("route_align_split_kernel" in n for n in names) == (m <= 4), names
    weights, ids = layer.select_experts(
        x, logits, 8, True, layer.renormalize, topk_group=4, num_expert_group=8,
        scoring_func="sigmoid", routed_scaling_factor=2.5,
        e_score_correction_bias=layer.e_score_correction_bias)
    assert torch.equal(layer(x, logits), layer.forward_routed(x, weights, ids))


@pytest.mark.parametrize("e,k", [(100, 6), (300, 5)])
@pytest.mark.parametrize("m", [3, 40])
def test_routing_beyond_register_experts(e, k, m, gen):
    """Up to 256 experts a lane keeps its experts in registers (E = 100: 4 per lane); past 256
    the rows live in shared memory. Both, fused (M <= 16) and not."""
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(top_k=k), False, h=64, i=32)
    x = randn(gen, m, 64, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    want, margin = reference(x, logits)
    check(layer(x, logits), want, margin, torch.bfloat16)
    assert launches(layer, x, logits) == (m <= 16, m > 16)


@pytest.mark.parametrize("pairs", [2048, 40960])  # 3 and 41 chunks of 1024 pairs
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_sort_split_over_chunks_past_2048_pairs(cfg, pairs, gen):
    """Past 2048 (token, slot) pairs the sort runs as count / scan / scatter launches over
    chunks of the pairs (csrc/cuda/moe_align.cu); the same results as the reference."""
    _, e, k, kw, corr = cfg
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr, h=32, i=16)
    m = pairs // k + 37
    x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    want, margin = reference(x, logits)
    check(layer(x, logits), want, margin, torch.bfloat16)
    names = kernels_of(lambda: layer(x, logits))
    assert all(any(n in name for name in names) for n in
               ("moe_align_count_kernel", "moe_align_scan_kernel", "moe_align_scatter_kernel"))
    assert not any("moe_align_kernel" in name for name in names)


def stale_zero_memory():
    """Leaves zeros free in both of torch's pools (16 MB of 1 MB blocks, one 64 MB block), where
    the next forward's workspace comes from: a padding row the sort failed to set to -1 then
    reads as pair 0."""
    junk = [torch.zeros(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]
    junk.append(torch.zeros(64 << 20, dtype=torch.uint8, device="cuda"))
    del junk


@pytest.mark.parametrize("e, k, pairs", [
    (8, 2, 2000),    # the one-block sort
    (128, 8, 2000),  # the one-block sort, more experts than its 32 warps
    (8, 2, 8192),    # the split sort (8 chunks): its scan fills the padding
    (128, 8, 8192),  # the split sort, more experts than warps
    (256, 8, 16384),  # the split sort, 16 chunks
    (1100, 8, 8192),  # more experts than the scan's 1024 threads
])
def test_sort_padding_rows_over_stale_memory(e, k, pairs, gen):
    """The rows between an expert's pairs and its next block_m boundary are -1 even where the
    workspace held zeros before (a warp per expert fills them, csrc/cuda/moe_align.cuh)."""
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(top_k=k), False, h=32, i=16)
    m = pairs // k
    x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    want, margin = reference(x, logits)
    for _ in range(2):
        stale_zero_memory()
        out = layer(x, logits)
        check(out, want, margin, torch.bfloat16)
        check(out[:1], want[:1], margin[:1], torch.bfloat16)  # pair 0's token: row by row


@pytest.mark.parametrize("tied", [False, True], ids=["normal", "tied"])
@pytest.mark.parametrize("m", [1, 5])
def test_split_routing_without_groups(m, tied, gen):
    """Sigmoid scoring, 192 experts, no groups: up to 5 tokens each takes 6 warps
    (route_align_split_kernel); the same bits as select_experts' warp per token, also where
    logits from 9 levels tie across the warps' candidate lists (ties go to the lower expert)."""
    routing = dict(scoring_func="sigmoid", top_k=6)
    layer, _, reference = cuda_case(gen, torch.bfloat16, 192, routing, False, h=64, i=32)
    x = randn(gen, m, 64, dtype=torch.bfloat16, device="cuda")
    if tied:
        logits = (torch.randint(0, 9, (m, 192), generator=gen).float() * 0.25 - 1.0).cuda()
    else:
        logits = randn(gen, m, 192, device="cuda", scale=2.0)
    out = layer(x, logits)
    if not tied:  # with ties the float64 reference may order equal scores differently
        want, margin = reference(x, logits)
        check(out, want, margin, torch.bfloat16)
    names = kernels_of(lambda: layer(x, logits))
    assert any("route_align_split_kernel" in n for n in names), names
    weights, ids = layer.select_experts(x, logits, 6, False, layer.renormalize, scoring_func="sigmoid")
    assert torch.equal(out, layer.forward_routed(x, weights, ids))
