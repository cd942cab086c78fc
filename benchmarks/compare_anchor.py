"""Issue 5's scorecard for a bench_moe.py result: speed against the anchor (vLLM's Triton
fused_moe_kernel with its tuned H200 configs, as the issue records it, routing and sort NOT
included there), the decode roofline test and the prefill TFLOP/s targets.

    python3 benchmarks/compare_anchor.py benchmarks/results/<file>.json [--per-model]

--per-model adds, per model and dtype, a table of us, TB/s (weight bytes touched over time),
TFLOP/s and x anchor at every M (the table issue 5's closing note carries).

Only meaningful for results taken on an H200 (the anchor's GPU). The decode roofline is
max(weight bytes / streaming-read bandwidth, FLOPs / matmul peak) with both ceilings from the
result's own run (`stream_read_tbps`; older files without it fall back to the copy figure)."""
import argparse
import json
import math

TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384)
# issue 5, microseconds per forward on an H200
ANCHOR = {
    ("mixtral", "bf16"): (178, 486, 669, 648, 666, 720, 972, 1535, 5051, 18743),
    ("mixtral", "fp8_tensor"): (118, 283, 353, 354, 365, 418, 574, 916, 2991, 11140),
    ("mixtral", "fp8_block"): (144, 303, 376, 387, 410, 568, 886, 1544, 5548, 21055),
    ("qwen3moe", "bf16"): (29.3, 121, 257, 286, 298, 319, 319, 376, 815, 2686),
    ("qwen3moe", "fp8_tensor"): (29.5, 87.3, 151, 172, 178, 194, 197, 242, 572, 1943),
    ("qwen3moe", "fp8_block"): (27.8, 83.1, 150, 163, 172, 207, 229, 314, 911, 3285),
    ("deepseekv3", "fp8_tensor"): (136, 809, 2236, 3090, 3452, 3612, 4645, 4958, 12720, 44107),
    ("deepseekv3", "fp8_block"): (103, 602, 1648, 2272, 2537, 2787, 2978, 3210, 6719, 21998),
    ("gptoss", "bf16"): (59.1, 331, 1184, 1336, 1395, 1633, 1669, 1585, 2407, 6723),
}
# issue 5's prefill targets at M = 16384, TFLOP/s
PREFILL_TARGETS = {("mixtral", "bf16"): 650, ("qwen3moe", "bf16"): 560, ("mixtral", "fp8_tensor"): 1050,
                   ("deepseekv3", "fp8_block"): 900}


def load(path):
    with open(path) as f:
        result = json.load(f)
    points = {(p["model"], p["dtype"], p["M"]): p for p in result["points"]
              if p["method"] == "moe_ext" and p.get("us") is not None}
    return result["meta"], points


def roofline_us(point, ceilings):
    read = ceilings.get("stream_read_tbps") or ceilings["read_tbps"]
    peak = ceilings["bf16_tflops"] if point["dtype"] == "bf16" else ceilings["fp8_tflops"]
    flops = point["tflops"] * 1e12 * point["us"] * 1e-6
    return max(point["weight_bytes"] / (read * 1e12), flops / (peak * 1e12)) * 1e6


def geometric_mean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def per_model_tables(points):
    """Markdown, per (model, dtype): us, TB/s, TFLOP/s and x anchor at each M."""
    for (model, dtype), anchor in ANCHOR.items():
        cols = [(m, a, points.get((model, dtype, m))) for m, a in zip(TOKENS, anchor)]
        cols = [(m, a, p) for m, a, p in cols if p is not None]
        if not cols:
            continue
        print(f"\n{model}, {dtype}\n")
        print("| M | " + " | ".join(str(m) for m, _, _ in cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        print("| us | " + " | ".join(f"{p['us']:.1f}" for _, _, p in cols) + " |")
        print("| TB/s | " + " | ".join(f"{p['tbps']:.2f}" for _, _, p in cols) + " |")
        print("| TFLOP/s | " + " | ".join(f"{p['tflops']:.1f}" for _, _, p in cols) + " |")
        print("| x anchor | " + " | ".join(f"{a / p['us']:.2f}" for _, a, p in cols) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result")
    parser.add_argument("--per-model", action="store_true", help="add the per-model tables")
    args = parser.parse_args()
    meta, points = load(args.result)
    c = meta["ceilings"]
    print(f"{meta['gpu']}  commit {meta['commit']}  copy {c['read_tbps']:.2f} TB/s  stream read "
          f"{c.get('stream_read_tbps') or float('nan'):.2f} TB/s  bf16 {c['bf16_tflops']:.0f}  fp8 "
          f"{c['fp8_tflops']:.0f} TFLOP/s\n")
    print("| model, dtype | " + " | ".join(str(m) for m in TOKENS) + " |")
    print("|---" * (len(TOKENS) + 1) + "|")
    ratios, at_roofline, wins, decode_fail, decode_total = [], [], 0, [], 0
    for (model, dtype), anchor in ANCHOR.items():
        cells = []
        for m, a in zip(TOKENS, anchor):
            p = points.get((model, dtype, m))
            if p is None:
                cells.append("-")
                continue
            x = a / p["us"]
            ratios.append(x)
            at_roofline.append(a / roofline_us(p, c))
            wins += x >= 1.0
            cells.append(f"{x:.2f}")
            if m <= 64:
                decode_total += 1
                bound = 1.1 * roofline_us(p, c) + 3.0
                if p["us"] > bound:
                    decode_fail.append(f"{model}/{dtype}/M={m}: {p['us']:.1f} us > {bound:.1f}")
        print(f"| {model}, {dtype} | " + " | ".join(cells) + " |")
    if ratios:
        geo = geometric_mean(ratios)
        print(f"\nx anchor: geometric mean {geo:.2f} over {len(ratios)} points; {wins} at or above 1.0")
        ceiling = geometric_mean(at_roofline)
        print(f"a forward at its roofline at every point would score {ceiling:.2f}; this run is at "
              f"{geo / ceiling:.2f} of that ({sum(r < 1.25 for r in at_roofline)} points have the anchor within "
              f"1.25 x their roofline)")
    print(f"decode (M <= 64) within 1.1 x roofline + 3 us: {decode_total - len(decode_fail)} of {decode_total}")
    for line in decode_fail:
        print("  over:", line)
    for (model, dtype), target in PREFILL_TARGETS.items():
        p = points.get((model, dtype, 16384))
        got = f"{p['tflops']:.0f}" if p else "-"
        print(f"prefill {model}/{dtype} M=16384: {got} TFLOP/s (target {target})")
    hosts = [p["host_us"] for p in points.values() if p.get("host_us") is not None]
    if hosts:
        print(f"host time per forward: {min(hosts):.1f}-{max(hosts):.1f} us (target < 5)")
    if args.per_model:
        per_model_tables(points)


if __name__ == "__main__":
    main()
