"""Input builders shared by the tests: random tensors from a generator, weights, loaded layers."""
import contextlib

import torch

import moe_ext


def randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    """Normal random tensor drawn on the CPU from `gen` (same values on every device)."""
    t = torch.randn(*shape, generator=gen, dtype=torch.float32) * scale
    return t.to(dtype).to(device)


def expert_weights(gen, num_experts, hidden, inter, gated=True, has_bias=False,
                   dtype=torch.float32, device="cpu", scale=1.0):
    """Layer-layout weights {w13_weight, w2_weight[, w13_bias, w2_bias]} with unit-ish outputs."""
    rows = 2 * inter if gated else inter
    w = {
        "w13_weight": randn(gen, num_experts, rows, hidden, dtype=dtype, device=device,
                            scale=scale / hidden ** 0.5),
        "w2_weight": randn(gen, num_experts, hidden, inter, dtype=dtype, device=device,
                           scale=1.0 / inter ** 0.5),
    }
    if has_bias:
        w["w13_bias"] = randn(gen, num_experts, rows, dtype=dtype, device=device, scale=0.5)
        w["w2_bias"] = randn(gen, num_experts, hidden, dtype=dtype, device=device, scale=0.5)
    return w


def make_layer(weights, **kwargs):
    """A FusedMoE holding `weights` (copied in), after process_weights_after_loading()."""
    layer = moe_ext.FusedMoE(**kwargs)
    params = {n: p for n, p in layer.named_parameters() if not n.startswith("_shared_experts.")}
    assert set(params) == set(weights), f"{sorted(params)} != {sorted(weights)}"
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    layer.process_weights_after_loading()
    return layer


def keep_rows(margin):
    """Row mask of the tokens without routing near-ties (see reference.NEAR_TIE)."""
    from reference import NEAR_TIE
    return (margin >= NEAR_TIE).cpu()


def capture_forward(layer, static_x, static_logits, warmup=3):
    """Warms the layer up on a side stream, then captures one forward in a CUDA graph:
    (graph, static_out); replays read static_x / static_logits and write static_out."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            layer(static_x, static_logits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x, static_logits)
    return graph, static_out


def kernels_of(fn):
    """Names of the CUDA kernels that fn launches (profiler trace)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def replay(graph, static_x, static_logits, x, logits, static_out=None):
    """Replays a graph of capture_forward on x / logits (copied into its static inputs), with
    static_out poisoned with NaN first when given, and waits for it."""
    static_x.copy_(x)
    static_logits.copy_(logits)
    if static_out is not None:
        static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


@contextlib.contextmanager
def decode_fused(enabled):
    """Within the block the CUDA engine may (True) or may not (False) run a few-token forward as
    one launch (csrc/cuda/decode_fused.cu); the setting is restored after."""
    previous = moe_ext._C._set_decode_fused(enabled)
    try:
        yield
    finally:
        moe_ext._C._set_decode_fused(previous)


@contextlib.contextmanager
def down_splits(n):
    """Within the block the persistent Hopper kernel's GEMM2 runs exactly n k slices where K
    allows (n = 0: the kernel picks, gemm_configs.cuh mx_sm90_down_split); restored after."""
    previous = moe_ext._C._set_sm90_down_splits(n)
    try:
        yield
    finally:
        moe_ext._C._set_sm90_down_splits(previous)


def on_hopper():
    return torch.cuda.get_device_capability() == (9, 0)
