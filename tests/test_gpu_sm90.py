"""CUDA engine at prefill sizes: enough rows per expert (>= 64, gemm_configs.cuh mx_select_sm90)
that a Hopper GPU takes the sm_90a wgmma path (other GPUs the mma.sync tiles, same checks).
H and I are multiples of 8 (TMA strides) but not of 64, so the k tails and partial n tiles run."""
import pytest
import torch

from helpers import capture_forward, randn
from test_gpu import CONFIGS, check, cuda_case

pytestmark = pytest.mark.gpu

PREFILL = [c for c in CONFIGS if c[0] != "grouped-sigmoid-bias"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", PREFILL, ids=[c[0] for c in PREFILL])
def test_prefill_matches_reference(cfg, dtype, gen):
    _, e, k, kw, corr = cfg
    layer, _, reference = cuda_case(gen, dtype, e, dict(kw, top_k=k), corr, h=328, i=200)
    m = 700  # >= 150 rows per local expert
    x = randn(gen, m, layer.hidden_size, dtype=dtype, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    out = layer(x, logits)
    again = layer(x, logits)
    assert torch.equal(out, again), "the forward must be deterministic"
    want, margin = reference(x, logits)
    check(out, want, margin, dtype)


def test_prefill_graph_replay(gen):
    _, e, k, kw, corr = CONFIGS[0]
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr, h=256, i=136)
    m = 512
    static_x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
    static_logits = randn(gen, m, e, device="cuda", scale=2.0)
    graph, static_out = capture_forward(layer, static_x, static_logits)
    for _ in range(2):
        x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
        logits = randn(gen, m, e, device="cuda", scale=2.0)
        static_x.copy_(x)
        static_logits.copy_(logits)
        graph.replay()
        torch.cuda.synchronize()
        want, margin = reference(x, logits)
        check(static_out, want, margin, torch.bfloat16)
