"""The packed expert-weight layout of the Hopper (sm_90a) kernels, and which layers
get it (csrc/include/moe_ext/abi.h, weights_packed).

Packed, each expert's [N, K] weight matrix keeps its shape and dtype but holds its
rows as [N / 64, K / (128 bytes), 64, 128 bytes]: every 64-row block of a
128-byte k slice is one contiguous 8 KB piece, which the kernels' TMA boxes read
as one stream (benchmarks/NOTES.md, "The decode weight stream"). FusedMoE packs
w13 / w2 in process_weights_after_loading() where the layer runs on a Hopper GPU
and the shapes allow it, and unpacks them before the weight loader writes into
them again; MOE_EXT_PACKED_WEIGHTS=0 keeps the checkpoint's row-major layout.
pack_ / unpack_ also mark the tensor object (is_packed), so that the functional form,
which gets tensors and no layer, refuses packed weights.
"""
import os

import torch

from . import _C

ENV_SWITCH = "MOE_EXT_PACKED_WEIGHTS"
ROWS = 64            # weight rows of a packed block
SLICE_BYTES = 128    # bytes of k of a packed block


def enabled():
    """False when MOE_EXT_PACKED_WEIGHTS=0 asks for the row-major layout."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def packable(act_dtype, *weights):
    """Whether the Hopper kernels can read these [E, N, K] weights packed: a device
    that runs this build's sm_90a kernels, 16-bit activations, contiguous 16-byte
    aligned weights of whole 64-row blocks and 128-byte k slices."""
    if act_dtype not in (torch.float16, torch.bfloat16):
        return False
    for w in weights:
        if not w.is_cuda or w.dim() != 3 or not w.is_contiguous() or w.data_ptr() % 16:
            return False
        if not _C.sm90_kernels(w.device.index):
            return False
        if w.shape[1] % ROWS or (w.shape[2] * w.element_size()) % SLICE_BYTES:
            return False
    return True


def _swap_block_axes_(weight, packed_now):
    """Swaps the rows-of-a-block and k-slice axes of each expert's [N, K] bytes, in place, one
    expert at a time (a temporary of one expert's size): row-major [N / 64, 64, K / 128 B,
    128 B] to packed [N / 64, K / 128 B, 64, 128 B], or back where packed_now."""
    for matrix in weight.data:
        raw = matrix.view(torch.uint8)
        blocks, slices = raw.shape[0] // ROWS, raw.shape[1] // SLICE_BYTES
        axes = (slices, ROWS) if packed_now else (ROWS, slices)
        raw.copy_(raw.view(blocks, *axes, SLICE_BYTES).transpose(1, 2).contiguous().view(raw.shape))


def pack_(weight):
    """Rewrites [E, N, K] row-major weights into the packed layout, in place, and marks the
    tensor object packed (is_packed)."""
    _swap_block_axes_(weight, packed_now=False)
    weight._moe_ext_packed = True


def unpack_(weight):
    """The inverse of pack_, in place."""
    _swap_block_axes_(weight, packed_now=True)
    weight._moe_ext_packed = False


def is_packed(weight):
    """Whether this tensor object holds the packed layout (pack_ marks it; a view or .data of
    it is a new object and carries no mark)."""
    return getattr(weight, "_moe_ext_packed", False)


def unpacked(weight):
    """A row-major copy of packed [E, N, K] weights (the weights are left as they are)."""
    copy = weight.detach().clone()
    unpack_(copy)
    return copy


def row_major(layer, name):
    """A FusedMoE's w13_weight / w2_weight in the row-major layout: the parameter itself, or an
    unpacked copy where process_weights_after_loading() packed it."""
    weight = getattr(layer, name)
    return unpacked(weight) if layer.weights_packed else weight
