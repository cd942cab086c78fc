"""Per-point comparison of two builds from benchmarks/ab_bench.sh: the mean us of each build's
rounds at every (model, dtype, M), their ratio B / A, the rounds' values, and the geometric mean of
the ratios.

    python3 benchmarks/ab_compare.py DIR A B

DIR holds the unpacked ab.tgz (files NAME-rROUND-TAG.json); A and B are build names."""
import argparse
import collections
import glob
import json
import os

from compare_anchor import geometric_mean


def load(directory):
    """{(model, dtype, M): {build: [us per round]}}"""
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        build = os.path.basename(path).rsplit("-r", 1)[0]
        with open(path) as f:
            for p in json.load(f)["points"]:
                if p["method"] == "moe_ext" and p.get("us"):
                    times[(p["model"], p["dtype"], p["M"])][build].append(p["us"])
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("a")
    parser.add_argument("b")
    args = parser.parse_args()
    ratios = []
    for point, runs in sorted(load(args.dir).items()):
        if not runs.get(args.a) or not runs.get(args.b):
            continue
        ta, tb = (sum(runs[n]) / len(runs[n]) for n in (args.a, args.b))
        ratios.append(tb / ta)
        rounds = " | ".join(" ".join(f"{t:.1f}" for t in runs[n]) for n in (args.a, args.b))
        print(f"{point[0]:<12} {point[1]:<10} {point[2]:6d}  {args.a} {ta:9.1f}  {args.b} {tb:9.1f}  "
              f"{tb / ta:.4f}   [{rounds}]")
    if ratios:
        print(f"geomean {args.b}/{args.a} over {len(ratios)}: {geometric_mean(ratios):.4f}")


if __name__ == "__main__":
    main()
