"""Packed expert weights (moe_ext/packing.py, abi.h weights_packed) on a Hopper GPU: every kernel
that reads them (the one-launch decode, the decode kernel and decode_down, the persistent kernel on
128-row tiles, CTA pairs and ping-pong units) computes bit for bit what it computes on the
row-major layout (MOE_EXT_PACKED_WEIGHTS=0; the 16-bit one-launch decode sums in another order),
and within tolerance of the float64 reference; the
weight loader unpacks them and process_weights_after_loading() packs them again; a CUDA graph
replays on them; x of any alignment is read."""
import math

import pytest
import torch

import moe_ext
from moe_ext import packing
from helpers import capture_forward, decode_fused, expert_weights, make_layer, on_hopper, randn, replay
import reference as ref
from test_fp8 import FP8_TOL, METHODS, compare, fp8_model, fp8_reference
from test_gpu import check
from test_gpu_decode_fused import only_fused
from test_loading import checkpoint, vllm_load

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not moe_ext.cuda_available() or not on_hopper(),
                                 reason="needs a Hopper GPU (packed weights are read by the sm_90a kernels)")]

# id, layer kwargs, experts, top_k, H, I, M; fused: the one-launch decode allowed
CASES_16BIT = [
    ("m1-fused", dict(), 8, 2, 256, 128, 1, True),
    ("m2-fused", dict(), 8, 2, 256, 128, 2, True),
    ("m1-decode", dict(), 8, 2, 256, 128, 1, False),
    ("m40-decode", dict(), 8, 2, 256, 128, 40, True),
    ("m120-ping-pong", dict(), 8, 2, 256, 128, 120, True),
    ("m512-tiles", dict(), 8, 2, 256, 128, 512, True),
    ("m2048-pairs", dict(), 2, 1, 256, 128, 2048, True),
    ("m512-swigluoai-bias", dict(activation="swigluoai", has_bias=True), 8, 2, 256, 192, 512, True),
    ("m2-swigluoai-bias", dict(activation="swigluoai", has_bias=True), 8, 2, 256, 192, 2, True),
    ("m40-relu2", dict(activation="relu2", is_act_and_mul=False), 8, 2, 192, 64, 40, True),
    ("m700-relu2", dict(activation="relu2", is_act_and_mul=False), 8, 2, 192, 64, 700, True),
]


def layer_pair(gen, dtype, e, k, h, i, kw, monkeypatch):
    """(packed layer, row-major layer, weights, reference) holding the same random weights."""
    kw = dict(kw)
    has_bias = kw.pop("has_bias", False)
    weights = expert_weights(gen, e, h, i, gated=kw.get("is_act_and_mul", True), has_bias=has_bias,
                             dtype=dtype, device="cuda")
    args = dict(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, params_dtype=dtype,
                has_bias=has_bias, device="cuda", **kw)
    packed = make_layer(weights, **args)
    with monkeypatch.context() as env:
        env.setenv(packing.ENV_SWITCH, "0")
        row_major = make_layer(weights, **args)
    assert packed.weights_packed and packed._core.weights_packed
    assert not row_major.weights_packed and not row_major._core.weights_packed
    for name in ("w13_weight", "w2_weight"):
        one_slice = weights[name].shape[-1] * weights[name].element_size() == packing.SLICE_BYTES
        assert one_slice or not torch.equal(packed._parameters[name], weights[name]), \
            f"{name} was not packed"  # rows of one 128-byte slice: both layouts are the same bytes
        assert torch.equal(packing.unpacked(packed._parameters[name]), weights[name])

    def reference(x, logits):
        return ref.moe(x, logits, weights["w13_weight"], weights["w2_weight"], k,
                       activation=kw.get("activation", "silu"),
                       is_act_and_mul=kw.get("is_act_and_mul", True),
                       w13_bias=weights.get("w13_bias"), w2_bias=weights.get("w2_bias"),
                       act_dtype=dtype)

    return packed, row_major, weights, reference


def forward_inputs(gen, m, h, e, dtype=torch.bfloat16):
    """x [m, h] and router logits [m, e] on the GPU, drawn in that order."""
    return randn(gen, m, h, dtype=dtype, device="cuda"), randn(gen, m, e, device="cuda", scale=2.0)


@pytest.mark.parametrize("case", CASES_16BIT, ids=[c[0] for c in CASES_16BIT])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_packed_16bit_matches_row_major(case, dtype, gen, monkeypatch):
    _, kw, e, k, h, i, m, fused = case
    packed, row_major, _, reference = layer_pair(gen, dtype, e, k, h, i, kw, monkeypatch)
    x, logits = forward_inputs(gen, m, h, e, dtype)
    with decode_fused(fused):
        out = packed(x, logits)
        row_major_out = row_major(x, logits)
    want, margin = reference(x, logits)
    check(out, want, margin, dtype)
    if fused and m <= 2:  # the one-launch decode sums a packed row in 8-lane groups, not 32
        check(out, row_major_out.double(), margin, dtype)
    else:
        assert torch.equal(out, row_major_out), "packed and row-major weights give different outputs"


@pytest.mark.parametrize("m", [1, 2])
def test_packed_fused_lane_group_rounds(m, gen, monkeypatch):
    """The 16-bit one-launch decode on packed weights gives lane groups only whole rounds of every
    warp, the rest a warp an item (decode_fused_16bit.cuh row_lanes): GEMM1 4-row groups, GEMM2
    4-row, then 2-row groups. Sized from the SM count (one CTA of 16 warps an SM) so that each
    GEMM runs every form it has: GEMM1 8 slots x I units, GEMM2 8 slots x ~24.5 rows a CTA."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    warps = 16 * sms
    e, k = 8, 8 // m
    i = 64 * math.ceil((4 * warps + 64) / (8 * 64))
    h = 64 * math.ceil(24.5 * sms / 64)
    assert (8 * i) // 4 >= warps and 8 * i > 4 * warps  # a 4-row round and a rest
    assert 8 * (h // sms) >= 128 + 64  # GEMM2: every CTA a 4-row and a 2-row round
    packed, row_major, _, reference = layer_pair(gen, torch.bfloat16, e, k, h, i, {}, monkeypatch)
    x, logits = forward_inputs(gen, m, h, e)
    only_fused(lambda: packed(x, logits))
    out = packed(x, logits)
    want, margin = reference(x, logits)
    check(out, want, margin, torch.bfloat16)
    check(out, row_major(x, logits).double(), margin, torch.bfloat16)


# id, experts, top_k, H, I, M; fused as above
CASES_FP8 = [
    ("m1-fused", 8, 2, 256, 256, 1, True),
    ("m1-decode", 8, 2, 256, 256, 1, False),
    ("m40-decode", 8, 2, 256, 256, 40, True),
    ("m120-ping-pong", 8, 2, 256, 256, 120, True),
    ("m512-tiles", 8, 2, 256, 256, 512, True),
    ("m300-long-k", 8, 2, 2304, 384, 300, True),
]


@pytest.mark.parametrize("case", CASES_FP8, ids=[c[0] for c in CASES_FP8])
@pytest.mark.parametrize("method", list(METHODS))
def test_packed_fp8_matches_row_major(case, method, gen, monkeypatch):
    _, e, k, h, i, m, fused = case
    ckpt, _ = checkpoint(gen, "mixtral", e=e, h=h, i=i, dtype=torch.bfloat16)
    model, packed = fp8_model("mixtral", method, "cuda", e=e, k=k, h=h, i=i)
    vllm_load(model, ckpt, "mixtral", num_experts=e)
    with monkeypatch.context() as env:
        env.setenv(packing.ENV_SWITCH, "0")
        model_rm, row_major = fp8_model("mixtral", method, "cuda", e=e, k=k, h=h, i=i)
        vllm_load(model_rm, ckpt, "mixtral", num_experts=e)
    assert packed.weights_packed and not row_major.weights_packed
    for name in ("w13_weight", "w2_weight"):
        bits = lambda t: t.view(torch.uint8)
        assert torch.equal(bits(packing.unpacked(packed._parameters[name])),
                           bits(row_major._parameters[name]))
    x, logits = forward_inputs(gen, m, h, e)
    with decode_fused(fused):
        out = packed(x, logits)
        want_bits = row_major(x, logits)
    assert torch.equal(out, want_bits), "packed and row-major weights give different outputs"
    want, margin = fp8_reference(row_major, x, logits)
    compare(out, want, margin, FP8_TOL, f"packed {method} M={m}")


def test_packed_reload_unpacks_and_repacks(gen, monkeypatch):
    """An RL-style update: the loader unpacks the layer, the forward reads row-major weights
    until process_weights_after_loading() packs them again, in the same storage."""
    e, k, h, i, m = 8, 2, 256, 128, 40
    packed, _, weights, _ = layer_pair(gen, torch.bfloat16, e, k, h, i, {}, monkeypatch)
    storage = packed.w13_weight.data_ptr()
    new = expert_weights(gen, e, h, i, dtype=torch.bfloat16, device="cuda")
    packed.weight_loader(packed.w2_weight, new["w2_weight"][3], "experts.w2_weight", shard_id="w2",
                         expert_id=3)
    assert not packed.weights_packed and not packed._core.weights_packed
    expect_w2 = weights["w2_weight"].clone()
    expect_w2[3] = new["w2_weight"][3]
    assert torch.equal(packed.w2_weight, expect_w2)
    assert torch.equal(packed.w13_weight, weights["w13_weight"])
    fresh = make_layer(dict(weights, w2_weight=expect_w2), num_experts=e, top_k=k, hidden_size=h,
                       intermediate_size=i, params_dtype=torch.bfloat16, device="cuda")
    x, logits = forward_inputs(gen, m, h, e)
    assert torch.equal(packed(x, logits), fresh(x, logits))
    packed.process_weights_after_loading()
    assert packed.weights_packed and packed.w13_weight.data_ptr() == storage
    assert torch.equal(packed(x, logits), fresh(x, logits))


@pytest.mark.parametrize("method", list(METHODS))
def test_packed_fp8_reload_requantizes(method, gen):
    e, k, h, i, m = 8, 2, 256, 256, 40
    ckpt, _ = checkpoint(gen, "mixtral", e=e, h=h, i=i, dtype=torch.bfloat16)
    model, layer = fp8_model("mixtral", method, "cuda", e=e, k=k, h=h, i=i)
    vllm_load(model, ckpt, "mixtral", num_experts=e)
    assert layer.weights_packed
    ckpt2, _ = checkpoint(gen, "mixtral", e=e, h=h, i=i, dtype=torch.bfloat16)
    vllm_load(model, ckpt2, "mixtral", num_experts=e)
    assert layer.weights_packed, "vllm_load ends with process_weights_after_loading()"
    model2, fresh = fp8_model("mixtral", method, "cuda", e=e, k=k, h=h, i=i)
    vllm_load(model2, ckpt2, "mixtral", num_experts=e)
    x, logits = forward_inputs(gen, m, h, e)
    assert torch.equal(layer(x, logits), fresh(x, logits))


@pytest.mark.parametrize("m", [2, 40, 512])
def test_packed_reads_misaligned_x(m, gen, monkeypatch):
    """x whose data pointer is not 16-byte aligned: copied into the workspace for the TMA loads."""
    e, k, h, i = 8, 2, 256, 128
    packed, _, _, _ = layer_pair(gen, torch.bfloat16, e, k, h, i, {}, monkeypatch)
    x, logits = forward_inputs(gen, m, h, e)
    storage = torch.empty(m * h + 1, dtype=torch.bfloat16, device="cuda")
    shifted = storage[1:].view(m, h)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 and shifted.is_contiguous()
    assert torch.equal(packed(shifted, logits), packed(x, logits))


@pytest.mark.parametrize("m", [1, 40, 512])
def test_packed_cuda_graph_replay(m, gen, monkeypatch):
    e, k, h, i = 8, 2, 256, 128
    packed, _, _, reference = layer_pair(gen, torch.bfloat16, e, k, h, i, {}, monkeypatch)
    static_x, static_logits = forward_inputs(gen, m, h, e)
    graph, static_out = capture_forward(packed, static_x, static_logits)
    for _ in range(2):
        x, logits = forward_inputs(gen, m, h, e)
        replay(graph, static_x, static_logits, x, logits, static_out)
        want, margin = reference(x, logits)
        check(static_out, want, margin, torch.bfloat16)


def test_packed_layer_moved_to_cpu(gen, monkeypatch):
    """A packed layer moved to the CPU refuses to run until process_weights_after_loading()
    unpacks it there."""
    e, k, h, i, m = 8, 2, 256, 128, 5
    packed, row_major, _, _ = layer_pair(gen, torch.bfloat16, e, k, h, i, {}, monkeypatch)
    packed.cpu()
    x = randn(gen, m, h, dtype=torch.bfloat16)
    logits = randn(gen, m, e, scale=2.0)
    with pytest.raises(NotImplementedError, match="packed"):
        packed(x, logits)
    packed.process_weights_after_loading()
    assert not packed.weights_packed
    assert torch.equal(packed(x, logits), row_major.cpu()(x, logits))


def test_packed_state_dict_is_row_major(gen, monkeypatch):
    """state_dict() gives the row-major weights of a packed layer; load_state_dict() into a
    packed layer unpacks it first, and process_weights_after_loading() packs it again."""
    e, k, h, i, m = 8, 2, 256, 128, 40
    packed, row_major, weights, _ = layer_pair(gen, torch.bfloat16, e, k, h, i, {}, monkeypatch)
    state = packed.state_dict()
    for name in ("w13_weight", "w2_weight"):
        assert torch.equal(state[name], weights[name])
    assert packed.weights_packed, "state_dict() leaves the layer packed"
    new = expert_weights(gen, e, h, i, dtype=torch.bfloat16, device="cuda")
    packed.load_state_dict(new, strict=False)
    assert not packed.weights_packed
    assert torch.equal(packed.w13_weight, new["w13_weight"])
    packed.process_weights_after_loading()
    assert packed.weights_packed
    row_major.load_state_dict(new, strict=False)
    x, logits = forward_inputs(gen, m, h, e)
    assert torch.equal(packed(x, logits), row_major(x, logits))
