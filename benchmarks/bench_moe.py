#!/usr/bin/env python3
"""GPU benchmark of moe_ext.FusedMoE, following shared/spec/perf.md.

For each model of the perf grid and each dtype, one layer is built on the GPU (weights random
normal * 0.02) and, for each token count M, the whole forward `layer(x, router_logits)` (routing
included) is timed in a CUDA graph (median of >= 100 replays) and checked against a float32
reference of numerics.md computed here. The baselines `torch_loop` and `torch_grouped_mm` run on
the same inputs and weights. Copy bandwidth and the bf16 / fp8 matmul peaks are measured in the same
run.
Where one forward touches under 4x the L2 size of weights, every timed call rotates over enough
layer copies (sharing no memory) that each copy's weights have left L2 by its next turn.

Writes benchmarks/results/<date>-<gpu>-<commit>.json (after every model) and prints a table.

    python3 benchmarks/bench_moe.py --quick
    python3 benchmarks/bench_moe.py --models qwen3moe --tokens 1,64 \
        --previous benchmarks/results/2026-11-22-nvidia-h100-80gb-hbm3-abc1234.json
"""
import argparse
import datetime
import gc
import json
import math
import os
import re
import statistics
import subprocess
import time
import traceback
from dataclasses import dataclass
from itertools import cycle
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import triton
    from triton.testing import do_bench_cudagraph
except ImportError:
    triton = None

ROOT = Path(__file__).resolve().parent.parent
GRID_TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384)
QUICK_TOKENS = (1, 64, 1024, 16384)
DTYPES = ("bf16", "fp8_tensor", "fp8_block")
BASELINES = ("torch_loop", "torch_grouped_mm")
# bf16: float32 math on the same bf16 weights. fp8: checked against that same unquantized
# reference, so the numerics.md bound of "fp8 layer vs bf16 unquantized layer" applies.
TOLERANCE = {"bf16": 1.5e-2, "fp8_tensor": 8e-2, "fp8_block": 8e-2}
REF_ROWS = 256                 # tokens checked against the reference per point
MIN_REPLAYS = 100
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
MEMORY_RESERVE = 8 << 30       # bytes left free when adding rotation copies


@dataclass(frozen=True)
class Model:
    name: str
    E: int
    top_k: int
    H: int
    I: int
    scoring: str = "softmax"
    groups: int = 0
    topk_group: int = 0
    scaling: float = 1.0
    correction_bias: bool = False
    activation: str = "silu"
    has_bias: bool = False
    dtypes: tuple = DTYPES         # the dtypes run when --models is not given


MODELS = {m.name: m for m in (
    Model("mixtral", 8, 2, 4096, 14336),
    Model("qwen3moe", 128, 8, 2048, 768),
    Model("deepseekv3", 256, 8, 7168, 2048, scoring="sigmoid", groups=8, topk_group=4,
          scaling=2.5, correction_bias=True, dtypes=("fp8_tensor", "fp8_block")),
    Model("gptoss", 128, 4, 2880, 2880, activation="swigluoai", has_bias=True),
)}


# ---- weights, routing, reference and baselines (plain torch; any device) ----

def make_weights(m, gen, device):
    """bf16 expert weights {param name: tensor} in FusedMoE's layout, random normal * 0.02."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02)

    weights = {"w13_weight": rand(m.E, 2 * m.I, m.H), "w2_weight": rand(m.E, m.H, m.I)}
    if m.has_bias:
        weights["w13_bias"] = rand(m.E, 2 * m.I)
        weights["w2_bias"] = rand(m.E, m.H)
    return weights


def route(logits, m, correction_bias):
    """numerics.md routing in float32: (topk_weights [M, k] float32, topk_ids [M, k] int64).
    Every grid model renormalizes."""
    logits = logits.float()
    scores = logits.softmax(-1) if m.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if m.groups:
        per_group = m.E // m.groups
        grouped = choice.view(-1, m.groups, per_group)
        group_score = (grouped.topk(2, -1).values.sum(-1) if correction_bias is not None
                       else grouped.amax(-1))
        kept = group_score.topk(m.topk_group, -1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        keep = keep[:, :, None].expand(-1, -1, per_group).reshape(choice.shape)
        choice = choice.masked_fill(~keep, float("-inf"))
    topk_ids = choice.topk(m.top_k, -1).indices
    topk_weights = scores.gather(1, topk_ids)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    return topk_weights * m.scaling, topk_ids


def activation(h, m):
    """Gated activation of h [rows, 2I] -> [rows, I] (swigluoai: gate/up interleaved)."""
    if m.activation == "swigluoai":
        gate = h[:, 0::2].clamp(max=SWIGLU_LIMIT)
        up = h[:, 1::2].clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        return (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
    return F.silu(h[:, :m.I]) * h[:, m.I:]


def reference(x, logits, m, weights, correction_bias):
    """numerics.md in float32 on the bf16 weights, with per-expert float32 matmuls; the activation
    output is rounded to bf16 before the second GEMM. Returns float32 [M, H]."""
    topk_weights, topk_ids = route(logits, m, correction_bias)
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = xf[tok] @ weights["w13_weight"][e].float().T
        if m.has_bias:
            h += weights["w13_bias"][e].float()
        a = activation(h, m).to(torch.bfloat16).float()
        y = a @ weights["w2_weight"][e].float().T
        if m.has_bias:
            y += weights["w2_bias"][e].float()
        out.index_add_(0, tok, y * topk_weights[tok, slot, None])
    return out


def torch_loop(x, logits, m, weights, correction_bias):
    """Plain PyTorch: route, then per expert gather its tokens, two matmuls, activation and a
    weighted index_add_. The per-expert token counts are read on the host (one sync)."""
    topk_weights, topk_ids = route(logits, m, correction_bias)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort()
    counts = torch.bincount(flat_ids, minlength=m.E).tolist()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, slots in enumerate(order.split(counts)):
        if slots.numel() == 0:
            continue
        tok = slots // m.top_k
        h = x[tok] @ weights["w13_weight"][e].T
        if m.has_bias:
            h += weights["w13_bias"][e]
        y = activation(h, m) @ weights["w2_weight"][e].T
        if m.has_bias:
            y += weights["w2_bias"][e]
        out.index_add_(0, tok, y.float() * topk_weights.flatten()[slots, None])
    return out.to(x.dtype)


def torch_grouped_mm(x, logits, m, weights, correction_bias):
    """torch._grouped_mm over the token copies sorted by expert, with device-side offsets: no
    host sync, so it is timed in a CUDA graph like ours."""
    topk_weights, topk_ids = route(logits, m, correction_bias)
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort()
    expert = flat_ids[order]
    counts = torch.zeros(m.E, dtype=torch.int64, device=x.device)
    offs = counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids)).cumsum(0).to(torch.int32)
    tok = order // m.top_k
    h = torch._grouped_mm(x[tok], weights["w13_weight"].transpose(1, 2), offs=offs)
    if m.has_bias:
        h += weights["w13_bias"][expert]
    y = torch._grouped_mm(activation(h, m), weights["w2_weight"].transpose(1, 2), offs=offs)
    if m.has_bias:
        y += weights["w2_bias"][expert]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y.float() * topk_weights.flatten()[order, None])
    return out.to(x.dtype)


BASELINE_FNS = {"torch_loop": torch_loop, "torch_grouped_mm": torch_grouped_mm}


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float32; None when out holds NaN or inf."""
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return err if math.isfinite(err) else None


def git_commit():
    """Short commit of the checkout, or $MOE_EXT_COMMIT where the tree travels without .git."""
    if os.environ.get("MOE_EXT_COMMIT"):
        return os.environ["MOE_EXT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


# ---- timing ----

def time_events(fn, iters):
    """Median milliseconds of fn over iters calls, each between two CUDA events."""
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph(fn):
    """Median milliseconds of one fn() from CUDA-graph replays, >= MIN_REPLAYS calls in all."""
    fn()
    torch.cuda.synchronize()
    estimate = max(time_events(fn, 3), 1e-3)
    # Both paths unroll `calls` calls of fn into one graph and take the median of 10 replays.
    calls = max(MIN_REPLAYS // 10, math.ceil(10.0 / estimate))
    if triton is not None:
        # do_bench_cudagraph unrolls int(rep / its own estimate) calls; 1.5x leaves room for noise.
        return do_bench_cudagraph(fn, rep=1.5 * calls * estimate, return_mode="median")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    ms = time_events(graph.replay, 10) / calls
    del graph
    return ms


def host_overhead_us(fn, iters=50):
    """Median CPU time of one call of fn (kernels launched, not waited for), in microseconds."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def measure_ceilings():
    """Device-to-device copy bandwidth (4 GiB, bytes read + written) and streaming-read bandwidth
    (a sum over the same 4 GiB) in TB/s, and the bf16 and fp8
    (torch._scaled_mm, per-tensor scales) 8192^3 matmul peaks in TFLOP/s."""
    src = torch.randn(1 << 30, device="cuda")
    dst = torch.empty_like(src)
    # One copy per graph replay, median of 20: a 4 GiB copy needs no unrolling.
    dst.copy_(src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dst.copy_(src)
    graph.replay()
    read_tbps = 2 * src.nbytes / time_events(graph.replay, 20) / 1e9
    # streaming read (a sum over the same 4 GiB): the read bandwidth of issue 5's decode roofline
    total = torch.empty((), device="cuda")
    torch.sum(src, dim=0, out=total)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.sum(src, dim=0, out=total)
    graph.replay()
    stream_read_tbps = src.nbytes / time_events(graph.replay, 20) / 1e9
    del graph
    del src, dst
    n = 8192
    flops = 2 * n ** 3
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    bf16_tflops = flops / time_graph(lambda: torch.matmul(a, b, out=c)) / 1e9
    fp8_tflops = None
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t()   # _scaled_mm wants its second operand column-major
        one = torch.ones((), device="cuda")
        fp8_tflops = flops / time_graph(lambda: torch._scaled_mm(
            a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e9
    except (AttributeError, RuntimeError) as err:
        print(f"fp8 peak not measured: {err}", flush=True)
    return {"read_tbps": read_tbps, "stream_read_tbps": stream_read_tbps, "bf16_tflops": bf16_tflops,
            "fp8_tflops": fp8_tflops}


# ---- moe_ext layers ----

def new_layer(moe_ext, m, dtype, correction_bias, device="cuda"):
    """An empty moe_ext.FusedMoE for model m (fp8 dtypes: online FP8 quantization)."""
    quant_config = None
    if dtype != "bf16":
        quant_config = moe_ext.Fp8OnlineConfig(
            weight_block_size=[128, 128] if dtype == "fp8_block" else None)
    return moe_ext.FusedMoE(
        num_experts=m.E, top_k=m.top_k, hidden_size=m.H, intermediate_size=m.I,
        params_dtype=torch.bfloat16, renormalize=True, use_grouped_topk=m.groups > 0,
        num_expert_group=m.groups or None, topk_group=m.topk_group or None,
        quant_config=quant_config, scoring_func=m.scoring, routed_scaling_factor=m.scaling,
        e_score_correction_bias=correction_bias, activation=m.activation, has_bias=m.has_bias,
        device=device)


def fill_layer(layer, weights, m, dtype):
    """bf16: copy into the parameters. fp8: load every expert's w1/w3/w2 through the weight
    loader (w1 = gate rows, w3 = up rows; interleaved for swigluoai), which quantizes."""
    if dtype == "bf16":
        for name, tensor in weights.items():
            getattr(layer, name).data.copy_(tensor)
    else:
        for kind in ("weight", "bias") if m.has_bias else ("weight",):
            w13, w2 = weights[f"w13_{kind}"], weights[f"w2_{kind}"]
            for e in range(m.E):
                gate, up = ((w13[e, 0::2], w13[e, 1::2]) if m.activation == "swigluoai"
                            else (w13[e, :m.I], w13[e, m.I:]))
                for shard, tensor in (("w1", gate), ("w3", up)):
                    layer.weight_loader(getattr(layer, f"w13_{kind}"), tensor,
                                        f"experts.w13_{kind}", shard_id=shard, expert_id=e)
                layer.weight_loader(getattr(layer, f"w2_{kind}"), w2[e], f"experts.w2_{kind}",
                                    shard_id="w2", expert_id=e)
    layer.process_weights_after_loading()
    return layer


def layer_bytes(layer):
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def row_major_params(moe_ext, layer):
    """The layer's parameters as the baselines read them: w13 / w2 row-major (copies where
    process_weights_after_loading packed them, moe_ext/packing.py)."""
    params = dict(layer.named_parameters())
    for name in ("w13_weight", "w2_weight"):
        params[name] = moe_ext.packing.row_major(layer, name)
    return params


def touched_weights(m, dtype, logits, correction_bias):
    """(experts the routing of logits hits, their weight bytes in dtype, biases included)."""
    hit = route(logits, m, correction_bias)[1].unique().numel()
    per_expert = 3 * m.H * m.I + (2 * m.I + m.H if m.has_bias else 0)
    return hit, hit * per_expert * (2 if dtype == "bf16" else 1)


def copies_needed(weight_bytes, one_layer_bytes, held, l2_bytes):
    """Layer copies to rotate over so that the weights touched add up to 4x L2, as far as free
    memory (less MEMORY_RESERVE) allows."""
    wanted = math.ceil(4 * l2_bytes / weight_bytes)
    affordable = held + max(0, torch.cuda.mem_get_info()[0] - MEMORY_RESERVE) // one_layer_bytes
    return max(1, min(wanted, affordable))


# ---- one point ----

def blank_point(model, dtype, M, method, status="ok", error=None):
    point = {"model": model, "dtype": dtype, "M": M, "method": method, "status": status,
             "us": None, "rel_err": None, "within_tol": None, "tbps": None, "tflops": None,
             "pct_copy_bw": None, "pct_peak": None, "timing": None}
    if error:
        point["error"] = error
    return point


class Case:
    """The inputs of one (model, dtype, M) point, its reference rows and its work counts."""

    def __init__(self, m, dtype, M, gen, weights, correction_bias, ceilings):
        self.m, self.dtype, self.M, self.ceilings = m, dtype, M, ceilings
        self.x = torch.randn(M, m.H, generator=gen, device="cuda", dtype=torch.bfloat16)
        self.logits = torch.randn(M, m.E, generator=gen, device="cuda")
        self.rows = (torch.randperm(M, generator=gen, device="cuda")[:REF_ROWS].sort().values
                     if M > REF_ROWS else slice(None))
        self.ref = reference(self.x[self.rows], self.logits[self.rows], m, weights,
                             correction_bias)
        self.experts_hit, self.weight_bytes = touched_weights(m, dtype, self.logits, correction_bias)
        self.flops = 2 * M * m.top_k * 3 * m.H * m.I

    def point(self, method, copies):
        return {**blank_point(self.m.name, self.dtype, self.M, method),
                "experts_hit": self.experts_hit, "weight_bytes": self.weight_bytes,
                "weight_copies": copies}

    def rates(self, ms, peak_name):
        us = ms * 1e3
        tbps = self.weight_bytes / us / 1e6
        tflops = self.flops / us / 1e6
        peak = self.ceilings[peak_name]
        return {"us": us, "tbps": tbps, "tflops": tflops,
                "pct_copy_bw": 100 * tbps / self.ceilings["read_tbps"],
                "pct_peak": 100 * tflops / peak if peak else None}


def measure(case, method, call, weight_sets, graph):
    """One point: rel_err of call(weight_sets[0]) on the reference rows, then the median time of
    one call rotating over weight_sets, in a CUDA graph or (graph=False) with CUDA events."""
    point = case.point(method, len(weight_sets))
    try:
        out = call(weight_sets[0])
        point["rel_err"] = rel_err(out[case.rows], case.ref)
        point["within_tol"] = point["rel_err"] is not None and \
            point["rel_err"] <= TOLERANCE[case.dtype]
        del out
        if graph:
            ms = time_graph(lambda: [call(w) for w in weight_sets]) / len(weight_sets)
            timing = ("CUDA graph (" + ("triton do_bench_cudagraph" if triton else
                                        "torch.cuda.CUDAGraph + events")
                      + f"), median over >= {MIN_REPLAYS} replays")
        else:
            rotation = cycle(weight_sets)
            estimate = time_events(lambda: call(next(rotation)), 2)
            iters = min(50, max(10, int(300 / estimate)))
            ms = time_events(lambda: call(next(rotation)), iters)
            timing = (f"CUDA events, no graph (data-dependent shapes, host sync): median of "
                      f"{iters} calls")
        peak_name = "bf16_tflops" if case.dtype == "bf16" else "fp8_tflops"
        point.update(case.rates(ms, peak_name))
        point["timing"] = timing + f", rotating over {len(weight_sets)} weight copies"
    except NotImplementedError as err:
        point.update(status="not_implemented", error=str(err))
    except Exception as err:  # one failed point must not lose the rest of the run
        point.update(status="error", error=f"{type(err).__name__}: {err}")
    return point


def bench_model(moe_ext, m, dtype, tokens, baselines, ctx, points):
    """Appends the points of one (model, dtype) to points as they are measured."""
    def skipped_baselines(M):
        return [blank_point(m.name, dtype, M, b, "skipped", "baselines are timed for bf16 only")
                for b in baselines]

    gen = torch.Generator(device="cuda").manual_seed(0)
    correction_bias = (torch.randn(m.E, generator=gen, device="cuda") * 0.1
                       if m.correction_bias else None)
    try:
        layers = [new_layer(moe_ext, m, dtype, correction_bias)]
        weights = make_weights(m, gen, "cuda")
        fill_layer(layers[0], weights, m, dtype)
    except NotImplementedError as err:
        for M in tokens:
            points.append(blank_point(m.name, dtype, M, "moe_ext", "not_implemented", str(err)))
            points += skipped_baselines(M) if dtype != "bf16" else []
        return

    one_layer_bytes = layer_bytes(layers[0])
    for M in tokens:
        case = Case(m, dtype, M, gen, weights, correction_bias, ctx["ceilings"])
        copies = copies_needed(case.weight_bytes, one_layer_bytes, len(layers), ctx["l2_bytes"])
        del layers[copies:]
        while len(layers) < copies:
            layers.append(fill_layer(new_layer(moe_ext, m, dtype, correction_bias), weights, m,
                                     dtype))
        ours = measure(case, "moe_ext", lambda layer: layer(case.x, case.logits), layers,
                       graph=True)
        ours["weights_packed"] = layers[0].weights_packed
        if M == tokens[0] and ours["status"] == "ok":
            ours["host_us"] = host_overhead_us(lambda: layers[0](case.x, case.logits))
        previous_us = ctx["previous"].get((m.name, dtype, M))
        if ours["us"] and previous_us:
            ours["previous_us"] = previous_us
            ours["speedup_vs_previous"] = previous_us / ours["us"]
        row = [ours]
        if dtype == "bf16":
            param_sets = [row_major_params(moe_ext, layer) for layer in layers]
            for name in baselines:
                row.append(bench_baseline(case, name, param_sets, correction_bias))
                if ours["us"] and row[-1].get("us"):
                    ours[f"speedup_vs_{name}"] = row[-1]["us"] / ours["us"]
            del param_sets
        else:
            row += skipped_baselines(M)
        points += row
        print("  ".join(format_point(p) for p in row), flush=True)
        del case
        gc.collect()
        torch.cuda.empty_cache()
    del layers, weights


def bench_baseline(case, name, param_sets, correction_bias):
    """The point of baseline `name`; torch_loop has data-dependent shapes, so no graph."""
    if name == "torch_grouped_mm" and not hasattr(torch, "_grouped_mm"):
        return blank_point(case.m.name, case.dtype, case.M, name, "unsupported",
                           "torch._grouped_mm is missing")
    fn = BASELINE_FNS[name]
    return measure(case, name, lambda w: fn(case.x, case.logits, case.m, w, correction_bias),
                   param_sets, graph=name != "torch_loop")


# ---- output ----

def format_point(p):
    """One short progress line of a point."""
    head = f"{p['model']}/{p['dtype']}/M={p['M']}/{p['method']}"
    if p.get("us") is None:
        return f"{head}: {p['status']}"
    err = "nan" if p["rel_err"] is None else f"{p['rel_err']:.1e}"
    return f"{head}: {p['us']:.1f} us (err {err})"


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def print_table(meta, points):
    c = meta["ceilings"]
    print(f"\n{meta['gpu']}  torch {meta['torch']}  commit {meta['commit']}  copy "
          f"{c['read_tbps']:.2f} TB/s  stream read {c['stream_read_tbps']:.2f} TB/s  bf16 {c['bf16_tflops']:.0f} TFLOP/s  fp8 "
          f"{fmt(c['fp8_tflops'], '.0f')} TFLOP/s")
    print(f"{'model':<11}{'dtype':<11}{'M':>6}{'us':>10}{'TB/s':>7}{'TFLOP/s':>9}"
          f"{'x loop':>8}{'x gmm':>8}{'x prev':>8}{'rel_err':>9}  check")
    for p in points:
        if p["method"] != "moe_ext":
            continue
        head = f"{p['model']:<11}{p['dtype']:<11}{str(p['M']):>6}"
        if p.get("us") is None:
            print(f"{head}  {p['status']}: {p.get('error', '')[:70]}")
            continue
        check = "OK" if p["within_tol"] else "FAIL"
        print(f"{head}{p['us']:>10.1f}{p['tbps']:>7.2f}{p['tflops']:>9.1f}"
              f"{fmt(p.get('speedup_vs_torch_loop'), '.2f'):>8}"
              f"{fmt(p.get('speedup_vs_torch_grouped_mm'), '.2f'):>8}"
              f"{fmt(p.get('speedup_vs_previous'), '.2f'):>8}"
              f"{fmt(p['rel_err'], '.1e'):>9}  {check}")
    for p in points:
        if p["method"] != "moe_ext" and p["status"] not in ("ok", "skipped"):
            print(f"{format_point(p)}: {p.get('error', '')[:100]}")
        elif p["method"] != "moe_ext" and p.get("within_tol") is False:
            print(f"{format_point(p)}: over the tolerance")
    for p in points:
        if p.get("host_us") is not None:
            print(f"host overhead {p['model']}/{p['dtype']} M={p['M']}: {p['host_us']:.1f} us")


def result_path(stem):
    """benchmarks/results/<stem>.json, or <stem>-2.json, ...: earlier files are the performance
    history, never overwritten."""
    path = ROOT / "benchmarks" / "results" / f"{stem}.json"
    n = 2
    while path.exists():
        path = path.with_name(f"{stem}-{n}.json")
        n += 1
    return path


def load_previous(path):
    """{(model, dtype, M): us} of moe_ext points in an earlier result file."""
    if not path:
        return {}
    with open(path) as f:
        points = json.load(f)["points"]
    return {(p["model"], p["dtype"], p["M"]): p["us"] for p in points
            if p["method"] == "moe_ext" and p.get("us")}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help=f"comma-separated, of {','.join(MODELS)} (default: every "
                        "model with a default dtype among --dtypes; deepseekv3 is fp8 only)")
    parser.add_argument("--dtypes", default="bf16", help=f"comma-separated, of {','.join(DTYPES)}"
                        " (default bf16)")
    parser.add_argument("--tokens", help="comma-separated token counts M (default: "
                        f"{','.join(map(str, GRID_TOKENS))})")
    parser.add_argument("--baselines", default=",".join(BASELINES),
                        help=f"comma-separated, of {','.join(BASELINES)} (default both; '' none)")
    parser.add_argument("--quick", action="store_true",
                        help=f"M in {{{','.join(map(str, QUICK_TOKENS))}}} only")
    parser.add_argument("--out", help="result JSON (default benchmarks/results/"
                        "<date>-<gpu>-<short commit>.json)")
    parser.add_argument("--previous", help="an earlier result JSON: report our speedup over it")
    parser.add_argument("--no-decode-fused", action="store_true",
                        help="run every forward on the multi-launch pipeline (no one-launch decode)")
    args = parser.parse_args(argv)

    def listed(text, allowed, what):
        items = [s.strip() for s in text.split(",") if s.strip()]
        for item in items:
            if item not in allowed:
                parser.error(f"{what}: unknown {item!r} (expected one of {', '.join(allowed)})")
        return items

    args.dtypes = listed(args.dtypes, DTYPES, "--dtypes")
    args.baselines = listed(args.baselines, BASELINES, "--baselines")
    if args.models:
        args.runs = [(name, d) for name in listed(args.models, MODELS, "--models")
                     for d in args.dtypes]
    else:
        args.runs = [(m.name, d) for m in MODELS.values() for d in args.dtypes if d in m.dtypes]
    if args.quick:
        args.tokens = list(QUICK_TOKENS)
    elif args.tokens:
        try:
            args.tokens = sorted({int(t) for t in args.tokens.split(",") if t.strip()})
        except ValueError:
            parser.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
        if not args.tokens or args.tokens[0] < 1:
            parser.error("--tokens: token counts must be >= 1")
    else:
        args.tokens = list(GRID_TOKENS)
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe.py needs a CUDA GPU (see bench_cpu.py for the CPU figure)")
    import moe_ext
    if not moe_ext.cuda_available():
        raise SystemExit("moe_ext was built without its CUDA engine")
    torch.set_float32_matmul_precision("highest")   # the float32 reference must not use TF32
    if args.no_decode_fused:
        moe_ext._C._set_decode_fused(False)

    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "commit": git_commit(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__ if triton else None, "l2_bytes": props.L2_cache_size,
            "sms": props.multi_processor_count, "tokens": args.tokens,
            "decode_fused": not args.no_decode_fused,
            "previous": args.previous}
    print(f"{meta['gpu']}: measuring ceilings", flush=True)
    meta["ceilings"] = measure_ceilings()
    print(json.dumps(meta["ceilings"]), flush=True)
    ctx = {"ceilings": meta["ceilings"], "l2_bytes": props.L2_cache_size,
           "previous": load_previous(args.previous)}
    gpu = re.sub(r"[^a-z0-9]+", "-", meta["gpu"].lower()).strip("-")
    out = Path(args.out) if args.out else result_path(f"{meta['date']}-{gpu}-{meta['commit']}")
    out.parent.mkdir(parents=True, exist_ok=True)

    points = []
    for name, dtype in args.runs:
        print(f"== {name} {dtype}", flush=True)
        try:
            bench_model(moe_ext, MODELS[name], dtype, args.tokens, args.baselines, ctx, points)
        except Exception as err:  # e.g. out of memory: keep the points so far, go on
            traceback.print_exc()
            points.append(blank_point(name, dtype, None, "moe_ext", "error",
                                      f"{type(err).__name__}: {err}"))
        gc.collect()
        torch.cuda.empty_cache()
        with open(out, "w") as f:   # after every model, so a cut-off run keeps what it measured
            json.dump({"meta": meta, "points": points}, f, indent=1)
    print_table(meta, points)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
