"""moe_ext: vLLM's FusedMoE layer, in C and CUDA over DLPack.

Import FusedMoE and the functional API from here; see README.md."""
from . import _bridge
from . import _C

_bridge.register()

from .expert_map import determine_expert_map  # noqa: E402
from .functional import (  # noqa: E402
    fused_experts,
    fused_moe,
    fused_topk,
    grouped_topk,
)
from .layer import FusedMoE, UnquantizedFusedMoEMethod  # noqa: E402
from .fp8 import (  # noqa: E402
    per_block_cast_to_fp8,
    per_token_group_quant_fp8,
    scaled_fp8_quant,
)
from .linear import Linear  # noqa: E402
from .quantization import Fp8OnlineConfig, WNA16Config  # noqa: E402

Fp8PerTensorOnlineMoEMethod = _C.Fp8PerTensorOnlineMoEMethod
Fp8PerBlockOnlineMoEMethod = _C.Fp8PerBlockOnlineMoEMethod
Fp8PerTensorOnlineLinearMethod = _C.Fp8PerTensorOnlineLinearMethod
Fp8PerBlockOnlineLinearMethod = _C.Fp8PerBlockOnlineLinearMethod


def cuda_available() -> bool:
    """Whether the CUDA engine is built in and sees at least one GPU."""
    return bool(_C.built_with_cuda) and _C.cuda_device_count() > 0


__all__ = [
    "FusedMoE", "UnquantizedFusedMoEMethod", "determine_expert_map", "fused_experts",
    "fused_moe", "fused_topk", "grouped_topk", "cuda_available", "Fp8OnlineConfig", "Linear",
    "WNA16Config", "scaled_fp8_quant", "per_block_cast_to_fp8", "per_token_group_quant_fp8",
    "Fp8PerTensorOnlineMoEMethod", "Fp8PerBlockOnlineMoEMethod",
    "Fp8PerTensorOnlineLinearMethod", "Fp8PerBlockOnlineLinearMethod",
]
