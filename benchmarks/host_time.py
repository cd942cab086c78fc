#!/usr/bin/env python3
"""Where one forward's host time goes (perf.md: CPU time of one call, kernels launched, not waited
for). For each point, the median CPU time of:

    module    layer(x, logits)                     (nn.Module.__call__ + FusedMoE.forward)
    forward   layer.forward(x, logits)             (no __call__)
    core      layer._core.forward(x, logits, ...)  (the one C call)
    alloc     two torch.empty of the output's and the workspace's size (the C call makes two)
    launch    one small torch kernel (x.add_(0) on a [1] tensor): a reference launch

and, with --api, the CUDA runtime and driver calls inside the core call (torch.profiler over
50 calls, CUPTI's own overhead included): per call name, calls per forward and CPU us each.

    python3 benchmarks/host_time.py qwen3moe/bf16/1 deepseekv3/fp8_block/1
"""
import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402


def core_call(layer, x, logits):
    """layer._core.forward's arguments as FusedMoE.forward passes them, as a closure."""
    p = layer._parameters
    s13, s2 = layer._fp8_scale_names
    args = (x, logits, p["w13_weight"], p["w2_weight"], p.get("w13_bias"), p.get("w2_bias"),
            p.get(s13), p.get(s2), layer.e_score_correction_bias, layer._expert_map)
    return lambda: layer._core.forward(*args)


def api_calls(fn, calls=50):
    """{CUDA API name: (calls per fn(), mean CPU us per call)} over `calls` calls of fn."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
    per_name = collections.defaultdict(list)
    for ev in prof.events():
        if ev.name.startswith("cu") and ev.device_type == torch.autograd.DeviceType.CPU:
            per_name[ev.name].append(ev.cpu_time_total)
    return {name: (len(ts) / calls, sum(ts) / len(ts)) for name, ts in per_name.items()}


def point(moe_ext, spec, api=False):
    model_name, dtype, tokens = spec.split("/")
    m, M = bench_moe.MODELS[model_name], int(tokens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(m.E, generator=gen, device="cuda") * 0.1 if m.correction_bias else None
    layer = bench_moe.fill_layer(bench_moe.new_layer(moe_ext, m, dtype, bias),
                                 bench_moe.make_weights(m, gen, "cuda"), m, dtype)
    x = torch.randn(M, m.H, generator=gen, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(M, m.E, generator=gen, device="cuda")
    one = torch.zeros(1, device="cuda")
    calls = {
        "module": lambda: layer(x, logits),
        "forward": lambda: layer.forward(x, logits),
        "core": core_call(layer, x, logits),
        "alloc": lambda: (torch.empty(M, m.H, device="cuda", dtype=torch.bfloat16),
                          torch.empty(1 << 20, device="cuda", dtype=torch.uint8)),
        "launch": lambda: one.add_(0),
    }
    result = {name: bench_moe.host_overhead_us(fn, iters=200) for name, fn in calls.items()}
    if api:
        result["api"] = api_calls(calls["core"])
    del layer
    torch.cuda.empty_cache()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("points", nargs="+", help="model/dtype/M, e.g. qwen3moe/bf16/1")
    parser.add_argument("--api", action="store_true", help="also list the CUDA API calls of a forward")
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args(argv)
    import moe_ext
    results = {}
    for spec in args.points:
        results[spec] = r = point(moe_ext, spec, args.api)
        print(f"{spec}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k != "api") + " us")
        for name, (per_call, us) in sorted(r.get("api", {}).items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            print(f"    {name}: {per_call:g} per forward, {us:.2f} us each")
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(0), "commit": bench_moe.git_commit()}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
