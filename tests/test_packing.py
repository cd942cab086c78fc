"""The packed expert-weight layout (moe_ext/packing.py): the byte order it promises, its inverse,
which layers get it, and the engine's refusals where it cannot read it (CPU)."""
import os

import pytest
import torch

import moe_ext
from moe_ext import packing
from helpers import expert_weights, make_layer, randn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_pack_places_each_block_contiguously(dtype, gen):
    e, n, k = 3, 128, 256
    w = randn(gen, e, n, k).to(dtype)
    original = w.clone()
    packing.pack_(w)
    kbytes = k * w.element_size()
    slices = kbytes // 128
    src, dst = original.view(torch.uint8), w.view(torch.uint8).reshape(e, -1)
    for expert in range(e):
        for row in (0, 1, 63, 64, 100, n - 1):
            for kb in range(slices):
                at = ((row // 64) * slices + kb) * 64 * 128 + (row % 64) * 128
                assert torch.equal(dst[expert, at:at + 128], src[expert, row, kb * 128:(kb + 1) * 128])
    assert torch.equal(packing.unpacked(w).view(torch.uint8), src)
    packing.unpack_(w)
    assert torch.equal(w.view(torch.uint8), src)


def test_packable_needs_a_hopper_gpu_and_whole_blocks(gen):
    w = randn(gen, 2, 128, 128, dtype=torch.bfloat16)
    assert not packing.packable(torch.bfloat16, w)  # CPU
    if not torch.cuda.is_available():
        return
    g = w.cuda()
    if not moe_ext._C.sm90_kernels(g.device.index):
        assert not packing.packable(torch.bfloat16, g)
        return
    assert packing.packable(torch.bfloat16, g)
    assert not packing.packable(torch.float32, g)
    assert not packing.packable(torch.bfloat16, randn(gen, 2, 96, 128, device="cuda"))
    assert not packing.packable(torch.bfloat16, g[:, :, :96])


def test_sm90_kernels_asks_about_a_device_of_this_machine():
    count = moe_ext._C.cuda_device_count()
    if moe_ext._C.built_with_cuda:
        with pytest.raises(ValueError, match="device_index"):
            moe_ext._C.sm90_kernels(count)
        with pytest.raises(ValueError, match="device_index"):
            moe_ext._C.sm90_kernels(-1)
    else:
        assert moe_ext._C.sm90_kernels(0) is False
    with pytest.raises(TypeError):
        moe_ext._C.sm90_kernels("0")
    built_for_90a = "90a" in os.environ.get("MOE_EXT_CUDA_ARCHS", "80;89;90a")  # setup.py's default
    for device in range(count):
        hopper = torch.cuda.get_device_capability(device) == (9, 0)
        assert moe_ext._C.sm90_kernels(device) == (hopper and built_for_90a)


def test_switch(monkeypatch):
    monkeypatch.delenv(packing.ENV_SWITCH, raising=False)
    assert packing.enabled()
    monkeypatch.setenv(packing.ENV_SWITCH, "0")
    assert not packing.enabled()


def cpu_layer(gen, h=128, i=64, dtype=torch.bfloat16):
    weights = expert_weights(gen, 4, h, i, dtype=dtype)
    return make_layer(weights, num_experts=4, top_k=2, hidden_size=h, intermediate_size=i,
                      params_dtype=dtype)


def test_cpu_layer_stays_row_major(gen):
    layer = cpu_layer(gen)
    assert not layer.weights_packed and not layer._core.weights_packed


def test_engine_refuses_packed_weights_it_cannot_read(gen):
    layer = cpu_layer(gen)
    x, logits = randn(gen, 3, 128, dtype=torch.bfloat16), randn(gen, 3, 4)
    layer._core.weights_packed = True
    assert layer._core.weights_packed is True
    with pytest.raises(NotImplementedError, match="packed Hopper layout"):
        layer(x, logits)
    odd = cpu_layer(gen, h=96)
    odd._core.weights_packed = True
    with pytest.raises(ValueError, match="w13, w2: the packed layout"):
        odd(randn(gen, 3, 96, dtype=torch.bfloat16), logits)
    wide = cpu_layer(gen, dtype=torch.float32)
    wide._core.weights_packed = True
    with pytest.raises(TypeError, match="hidden_states: packed"):
        wide(randn(gen, 3, 128), logits)
    with pytest.raises(AttributeError, match="weights_packed"):
        del layer._core.weights_packed
    layer._core.weights_packed = False
    assert layer(x, logits).shape == (3, 128)
    assert isinstance(moe_ext._C.MoECore(2).weights_packed, bool)


def test_functional_form_refuses_packed_weights(gen):
    """fused_experts reads row-major weights only: a tensor pack_ rewrote raises, naming the
    argument, instead of giving wrong outputs; unpacked again it runs."""
    w = expert_weights(gen, 4, 128, 64, dtype=torch.bfloat16)
    x = randn(gen, 3, 128, dtype=torch.bfloat16)
    topk_weights, topk_ids = moe_ext.FusedMoE.select_experts(x, randn(gen, 3, 4), 2, False, True)
    want = moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], topk_weights, topk_ids)
    for arg, name in (("w1", "w13_weight"), ("w2", "w2_weight")):
        packing.pack_(w[name])
        assert packing.is_packed(w[name]) is True
        with pytest.raises(ValueError, match=f"{arg}: holds a FusedMoE's packed Hopper layout"):
            moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], topk_weights, topk_ids)
        assert not packing.is_packed(packing.unpacked(w[name]))
        packing.unpack_(w[name])
        assert not packing.is_packed(w[name])
    assert torch.equal(moe_ext.fused_experts(x, w["w13_weight"], w["w2_weight"], topk_weights, topk_ids),
                       want)
