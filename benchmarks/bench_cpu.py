#!/usr/bin/env python3
"""CPU figure: a Qwen3-MoE-shaped layer (E=128, top_k=8, H=2048, I=768) on 32 tokens in bf16, on
the CPU with 2 threads. Times moe_ext.FusedMoE and the plain-PyTorch torch_loop baseline (median
of >= 10 runs after warm-up), checks both against the float32 reference of numerics.md, prints one
line and writes benchmarks/results/<date>-cpu-<short commit>.json.

    python3 benchmarks/bench_cpu.py [--threads 2] [--tokens 32] [--runs 10] [--out PATH]
"""
import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2,
                        help="torch and OpenMP threads (default 2)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens M (default 32)")
    parser.add_argument("--runs", type=int, default=10, help="timed runs, >= 10 (default 10)")
    parser.add_argument("--out", help="result JSON (default benchmarks/results/"
                        "<date>-cpu-<short commit>.json)")
    args = parser.parse_args()
    if args.threads < 1 or args.tokens < 1 or args.runs < 10:
        parser.error("--threads and --tokens must be >= 1, --runs >= 10")
    return args


def cpu_model_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def median_us(fn, runs):
    """Median wall time of fn in microseconds over runs calls, after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    args = parse_args()
    # OpenMP reads OMP_NUM_THREADS once, when its runtime starts: set it before torch and moe_ext
    # (whose CPU engine uses OpenMP) are loaded.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    import moe_ext
    from bench_moe import (MODELS, TOLERANCE, fill_layer, git_commit, make_weights, new_layer,
                           reference, rel_err, result_path, route, torch_loop)
    torch.set_num_threads(args.threads)

    m = MODELS["qwen3moe"]
    gen = torch.Generator().manual_seed(0)
    weights = make_weights(m, gen, "cpu")
    layer = fill_layer(new_layer(moe_ext, m, "bf16", None, device="cpu"), weights, m, "bf16")
    x = torch.randn(args.tokens, m.H, generator=gen, dtype=torch.bfloat16)
    logits = torch.randn(args.tokens, m.E, generator=gen)
    ref = reference(x, logits, m, weights, None)
    experts_hit = route(logits, m, None)[1].unique().numel()
    weight_bytes = experts_hit * 3 * m.H * m.I * 2
    flops = 2 * args.tokens * m.top_k * 3 * m.H * m.I

    points = []
    for method, fn in (("moe_ext", lambda: layer(x, logits)),
                       ("torch_loop", lambda: torch_loop(x, logits, m, weights, None))):
        err = rel_err(fn(), ref)
        us = median_us(fn, args.runs)
        points.append({"model": m.name, "dtype": "bf16", "M": args.tokens, "method": method,
                       "status": "ok", "us": us, "rel_err": err,
                       "within_tol": err is not None and err <= TOLERANCE["bf16"],
                       "tbps": weight_bytes / us / 1e6, "tflops": flops / us / 1e6,
                       "timing": f"wall clock, median of {args.runs} runs after 2 warm-up runs",
                       "experts_hit": experts_hit, "weight_bytes": weight_bytes})
    ours, loop = points
    ours["speedup_vs_torch_loop"] = loop["us"] / ours["us"]

    meta = {"cpu": cpu_model_name(), "threads": args.threads,
            "omp_num_threads": os.environ["OMP_NUM_THREADS"], "commit": git_commit(),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__}
    out = Path(args.out) if args.out else result_path(f"{meta['date']}-cpu-{meta['commit']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "points": points}, f, indent=1)

    def describe(p):
        err = "nan" if p["rel_err"] is None else f"{p['rel_err']:.1e}"
        check = "OK" if p["within_tol"] else "FAIL"
        return f"{p['method']} {p['us']:.0f} us (rel_err {err} {check})"

    print(f"{meta['cpu']}, {args.threads} threads: {m.name} bf16 M={args.tokens}: "
          f"{describe(ours)}, {describe(loop)}; moe_ext x{ours['speedup_vs_torch_loop']:.2f} "
          f"vs torch_loop  -> {out}")


if __name__ == "__main__":
    main()
