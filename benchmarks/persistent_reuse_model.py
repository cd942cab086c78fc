#!/usr/bin/env python3
"""A model of the persistent Hopper kernel's weight re-reads from DRAM at a few m tiles per expert
(benchmarks/NOTES.md, "Packed weights on an H200; the persistent kernel's weight re-reads").

The kernel walks work units (m tile, n tile) in groups of 8 m tiles, m fastest
(grouped_gemm_sm90_impl.cuh, sm90_unit_coords), and deals them to its CTAs round-robin: CTA c takes
units c, c + 132, ... An expert's m tiles meet each of its weight tiles in consecutive units, so
they share it through L2 only while their CTAs start those units close together in time. Here each
unit takes 1 + noise unit-times (sd), and L2 keeps a weight tile for `life` unit-times: a weight
tile is read from DRAM once, plus once more for each gap between its units' starts longer than
that. The same walk dealt dynamically (the next unit to the first CTA that is free, as a global
counter would) bounds what a scheduler change could recover.

    python3 benchmarks/persistent_reuse_model.py [--life 0.3] [--sd 0.05,0.15]

Prints, per shape and GEMM, the weight bytes read over the weight bytes, static and dynamic. The
routing is the grid's (uniform top-k of random logits), 128-row m tiles, 132 CTAs.
"""
import argparse
import heapq

import numpy as np

BLOCK_M = 128
CTAS = 132
GROUP_M = 8
# model, M, experts, top_k, n tiles of GEMM1 (gated: out_cols / 128), n tiles of GEMM2 (H / 256)
SHAPES = [
    ("gptoss", 4096, 128, 4, 23, 12),
    ("deepseekv3", 4096, 256, 8, 16, 28),
    ("qwen3moe", 4096, 128, 8, 6, 8),
]


def tiles_per_expert(rng, m, experts, top_k):
    logits = rng.standard_normal((m, experts))
    ids = np.argpartition(-logits, top_k, axis=1)[:, :top_k]
    return (np.bincount(ids.ravel(), minlength=experts) + BLOCK_M - 1) // BLOCK_M


def walk(tiles, n_tiles):
    """The weight tile (expert, n tile) of each unit, in the kernel's unit order."""
    tile_expert = [e for e, count in enumerate(tiles) for _ in range(count)]
    order = []
    for first in range(0, len(tile_expert), GROUP_M):
        rows = min(GROUP_M, len(tile_expert) - first)
        for nt in range(n_tiles):
            order.extend((tile_expert[first + j], nt) for j in range(rows))
    return order


def start_times(durations, dynamic):
    starts = []
    if dynamic:
        free = [(0.0, c) for c in range(CTAS)]
        for d in durations:
            t, c = heapq.heappop(free)
            starts.append(t)
            heapq.heappush(free, (t + d, c))
    else:
        clock = [0.0] * CTAS
        for u, d in enumerate(durations):
            starts.append(clock[u % CTAS])
            clock[u % CTAS] += d
    return starts


def read_factor(order, durations, life, dynamic):
    by_tile = {}
    for key, start in zip(order, start_times(durations, dynamic)):
        by_tile.setdefault(key, []).append(start)
    reads = 0
    for starts in by_tile.values():
        starts.sort()
        reads += 1 + sum(1 for a, b in zip(starts, starts[1:]) if b - a > life)
    return reads / len(by_tile)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--life", type=float, default=0.3,
                        help="unit-times a weight tile stays in L2 (H100 at gpt-oss M = 4096: ~17 of ~54 us)")
    parser.add_argument("--sd", default="0.05,0.15", help="comma-separated noise of a unit's time")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for name, m, experts, top_k, n1, n2 in SHAPES:
        tiles = tiles_per_expert(rng, m, experts, top_k)
        for gemm, n_tiles in (("GEMM1", n1), ("GEMM2", n2)):
            order = walk(tiles, n_tiles)
            cells = []
            for sd in (float(v) for v in args.sd.split(",")):
                durations = 1.0 + sd * rng.standard_normal(len(order))
                cells.append(f"sd {sd}: static x{read_factor(order, durations, args.life, False):.3f} "
                             f"dynamic x{read_factor(order, durations, args.life, True):.3f}")
            print(f"{name} M={m} {gemm} ({n_tiles} n tiles, {tiles.sum()} m tiles): " + "; ".join(cells))


if __name__ == "__main__":
    main()
