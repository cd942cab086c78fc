"""CUDA engine with H and I multiples of 8 (TMA strides) but not of 64 (k tails, partial n tiles),
so that a Hopper GPU takes the sm_90a wgmma kernels (gemm_configs.cuh mx_select_sm90_config):
the persistent kernel from 64 rows per expert, the decode kernel (operands swapped, 16- / 32- /
48- / 64-token tiles, split-K) below, but from 24 rows per expert with H, I <= 2048 (any H, I
from 32 local experts) the persistent kernel's ping-pong 64-row units. Other GPUs run the mma.sync tiles through the same checks."""
import re

import pytest
import torch

from helpers import capture_forward, down_splits, kernels_of, on_hopper, randn, replay
from test_gpu import CONFIGS, check, cuda_case

# these tests check the multi-launch pipeline's kernels (conftest.py pipeline_only)
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("pipeline_only")]


PREFILL = [c for c in CONFIGS if c[0] != "grouped-sigmoid-bias"]
DECODE_KERNEL = "grouped_gemm_sm90_decode_kernel"
PERSISTENT_KERNEL = "grouped_gemm_sm90_kernel"
PAIR_SHAPE = "mx_sm90_shape<256, 4, 2, 8, false>"  # the persistent kernel's 128x256 tiles in 2-CTA clusters
PING_PONG_SHAPE = "mx_sm90_shape<256, 5, 1, 8, true>"  # its ping-pong 64-row units


def deals_units(name):
    """Whether a persistent kernel (by its profiler name) took its units from the counter: its last
    template argument, DEALT."""
    found = re.search(r", (true|false)>(?:\(|$)", name)
    assert found, name
    return found.group(1) == "true"


def ping_pong_units(rows_per_expert, h, i, experts, interleaved=False, min_rows=24, max_rows=64):
    """Whether the Hopper rule runs ping-pong 64-row units (gemm_configs.cuh mx_sm90_ping_pong):
    from min_rows rows per local expert (24; FP8 16 with block scales or long K) to under max_rows
    (16-bit 64, FP8 128), H and I at most 2048 unless there are 32 local experts or more, not the
    interleaved GEMM1."""
    return (min_rows <= rows_per_expert < max_rows and (max(h, i) <= 2048 or experts >= 32)
            and not interleaved)


def expected_gemm_kernel(rows_per_expert):
    """The kernel (and decode tile) the Hopper rule picks for this many rows per local expert."""
    if rows_per_expert >= 64:
        return PERSISTENT_KERNEL
    tokens = (16 if rows_per_expert < 12 else 32 if rows_per_expert < 24 else 48 if rows_per_expert < 36
              else 64)
    return f"mx_sm90_decode_shape<{tokens},"


def checked_forward(gen, dtype, layer, reference, m, e):
    """A forward of m random tokens, checked for determinism and against the reference; returns
    the kernel names it ran (None off Hopper)."""
    x = randn(gen, m, layer.hidden_size, dtype=dtype, device="cuda")
    logits = randn(gen, m, e, device="cuda", scale=2.0)
    out = layer(x, logits)
    assert torch.equal(out, layer(x, logits)), "the forward must be deterministic"
    want, margin = reference(x, logits)
    check(out, want, margin, dtype)
    return kernels_of(lambda: layer(x, logits)) if on_hopper() else None


# decode kernel: 16-token tiles (1 token), 16-, 32-, 48-, 64-token tiles; persistent kernel: 100
# (128-row tiles about a quarter padding), 150
@pytest.mark.parametrize("rows_per_expert", [0.1, 5, 16, 30, 48, 100, 150])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_matches_reference(cfg, dtype, rows_per_expert, gen):
    _, e, k, kw, corr = cfg
    layer, _, reference = cuda_case(gen, dtype, e, dict(kw, top_k=k), corr, h=328, i=200)
    m = max(1, int(rows_per_expert * layer.local_num_experts / k))  # the rule counts all pairs per local expert
    names = checked_forward(gen, dtype, layer, reference, m, e)
    if on_hopper():
        rows = m * k / layer.local_num_experts
        ping_pong = ping_pong_units(rows, 328, 200, layer.local_num_experts, kw.get("activation") == "swigluoai")
        kernel = PING_PONG_SHAPE if ping_pong else expected_gemm_kernel(rows)
        assert any(kernel in n for n in names), f"no {kernel} ran: {names}"


@pytest.mark.parametrize("tail", ["sparse", "full"])
def test_decode_gemm1_ring_by_last_wave(tail, gen):
    """GEMM1 on 16-token tiles takes the shallow ring (3 CTAs per SM) unless its grid is more
    than one wave of it and the last wave is under a third full (grouped_gemm_sm90_decode.cu
    launch_sm90_decode_gemm1, which counts E (1 - (1 - 1/E)^pairs) tiles: 1.94 here). One token,
    top-2 of 16 experts: 2 tiles x I / 64 CTAs."""
    if not on_hopper():
        pytest.skip("the ring choice is the Hopper decode kernel's")
    slots = 3 * torch.cuda.get_device_properties(0).multi_processor_count
    n_tiles = (slots + (slots // 8 if tail == "sparse" else 2 * (slots // 3))) // 2
    e = 16
    ctas = int((e * (1 - (1 - 1 / e) ** 2)) * n_tiles + 0.5)
    assert (ctas > slots and 3 * (ctas % slots) < slots) == (tail == "sparse")
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(top_k=2), False, h=64, i=64 * n_tiles)
    x = randn(gen, 1, 64, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, 1, e, device="cuda", scale=2.0)
    want, margin = reference(x, logits)
    check(layer(x, logits), want, margin, torch.bfloat16)
    names = kernels_of(lambda: layer(x, logits))
    stages = 6 if tail == "sparse" else 4  # either grid fills its ring's slots: paired loads
    gemm1 = f"{DECODE_KERNEL}<__nv_bfloat16, __nv_bfloat16, mx_sm90_decode_shape<16, {stages}, true>, 0, 0>"
    assert any(gemm1 in n for n in names), names


# (E, top_k, M, H, I, the 16-token kernel that pairs its loads: "template arguments stages, true>, KIND,
# quant>")
PAIRED_CASES = [
    (16, 2, 8, 648, 2560, "6, true>, 0, 0>"),  # GEMM1: ~432 CTAs on the deep ring; 11 k blocks, a single last one
    (64, 8, 8, 1608, 136, "4, true>, 3, 0>"),  # GEMM2 over short K (shallow ring): ~580 CTAs; 3 k blocks
    (32, 8, 8, 1608, 1160, "6, true>, 3, 0>"),  # GEMM2 over 19 k blocks (deep ring): ~410 CTAs, a single last one
]


@pytest.mark.parametrize("case", PAIRED_CASES, ids=["gemm1", "gemm2", "gemm2-long"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_paired_loads(case, dtype, gen):
    """16-token grids that fill every CTA slot of their ring issue each box's two k blocks together
    (gemm_configs.cuh mx_sm90_decode_paired), with odd k-block counts (a single last load)."""
    e, k, m, h, i, kernel = case
    layer, _, reference = cuda_case(gen, dtype, e, dict(top_k=k), False, h=h, i=i)
    names = checked_forward(gen, dtype, layer, reference, m, e)
    if on_hopper():
        assert any(DECODE_KERNEL in n and f"mx_sm90_decode_shape<16, {kernel}" in n for n in names), names


@pytest.mark.parametrize("m", [1, 2, 7])
def test_decode_split_k(m, gen):
    """Few experts and a long I: GEMM2 runs in split-K slices (bias on slice 0 only)."""
    _, e, k, kw, corr = CONFIGS[1]  # swigluoai + bias
    layer, _, reference = cuda_case(gen, torch.bfloat16, 4, dict(kw, top_k=2), corr, h=256, i=1536)
    x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
    logits = randn(gen, m, 4, device="cuda", scale=2.0)
    want, margin = reference(x, logits)
    check(layer(x, logits), want, margin, torch.bfloat16)


@pytest.mark.parametrize("splits", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=[c[0] for c in CONFIGS[:2]])
def test_persistent_down_split_k(cfg, splits, gen):
    """The persistent kernel's GEMM2 in k slices (gemm_configs.cuh mx_sm90_down_split), each
    slice a float32 partial of y that moe_sum adds, the bias on slice 0 only: ~150 rows per
    expert (two m tiles each) and H = 328 (two n tiles, the second partly past H) make ~16 units
    on a 32-CTA grid, and I = 2120 34 k blocks with a tail, so the kernel picks 2 (splits 0);
    1-4 are forced (_set_sm90_down_splits)."""
    _, e, k, kw, corr = cfg
    e, k = 4, 2
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr, h=328, i=2120)
    with down_splits(splits):
        names = checked_forward(gen, torch.bfloat16, layer, reference, 300, e)
    if on_hopper():
        assert any(PERSISTENT_KERNEL in n for n in names), f"no {PERSISTENT_KERNEL} ran: {names}"


@pytest.mark.parametrize("splits", [0, 3])
def test_cluster_pairs_down_split_k(splits, gen):
    """The 2-CTA cluster kernel's GEMM2 in k slices: both CTAs of a cluster walk the same slice of
    each unit (the weight halves multicast per k block). 1050 rows per expert, I = 2120 (34 k
    blocks): the kernel's pick (one slice: 34 units on 66 clusters) and 3 forced."""
    _, e, k, kw, corr = CONFIGS[1]  # swigluoai + bias
    e, k = 4, 2
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr, h=328, i=2120)
    with down_splits(splits):
        names = checked_forward(gen, torch.bfloat16, layer, reference, 2100, e)
    if on_hopper():
        assert any(PERSISTENT_KERNEL in n and PAIR_SHAPE in n for n in names), f"no {PAIR_SHAPE} ran: {names}"


@pytest.mark.parametrize("e,h", [(48, 776), (48, 2120), (16, 2120)], ids=["short-k", "long-k", "long-k-16-experts"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=[c[0] for c in CONFIGS[:3]])
def test_ping_pong_units(cfg, dtype, e, h, gen):
    """From 24 to 63 rows per local expert the persistent kernel runs 64-row units, each math
    warpgroup every other unit of its CTA on the one ring (mx_tile_sm90_pp), with H, I <= 2048 or
    from 32 local experts. ~40 rows per expert of 48, H = 776 and I = 520 (GEMM1: 5 n tiles, 13 k
    blocks with a tail; GEMM2: 4 n tiles, the last past H, 9 k blocks) make 240 / 192 units, so
    on 132 SMs both warpgroups take units; H = 2120 (34 k blocks with a tail, 9 GEMM2 n tiles)
    makes 240 / 432. With 16 experts H = 2120 keeps the decode kernel, as does swigluoai
    (interleaved GEMM1) everywhere."""
    _, _, _, kw, corr = cfg
    k = 4
    layer, _, reference = cuda_case(gen, dtype, e, dict(kw, top_k=k), corr, h=h, i=520)
    names = checked_forward(gen, dtype, layer, reference, 40 * e // k, e)
    if on_hopper():
        units = [n for n in names if PERSISTENT_KERNEL in n]
        if ping_pong_units(40, h, 520, e, kw.get("activation") == "swigluoai"):
            assert len(units) == 2 and all(PING_PONG_SHAPE in n for n in units), names
        else:
            assert not units, names


# (rows per local expert, local experts): 200 rows (two 128-row m tiles) of 64 experts, or 40
# rows (one ping-pong 64-row unit) of 128 experts, dealt; 400 rows of 32 experts, round robin
DEALT_UNITS = {"cooperative": (200, 64), "ping-pong": (40, 128), "round-robin": (400, 32)}


@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("units", list(DEALT_UNITS))
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=[c[0] for c in CONFIGS[:2]])
def test_dealt_units_many_per_cta(cfg, units, splits, gen):
    """Single CTAs of the persistent kernel take their units from a counter, handed on through a
    4-slot ring in shared memory (csrc/cuda/sm90_units.cuh). H = 1032 and I = 1040 (k tails,
    partial n tiles) give GEMM1 9 n tiles and GEMM2 5 (the last past H): 1152 / 640 cooperative
    units, 1152 / 640 ping-pong ones, so on 132 SMs each CTA takes 4-9 units per GEMM and the ring
    wraps; GEMM2 in 3 k slices (forced; cooperative only) makes 1920. GEMM2 takes the counter
    from zero only if GEMM1's last taker reset it. From 256 rows per expert the units go round
    robin (gemm_configs.cuh mx_sm90_deals_units): 400 rows of 32 experts, as many units."""
    _, _, _, kw, corr = cfg
    rows, e = DEALT_UNITS[units]
    k = 4
    if units == "ping-pong" and (splits or kw.get("activation") == "swigluoai"):
        pytest.skip("ping-pong units take no k slices, and the rule keeps the interleaved GEMM1's "
                    "layers off them")
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr, h=1032, i=1040)
    with down_splits(splits):
        names = checked_forward(gen, torch.bfloat16, layer, reference, rows * e // k, e)
    if on_hopper():
        persistent = [n for n in names if PERSISTENT_KERNEL in n]
        assert len(persistent) == 2 and not any(PAIR_SHAPE in n for n in persistent), names
        assert all((PING_PONG_SHAPE in n) == (units == "ping-pong") for n in persistent), names
        assert all(deals_units(n) == (units != "round-robin") for n in persistent), names


@pytest.mark.parametrize("rows_per_expert", [40, 100])
def test_persistent_gated_bias(rows_per_expert, gen):
    """w13 / w2 biases with the plain gated GEMM1 (silu; the other bias config is interleaved): ~40
    rows per expert run ping-pong units, ~100 the 128-row tiles (the gate and up biases added in
    the act epilogue, w2's in GEMM2's staged stores). 48 experts, H = 776, I = 520."""
    e, k = 48, 4
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(activation="silu", has_bias=True, top_k=k), False,
                                    h=776, i=520)
    names = checked_forward(gen, torch.bfloat16, layer, reference, rows_per_expert * e // k, e)
    if on_hopper():
        units = [n for n in names if PERSISTENT_KERNEL in n]
        assert len(units) == 2 and all((PING_PONG_SHAPE in n) == ping_pong_units(rows_per_expert, 776, 520, e)
                                       for n in units), names


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=[c[0] for c in CONFIGS[:2]])
def test_prefill_cluster_pairs(cfg, gen):
    """From 1024 rows per local expert (gemm_configs.cuh kSm90PairMinRowsPerExpert) the 16-bit
    persistent kernel runs in 2-CTA clusters (H = 328: the second n tile of GEMM2 is partly past H)."""
    _, _, _, kw, corr = cfg
    e, k = 4, 2
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr, h=328, i=200)
    names = checked_forward(gen, torch.bfloat16, layer, reference, 2100, e)
    if on_hopper():
        assert any(PERSISTENT_KERNEL in n and PAIR_SHAPE in n for n in names), f"no {PAIR_SHAPE} ran: {names}"


@pytest.mark.parametrize("m", [3, 512])  # decode kernel, persistent kernel
def test_graph_replay(m, gen):
    _, e, k, kw, corr = CONFIGS[0]
    layer, _, reference = cuda_case(gen, torch.bfloat16, e, dict(kw, top_k=k), corr, h=256, i=136)
    static_x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
    static_logits = randn(gen, m, e, device="cuda", scale=2.0)
    graph, static_out = capture_forward(layer, static_x, static_logits)
    for _ in range(2):
        x = randn(gen, m, layer.hidden_size, dtype=torch.bfloat16, device="cuda")
        logits = randn(gen, m, e, device="cuda", scale=2.0)
        replay(graph, static_x, static_logits, x, logits)
        want, margin = reference(x, logits)
        check(static_out, want, margin, torch.bfloat16)
