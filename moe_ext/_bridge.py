"""Hands torch's tensor type to the C module (moe_ext._C), plus the slow-path
allocator and stream lookup for torch builds without the DLPack C exchange API."""
import torch

from . import _C

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "int8": torch.int8, "bool": torch.bool,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
}


def _empty(shape, dtype_name, device):
    if isinstance(device, int):
        device = torch.device("cuda", device)
    return torch.empty(shape, dtype=_DTYPES[dtype_name], device=device)


def _stream(device_index):
    return torch.cuda.current_stream(device_index).cuda_stream


def register(exchange_api=True):
    """Hands torch over to the C module; exchange_api=False forces the slower
    `__dlpack__` path (older torch, and tests of that path)."""
    _C.register_torch(torch.Tensor, _empty, _stream, exchange_api)
