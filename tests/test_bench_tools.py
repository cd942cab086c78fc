"""The benchmark tools that run without a GPU: compare_anchor.py scores a committed H200 result
against issue 5's anchor table (recomputed here from the result's points); bench_moe.py hands its
baselines row-major weights; persistent_reuse_model.py walks units as the persistent kernel does
and counts a weight tile's reads by the gaps between its units."""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(ROOT, "benchmarks", "results", "2026-11-22-nvidia-h200-c627e2a.json")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compare_anchor  # noqa: E402
import persistent_reuse_model  # noqa: E402


def test_compare_anchor_scores_a_committed_result():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compare_anchor.py"), RESULT],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    with open(RESULT) as f:
        points = {(p["model"], p["dtype"], p["M"]): p["us"] for p in json.load(f)["points"]
                  if p["method"] == "moe_ext" and p.get("us") is not None}
    ratios = [a / points[(model, dtype, m)]
              for (model, dtype), anchor in compare_anchor.ANCHOR.items()
              for m, a in zip(compare_anchor.TOKENS, anchor)]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert f"geometric mean {geo:.2f} over {len(ratios)} points" in done.stdout, done.stdout
    assert f"{sum(r >= 1.0 for r in ratios)} at or above 1.0" in done.stdout, done.stdout
    assert "decode (M <= 64) within 1.1 x roofline + 3 us:" in done.stdout
    with open(RESULT) as f:
        result = json.load(f)
    ceilings = result["meta"]["ceilings"]
    by_key = {(p["model"], p["dtype"], p["M"]): p for p in result["points"]
              if p["method"] == "moe_ext" and p.get("us") is not None}
    best = [a / compare_anchor.roofline_us(by_key[(model, dtype, m)], ceilings)
            for (model, dtype), anchor in compare_anchor.ANCHOR.items()
            for m, a in zip(compare_anchor.TOKENS, anchor)]
    best_geo = math.exp(sum(map(math.log, best)) / len(best))
    assert f"a forward at its roofline at every point would score {best_geo:.2f}" in done.stdout, done.stdout


def test_roofline_uses_the_streaming_read_ceiling():
    point = {"dtype": "bf16", "us": 100.0, "tflops": 1.0, "weight_bytes": 4.0e8}
    ceilings = {"read_tbps": 2.0, "stream_read_tbps": 4.0, "bf16_tflops": 500.0, "fp8_tflops": 1000.0}
    assert abs(compare_anchor.roofline_us(point, ceilings) - 100.0) < 1e-9  # 4e8 B / 4 TB/s
    del ceilings["stream_read_tbps"]  # older results: the copy figure
    assert abs(compare_anchor.roofline_us(point, ceilings) - 200.0) < 1e-9


def test_baselines_read_row_major_weights_of_a_packed_layer():
    """bench_moe.py's baselines multiply by w13 / w2 row-major even where the layer packed them."""
    import torch
    import moe_ext
    import bench_moe
    from helpers import expert_weights, make_layer
    gen = torch.Generator().manual_seed(0)
    weights = expert_weights(gen, 2, 128, 64, dtype=torch.bfloat16)
    layer = make_layer(weights, num_experts=2, top_k=1, hidden_size=128, intermediate_size=64,
                       params_dtype=torch.bfloat16)
    layer._set_weights_packed(True)  # as on a Hopper GPU (the CPU engine would refuse to run it)
    assert not torch.equal(layer.w13_weight, weights["w13_weight"])
    params = bench_moe.row_major_params(moe_ext, layer)
    for name in ("w13_weight", "w2_weight"):
        assert torch.equal(params[name], weights[name])


def test_reuse_model_walks_units_as_the_kernel_and_counts_reads_by_gaps():
    model = persistent_reuse_model
    # experts of 1, 2 and 9 tiles: the 9-tile expert straddles the first group of 8 m tiles
    order = model.walk([1, 2, 9], n_tiles=2)
    assert order[:8] == [(0, 0), (1, 0), (1, 0), (2, 0), (2, 0), (2, 0), (2, 0), (2, 0)]
    assert order[8:16] == [(0, 1), (1, 1), (1, 1)] + [(2, 1)] * 5
    assert order[16:] == [(2, 0)] * 4 + [(2, 1)] * 4
    # equal unit times: dealing dynamically starts every unit when static dealing does
    equal = [1.0] * (3 * model.CTAS + 5)
    assert model.start_times(equal, True) == model.start_times(equal, False)
    # a tile whose units start a round apart is read twice when L2 keeps it for less than a round
    units = [(0, 0)] * model.CTAS + [(0, 0)]
    times = [1.0] * len(units)
    assert model.read_factor(units, times, life=0.5, dynamic=False) == 2
    assert model.read_factor(units, times, life=1.5, dynamic=False) == 1
