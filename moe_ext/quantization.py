"""Quantization entry points of the public API that are not built yet.

Each raises NotImplementedError naming the feature, so code written against
vLLM fails loudly here instead of running unquantized."""


def _missing(feature):
    raise NotImplementedError(f"{feature} is not implemented yet in moe_ext "
                              "(online FP8 and WNA16 are planned)")


class Fp8OnlineConfig:
    """Online FP8 quantize-on-load config (per-tensor or 128x128 block): not implemented yet."""

    def __init__(self, weight_block_size=None):
        _missing("Fp8OnlineConfig (online FP8 quantization)")


class WNA16Config:
    """int4/int8 weight-only (GPTQ/AWQ) experts: not implemented yet."""

    def __init__(self, bits=4, group_size=128, sym=True, desc_act=False, format="gptq"):
        _missing("WNA16Config (int4/int8 weight-only experts)")


class Linear:
    """Online-FP8 linear layer: not implemented yet."""

    def __init__(self, input_size, output_size, bias=False, params_dtype=None,
                 quant_config=None):
        _missing("moe_ext.Linear (online FP8 linear)")


def scaled_fp8_quant(input, scale=None):
    _missing("scaled_fp8_quant")


def per_block_cast_to_fp8(x, block_size=(128, 128), use_ue8m0=False):
    _missing("per_block_cast_to_fp8")


def per_token_group_quant_fp8(x, group_size=128):
    _missing("per_token_group_quant_fp8")
