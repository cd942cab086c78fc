"""The packed expert-weight layout of the Hopper (sm_90a) kernels, and which layers
get it (csrc/include/moe_ext/abi.h, weights_packed).

Packed, each expert's [N, K] weight matrix keeps its shape and dtype but holds its
rows as [N / 64, K / (128 bytes), 64, 128 bytes]: every 64-row block of a
128-byte k slice is one contiguous 8 KB piece, which the kernels' TMA boxes read
as one stream (benchmarks/NOTES.md, "The decode weight stream"). FusedMoE packs
w13 / w2 in process_weights_after_loading() where the layer runs on a Hopper GPU
and the shapes allow it, and unpacks them before the weight loader writes into
them again; MOE_EXT_PACKED_WEIGHTS=0 keeps the checkpoint's row-major layout.
"""
import os

import torch

ENV_SWITCH = "MOE_EXT_PACKED_WEIGHTS"
ROWS = 64            # weight rows of a packed block
SLICE_BYTES = 128    # bytes of k of a packed block


def enabled():
    """False when MOE_EXT_PACKED_WEIGHTS=0 asks for the row-major layout."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def packable(act_dtype, *weights):
    """Whether the Hopper kernels can read these [E, N, K] weights packed: a device
    of compute capability 9.0, 16-bit activations, contiguous 16-byte aligned
    weights of whole 64-row blocks and 128-byte k slices."""
    if act_dtype not in (torch.float16, torch.bfloat16):
        return False
    for w in weights:
        if not w.is_cuda or w.dim() != 3 or not w.is_contiguous() or w.data_ptr() % 16:
            return False
        if torch.cuda.get_device_capability(w.device) != (9, 0):
            return False
        if w.shape[1] % ROWS or (w.shape[2] * w.element_size()) % SLICE_BYTES:
            return False
    return True


def _blocks(matrix):
    """One expert's [N, K] as bytes [N / 64, 64, K bytes / 128, 128] (row-major view)."""
    n, k = matrix.shape
    return matrix.view(torch.uint8).view(n // ROWS, ROWS, -1, SLICE_BYTES)


def pack_(weight):
    """Rewrites [E, N, K] row-major weights into the packed layout, in place, one
    expert at a time (a temporary of one expert's size)."""
    for matrix in weight.data:
        raw = matrix.view(torch.uint8)
        raw.copy_(_blocks(matrix).permute(0, 2, 1, 3).contiguous().view(raw.shape))


def unpack_(weight):
    """The inverse of pack_, in place."""
    for matrix in weight.data:
        raw = matrix.view(torch.uint8)
        n = matrix.shape[0]
        packed = raw.view(n // ROWS, -1, ROWS, SLICE_BYTES)
        raw.copy_(packed.permute(0, 2, 1, 3).contiguous().view(raw.shape))


def unpacked(weight):
    """A row-major copy of packed [E, N, K] weights (the weights are left as they are)."""
    copy = weight.detach().clone()
    unpack_(copy)
    return copy
