"""Quantization configs: Fp8OnlineConfig (online FP8, per tensor or 128x128
blocks) and the WNA16 entry point, which is not built yet."""
from . import _C


class Fp8OnlineConfig:
    """vLLM's online FP8 `quant_config`: full-precision checkpoints quantized to
    float8_e4m3fn while they load. weight_block_size None: one scale per expert
    (per tensor); [128, 128]: 128x128 block scales."""

    def __init__(self, weight_block_size=None):
        if weight_block_size is not None and list(weight_block_size) != [128, 128]:
            raise NotImplementedError(f"weight_block_size: only None or [128, 128] are "
                                      f"supported, got {weight_block_size!r}")
        self.weight_block_size = None if weight_block_size is None else [128, 128]

    def get_name(self):
        return "fp8_online"

    def get_quant_method(self, layer, prefix=""):
        """The C method type for a FusedMoE or a moe_ext.Linear; None for other layers."""
        from .layer import FusedMoE
        from .linear import Linear

        block = self.weight_block_size is not None
        if isinstance(layer, FusedMoE):
            kind = _C.Fp8PerBlockOnlineMoEMethod if block else _C.Fp8PerTensorOnlineMoEMethod
            return kind(layer=layer)
        if isinstance(layer, Linear):
            return _C.Fp8PerBlockOnlineLinearMethod() if block \
                else _C.Fp8PerTensorOnlineLinearMethod()
        return None


class WNA16Config:
    """int4/int8 weight-only (GPTQ/AWQ) experts: not implemented yet."""

    def __init__(self, bits=4, group_size=128, sym=True, desc_act=False, format="gptq"):
        raise NotImplementedError("WNA16Config (int4/int8 weight-only experts) is not "
                                  "implemented yet in moe_ext")
