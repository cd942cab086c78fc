"""FP8 quantizers (numerics.md "FP8"), vLLM's signatures over moe_ext._C.fp8_quant.

All three run in C on the CPU and in CUDA on the GPU, bit-identical, and
return float8_e4m3fn values with float32 scales."""
import torch

from . import _C

FP8 = torch.float8_e4m3fn
PER_TENSOR, PER_BLOCK, PER_TOKEN_GROUP = 0, 1, 2


def _ceil_div(a, b):
    return (a + b - 1) // b


def _check_input(x, name="input"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {x.dtype}")
    return x.contiguous()


def scaled_fp8_quant(input, scale=None):
    """Per-tensor FP8: (q, scale [1]). Without `scale` it is dynamic:
    scale = max(amax(|x|) / 448, 1 / (448 * 512)); q = fp8(clamp(x * (1 / scale)))."""
    x = _check_input(input)
    out = torch.empty_like(x, dtype=FP8)
    if scale is None:
        s = torch.empty(1, dtype=torch.float32, device=x.device)
    else:
        s = scale.detach().to(device=x.device, dtype=torch.float32).reshape(1).clone()
    _C.fp8_quant(x, out, s, PER_TENSOR, scale_given=scale is not None)
    return out, s


def quantize_per_tensor_into(x, out, scale):
    """Dynamic per-tensor FP8 of x into existing tensors (out like x, scale [1])."""
    _C.fp8_quant(_check_input(x, "x"), out, scale, PER_TENSOR)


def per_block_cast_to_fp8(x, block_size=(128, 128), use_ue8m0=False):
    """Block FP8 over the last two dims: (q, sf [..., ceil(R/br), ceil(C/bc)]) with
    sf = max(amax, 1e-4) / 448 per block (2^ceil(log2 sf) with use_ue8m0),
    q = fp8(x * (1 / sf)); sf is the dequantization multiplier."""
    x = _check_input(x, "x")
    if x.dim() < 2:
        raise ValueError(f"x: expected >= 2 dimensions, got shape {tuple(x.shape)}")
    block_rows, block_cols = block_size
    rows, cols = x.shape[-2:]
    out = torch.empty_like(x, dtype=FP8)
    sf = torch.empty(*x.shape[:-2], _ceil_div(rows, block_rows), _ceil_div(cols, block_cols),
                     dtype=torch.float32, device=x.device)
    quantize_per_block_into(x, out, sf, block_size, use_ue8m0)
    return out, sf


def quantize_per_block_into(x, out, sf, block_size=(128, 128), use_ue8m0=False):
    """Block FP8 of x into existing tensors (the in-place form of per_block_cast_to_fp8)."""
    _C.fp8_quant(_check_input(x, "x"), out, sf, PER_BLOCK, block_rows=block_size[0],
                 block_cols=block_size[1], use_ue8m0=use_ue8m0)


def per_token_group_quant_fp8(x, group_size=128, eps=1e-10, dtype=None,
                              column_major_scales=False):
    """Per row and `group_size` columns: s = max(amax, 1e-10) / 448,
    q = fp8(clamp(x / s, -448, 448)); returns (q, s [..., ceil(C/group_size)])."""
    if eps != 1e-10:
        raise NotImplementedError(f"eps: only the default 1e-10 is supported, got {eps}")
    if dtype not in (None, FP8):
        raise NotImplementedError(f"dtype: only float8_e4m3fn is supported, got {dtype}")
    if column_major_scales:
        raise NotImplementedError("column_major_scales: only row-major scales are supported")
    x = _check_input(x, "x")
    if x.dim() < 1:
        raise ValueError("x: expected at least one dimension")
    out = torch.empty_like(x, dtype=FP8)
    s = torch.empty(*x.shape[:-1], _ceil_div(x.shape[-1], group_size), dtype=torch.float32,
                    device=x.device)
    _C.fp8_quant(x, out, s, PER_TOKEN_GROUP, block_cols=group_size)
    return out, s
