#!/usr/bin/env python3
"""Where one forward's GPU time goes: per-kernel times (torch.profiler, CUPTI) of
moe_ext.FusedMoE on points of the perf grid, next to the CUDA-graph time of the whole forward
(bench_moe.py's method, the same layer copies rotated so weights come from DRAM).

    python3 benchmarks/profile_layer.py qwen3moe/bf16/1 mixtral/fp8_tensor/64

The profiled forwards replay from a CUDA graph, so kernels follow each other as in the benchmark.
Prints, per point: graph us, host us, and per kernel (in stream order) its mean duration and its
share of the critical path: end minus the later of its start and the previous kernel's end. A
kernel launched dependent may start before the kernel ahead of it ends; its duration then counts
its waiting time, its share does not, and the shares add up to the forward's GPU time. Writes the
same as JSON with --out. With --eager the points' forwards only run, 4 times each, for an outside
profiler:

    ncu --kernel-name regex:decode --launch-skip 2 --launch-count 1 \
        python3 benchmarks/profile_layer.py --eager qwen3moe/bf16/512
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402

ITERS = 20


def short_name(name):
    """The kernel's name without its namespace and argument list, with template arguments."""
    name = name.replace("(anonymous namespace)::", "")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            cut = i
            break
    return name[:cut].replace("void ", "")


def build_point(moe_ext, spec, l2_bytes):
    """(layers to rotate, x, logits, weight bytes touched) of one model/dtype/M point."""
    model_name, dtype, tokens = spec.split("/")
    m, M = bench_moe.MODELS[model_name], int(tokens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(m.E, generator=gen, device="cuda") * 0.1 if m.correction_bias else None
    weights = bench_moe.make_weights(m, gen, "cuda")
    layers = [bench_moe.fill_layer(bench_moe.new_layer(moe_ext, m, dtype, bias), weights, m, dtype)]
    x = torch.randn(M, m.H, generator=gen, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(M, m.E, generator=gen, device="cuda")
    _, touched = bench_moe.touched_weights(m, dtype, logits, bias)
    copies = bench_moe.copies_needed(touched, bench_moe.layer_bytes(layers[0]), 1, l2_bytes)
    while len(layers) < copies:
        layers.append(bench_moe.fill_layer(bench_moe.new_layer(moe_ext, m, dtype, bias), weights, m,
                                           dtype))
    return layers, x, logits, touched


def kernel_shares(events, forwards):
    """{kernel: [mean duration us, mean critical-path share us]} over the profiled kernels, in
    stream order (one stream: sorted by start)."""
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    table = {}
    previous_end = None
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        share = end - (start if previous_end is None else max(start, previous_end))
        row = table.setdefault(short_name(e.name), [0.0, 0.0])
        row[0] += (end - start) / forwards
        row[1] += share / forwards
        previous_end = end if previous_end is None else max(end, previous_end)
    return table


def profile_point(moe_ext, spec, l2_bytes):
    layers, x, logits, touched = build_point(moe_ext, spec, l2_bytes)
    copies = len(layers)
    forward_all = lambda: [layer(x, logits) for layer in layers]  # noqa: E731
    graph_us = 1e3 * bench_moe.time_graph(forward_all) / copies
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward_all()
    replays = max(1, ITERS // copies)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per_kernel = kernel_shares(prof.events(), replays * copies)
    host_us = bench_moe.host_overhead_us(lambda: layers[0](x, logits))
    del graph, layers
    torch.cuda.empty_cache()
    return {"point": spec, "graph_us": graph_us, "host_us": host_us, "weight_bytes": touched,
            "copies": copies, "kernel_share_sum_us": sum(v[1] for v in per_kernel.values()),
            "kernels": {name: {"duration_us": d, "share_us": sh} for name, (d, sh) in per_kernel.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", nargs="+", help="model/dtype/M, e.g. qwen3moe/bf16/1")
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--eager", action="store_true", help="only run 4 forwards per point")
    args = parser.parse_args(argv)
    import moe_ext
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    if args.eager:
        for spec in args.points:
            layers, x, logits, _ = build_point(moe_ext, spec, l2_bytes)
            for i in range(4):
                layers[i % len(layers)](x, logits)
            torch.cuda.synchronize()
            del layers
        return
    results = []
    for spec in args.points:
        r = profile_point(moe_ext, spec, l2_bytes)
        results.append(r)
        print(f"{spec}: graph {r['graph_us']:.1f} us, shares {r['kernel_share_sum_us']:.1f} us, "
              f"host {r['host_us']:.1f} us ({r['copies']} copies); duration / share us:")
        for name, k in r["kernels"].items():
            print(f"    {k['duration_us']:7.1f} {k['share_us']:7.1f}  {name}")
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(0), "commit": bench_moe.git_commit()}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
