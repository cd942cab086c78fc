"""vLLM's FusedMoE weight_loader semantics (seed 001), as a mixin of FusedMoE.

This file only decides which slice of a parameter receives which slice of a
checkpoint tensor (tensor-parallel narrowing, expert-parallel locality, gate/up
halves or GPT-OSS interleaving, scales, g_idx); the copy itself runs in C
(moe_ext._C.copy_) over DLPack views. Every shape is checked before anything
is written, so a failed call leaves the parameter untouched."""
import torch

from . import _C

SHARD_IDS = ("w1", "w2", "w3")
SHARD_DIM = {"w1": 0, "w2": 1, "w3": 0}
SCALE_KINDS = ("tensor", "channel", "group", "block")


def copy_checked(dst, src, what):
    """dst <- src (C copy, dtype conversion included) after a shape check."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"loaded_weight: expected shape {tuple(dst.shape)} for {what}, got "
                         f"{tuple(src.shape)}")
    if src.device != dst.device:
        src = src.to(dst.device)
    _C.copy_(dst, src)


def _narrow(tensor, dim, start, length, what):
    if tensor.dim() <= dim:
        raise ValueError(f"loaded_weight: {what} needs at least {dim + 1} dimensions, got shape "
                         f"{tuple(tensor.shape)}")
    if tensor.shape[dim] < start + length:
        raise ValueError(f"loaded_weight: {what} needs rows [{start}, {start + length}) of "
                         f"dimension {dim}, but its shape is {tuple(tensor.shape)}")
    return tensor.narrow(dim, start, length)


class ExpertWeightLoader:
    """The full-precision loader and the slicing rules it shares with the online
    FP8 loader (moe_ext/fp8_online.py); expects FusedMoE's attributes."""

    def _to_local_expert(self, expert_id):
        if self._expert_map is None:
            if not 0 <= expert_id < self.global_num_experts:
                raise ValueError(f"expert_id: {expert_id} is outside [0, "
                                 f"{self.global_num_experts})")
            return expert_id
        if not 0 <= expert_id < self._expert_map.shape[0]:
            raise ValueError(f"expert_id: {expert_id} is outside [0, {self._expert_map.shape[0]})")
        return int(self._expert_map[expert_id])

    def _interleaved(self):
        return self.activation == "swigluoai"

    def _this_ranks_experts(self, loaded_weight):
        """The local experts' rows of a full (all-experts) checkpoint tensor."""
        if loaded_weight.shape[0] == self.local_num_experts:
            return loaded_weight
        if loaded_weight.shape[0] != self.global_num_experts:
            raise ValueError(f"loaded_weight: a full load needs {self.global_num_experts} (or "
                             f"{self.local_num_experts} local) experts in dimension 0, got shape "
                             f"{tuple(loaded_weight.shape)}")
        ids = torch.tensor(self._local_expert_ids(), dtype=torch.long,
                           device=loaded_weight.device)
        return loaded_weight.index_select(0, ids)

    def _check_shard(self, shard_id, loaded_weight, weight_name):
        if shard_id not in SHARD_IDS:
            raise ValueError(f"shard_id must be ['w1','w2','w3'] but got {shard_id}.")
        if not isinstance(loaded_weight, torch.Tensor):
            raise TypeError(f"loaded_weight: expected a torch.Tensor, got "
                            f"{type(loaded_weight).__name__}")
        if loaded_weight.is_meta:
            raise ValueError(f"loaded_weight: {weight_name} is a meta tensor and holds no data")

    def _narrow_shard(self, loaded_weight, dim, shard_size, what):
        """This tensor-parallel rank's `shard_size` rows of `dim`."""
        return _narrow(loaded_weight, dim, shard_size * self.tp_rank, shard_size, what)

    def load_full_precision(self, param, loaded_weight, weight_name, shard_id, expert_id,
                            return_success=False):
        """Copies one checkpoint tensor into its slice of `param` (vLLM semantics).

        Returns False (with return_success=True) and copies nothing when the expert is
        not on this expert-parallel rank; None / True otherwise."""
        self._check_shard(shard_id, loaded_weight, weight_name)
        done = True if return_success else None
        full_load = param.dim() > 1 and loaded_weight.dim() == param.dim()
        if not full_load:
            expert_id = self._to_local_expert(expert_id)
            if expert_id == -1:
                return False if return_success else None
        else:
            loaded_weight = self._this_ranks_experts(loaded_weight)
        shard_dim = SHARD_DIM[shard_id]
        if getattr(param, "is_transposed", False):
            shard_dim = int(not shard_dim)
        if full_load:
            shard_dim += 1
        data = param.data
        expert_data = data if full_load else data[expert_id]
        what = f"{weight_name} (shard {shard_id}, expert {expert_id})"

        if "input_scale" in weight_name:
            copy_checked(data[expert_id], loaded_weight.reshape(data[expert_id].shape), what)
        elif "g_idx" in weight_name:
            # g_idx is one entry per input column: w2's is narrowed along its only dim.
            if shard_id == "w2":
                self._load_w2(expert_data, int(full_load), loaded_weight, what)
            else:
                copy_checked(expert_data, loaded_weight, what)
        elif "bias" in weight_name:
            self._load_bias(expert_data, shard_id, loaded_weight, weight_name, what)
        elif "w13_weight_scale" in weight_name and loaded_weight.dim() > 1 and \
                loaded_weight.shape[-2] == data.shape[-2] * self.tp_size:
            shard = expert_data.shape[shard_dim]
            copy_checked(expert_data, self._narrow_shard(loaded_weight, shard_dim, shard, what),
                         what)
        elif "scale" in weight_name or "zero" in weight_name or "offset" in weight_name:
            self._load_scale(param, expert_data, expert_id, shard_id, shard_dim, loaded_weight,
                             what)
        elif "weight_shape" in weight_name:
            copy_checked(data[expert_id], loaded_weight.reshape(data[expert_id].shape), what)
        elif "weight" in weight_name:
            self._load_weight_rows(expert_data, shard_id, shard_dim, loaded_weight, what)
        else:
            raise ValueError(f"weight_name: {weight_name!r} is not a parameter the FusedMoE "
                             "loader knows (weight, bias, scale, zero point, g_idx, "
                             "input_scale)")
        return done

    def _load_weight_rows(self, expert_data, shard_id, shard_dim, loaded_weight, what,
                          load_full_w2=False):
        if shard_id == "w2":
            self._load_w2(expert_data, shard_dim, loaded_weight, what, load_full_w2)
        else:
            self._load_w13(expert_data, shard_id, shard_dim, loaded_weight, what)

    def _w13_slot(self, expert_data, shard_id, dim):
        """The rows of a w13 tensor that shard w1 (gate) or w3 (up) fills."""
        if not self.is_act_and_mul:
            if shard_id == "w3":
                raise ValueError("shard_id: 'w3' (up projection) does not exist in a non-gated "
                                 "layer (is_act_and_mul=False)")
            return expert_data, expert_data.shape[dim]
        half = expert_data.shape[dim] // 2
        if self._interleaved():
            index = [slice(None)] * expert_data.dim()
            index[dim] = slice(0 if shard_id == "w1" else 1, None, 2)
            return expert_data[tuple(index)], half
        return expert_data.narrow(dim, 0 if shard_id == "w1" else half, half), half

    def _load_w13(self, expert_data, shard_id, shard_dim, loaded_weight, what, load_full=False):
        dst, shard_size = self._w13_slot(expert_data, shard_id, shard_dim)
        if not load_full and loaded_weight.dim() > 0:
            loaded_weight = self._narrow_shard(loaded_weight, shard_dim, shard_size, what)
        copy_checked(dst, loaded_weight, what)

    def _load_w2(self, expert_data, shard_dim, loaded_weight, what, load_full=False):
        shard_size = expert_data.shape[shard_dim]
        if not load_full and loaded_weight.dim() > 0:
            loaded_weight = self._narrow_shard(loaded_weight, shard_dim, shard_size, what)
        copy_checked(expert_data, loaded_weight, what)

    def _load_bias(self, expert_data, shard_id, loaded_weight, weight_name, what):
        if "w13_bias" in weight_name and shard_id in ("w1", "w3"):
            self._load_w13(expert_data, shard_id, expert_data.dim() - 1, loaded_weight, what)
        elif "w2_bias" in weight_name and shard_id == "w2":
            # Row-parallel bias: added once, by tensor-parallel rank 0.
            if self.tp_rank == 0:
                copy_checked(expert_data, loaded_weight, what)
            else:
                copy_checked(expert_data, torch.zeros_like(expert_data), what)
        else:
            raise ValueError(f"weight_name: {weight_name!r} with shard_id {shard_id!r} is not a "
                             "bias the loader knows (w13_bias with w1/w3, w2_bias with w2)")

    def _load_scale(self, param, expert_data, expert_id, shard_id, shard_dim, loaded_weight,
                    what):
        kind = getattr(param, "quant_method", None)
        if kind == "channel":
            if shard_id == "w2":
                copy_checked(expert_data, loaded_weight, what)
            else:
                self._load_w13(expert_data, shard_id, shard_dim, loaded_weight, what)
        elif kind in ("group", "block"):
            self._load_weight_rows(expert_data, shard_id, shard_dim, loaded_weight, what,
                                   load_full_w2=getattr(param, "load_full_w2", False))
        elif kind == "tensor":
            target = param.data[expert_id]
            if shard_id in ("w1", "w3") and target.dim() > 0:
                target = target[0 if shard_id == "w1" else 1]
            copy_checked(target, loaded_weight.reshape(target.shape), what)
        else:
            raise ValueError(f"quant method must be one of {list(SCALE_KINDS)} (param."
                             f"quant_method of {what}), got {kind!r}")
