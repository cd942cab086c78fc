"""The k-slice rule of the persistent Hopper kernel's GEMM2 (csrc/cuda/gemm_configs.cuh
mx_sm90_down_split), evaluated on the host through moe_ext._C._sm90_down_split: the slice count
with the fewest k blocks per CTA (each unit counted 12 k blocks more; more than one slice only at
least 10% under one), slices of at least 16 k blocks, a multiple of align long, none empty."""
import pytest

import moe_ext

pytestmark = pytest.mark.skipif(not moe_ext._C.built_with_cuda, reason="the rule is compiled with the CUDA engine")


@pytest.mark.parametrize("units,slots,max_splits,k_blocks,align,want", [
    (192, 132, 4, 112, 2, (2, 56)),    # Mixtral fp8 M = 512: 2 rounds -> 3 of half length
    (320, 132, 4, 224, 1, (2, 112)),   # Mixtral bf16 M = 1024: 3 rounds -> 5 of half length
    (320, 132, 4, 112, 2, (1, 112)),   # Mixtral fp8 M = 1024: 5 x 68 is not 10% under 3 x 124
    (132, 132, 4, 112, 2, (1, 112)),   # one full round: slices only add epilogues
    (16, 32, 2, 34, 1, (2, 17)),       # a grid of 32 CTAs for 16 units, at most 2 slices
    (16, 32, 4, 34, 1, (2, 17)),       # 3 slices would be 12 k blocks: under 16
    (10, 132, 4, 68, 2, (4, 18)),      # few units: as many slices as allowed (18, 18, 18, 14)
    (10, 132, 4, 20, 1, (1, 20)),      # K too short for two slices of 16
    (0, 132, 4, 112, 1, (1, 112)),     # no tiles in use
    (1088, 132, 4, 112, 2, (1, 112)),  # 8.24 rounds: 9 x 124 < 17 x 68
])
def test_split_rule(units, slots, max_splits, k_blocks, align, want):
    assert moe_ext._C._sm90_down_split(units, slots, max_splits, k_blocks, align) == want


def test_split_rule_slices_cover_k():
    for k_blocks in range(1, 200):
        for align in (1, 2):
            kb = (k_blocks + align - 1) // align * align
            for units in (1, 7, 100, 131, 133, 250, 400):
                count, length = moe_ext._C._sm90_down_split(units, 132, 4, kb, align)
                assert length % align == 0 and (count - 1) * length < kb <= count * length
                assert count == 1 or length >= 16


def test_split_setting_is_checked():
    with pytest.raises(ValueError):
        moe_ext._C._set_sm90_down_splits(-1)
    with pytest.raises(ValueError):
        moe_ext._C._sm90_down_split(10, 132, 4, 0, 1)
