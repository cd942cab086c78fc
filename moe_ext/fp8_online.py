"""Online FP8 loading (vLLM seeds 000 and 002): the orchestration behind the C
method types in csrc/fp8_methods.c.

- create_weights registers the full-precision parameters on the `meta` device
  (nothing is allocated) plus their FP8 scales.
- The first write to a layer materializes its final FP8 weights and scales on
  the target device. Each expert is quantized as soon as its weights have
  arrived (w2 at once; w13 once w1 and, if gated, w3 are in), from a staging
  copy of that expert alone, which is then freed: peak memory is the FP8 layer
  plus about one expert in full precision.
- Loading new full-precision weights into a quantized layer (an RL weight
  update) re-quantizes those experts in place: the parameter objects and their
  storage stay the same, so captured CUDA graphs stay valid.
- Non-finite weights raise ValueError before anything of that expert is
  written. Biases stay in full precision."""
import torch

from . import fp8
from .weight_loading import copy_checked

FP8_BLOCK = 128


def _ceil_div(a, b):
    return (a + b - 1) // b


def _meta_param(shape, dtype, loader):
    param = torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"),
                               requires_grad=False)
    param.weight_loader = loader
    return param


def _target_device(layer):
    device = layer._fp8_device
    return torch.device(device) if device is not None else torch.get_default_device()


def create_weights(method, layer, *args, **kwargs):
    """Dispatches to the MoE or the Linear form of create_weights."""
    if hasattr(layer, "top_k"):
        return _create_moe_weights(method, layer, *args, **kwargs)
    return _create_linear_weights(method, layer, *args, **kwargs)


def _create_moe_weights(method, layer, num_experts, hidden_size, intermediate_size_per_partition,
                        params_dtype, **extra_weight_attrs):
    if params_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"params_dtype: online FP8 loads float16 or bfloat16 checkpoints into "
                        f"float16/bfloat16 layers, got {params_dtype}")
    layer.num_experts = num_experts
    layer.orig_dtype = params_dtype
    layer.weight_block_size = method.weight_block_size
    layer.w13_input_scale = None
    layer.w2_input_scale = None
    layer._fp8_device = extra_weight_attrs.pop("device", None)
    layer._fp8_staging = {}
    layer._fp8_done = set()
    layer._fp8_ready = False
    loader = layer.weight_loader
    rows = (2 if layer.is_act_and_mul else 1) * intermediate_size_per_partition
    inter = intermediate_size_per_partition
    layer.register_parameter("w13_weight", _meta_param((num_experts, rows, hidden_size),
                                                       params_dtype, loader))
    layer.register_parameter("w2_weight", _meta_param((num_experts, hidden_size, inter),
                                                      params_dtype, loader))
    if method.block_quant:
        scales = {"w13_weight_scale_inv": (num_experts, _ceil_div(rows, FP8_BLOCK),
                                           _ceil_div(hidden_size, FP8_BLOCK)),
                  "w2_weight_scale_inv": (num_experts, _ceil_div(hidden_size, FP8_BLOCK),
                                          _ceil_div(inter, FP8_BLOCK))}
    else:
        scales = {"w13_weight_scale": (num_experts,), "w2_weight_scale": (num_experts,)}
    for name, shape in scales.items():
        layer.register_parameter(name, _meta_param(shape, torch.float32, loader))
    layer._fp8_scale_names = tuple(scales)
    if layer.has_bias:
        layer.register_parameter("w13_bias", _meta_param((num_experts, rows), params_dtype,
                                                         loader))
        layer.register_parameter("w2_bias", _meta_param((num_experts, hidden_size),
                                                        params_dtype, loader))


def _create_linear_weights(method, layer, input_size_per_partition, output_partition_sizes,
                           input_size, output_size, params_dtype, **extra_weight_attrs):
    if params_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"params_dtype: online FP8 linear layers take float16 or bfloat16, "
                        f"got {params_dtype}")
    out_features = sum(output_partition_sizes)
    layer.logical_widths = list(output_partition_sizes)
    layer.input_size_per_partition = input_size_per_partition
    layer.output_size_per_partition = out_features
    layer.orig_dtype = params_dtype
    layer.weight_block_size = method.weight_block_size
    layer.input_scale = None
    layer._fp8_device = extra_weight_attrs.pop("device", None)
    layer._fp8_ready = False
    loader = extra_weight_attrs["weight_loader"]
    layer.register_parameter("weight", _meta_param((out_features, input_size_per_partition),
                                                   params_dtype, loader))
    if method.block_quant:
        name, shape = "weight_scale_inv", (_ceil_div(out_features, FP8_BLOCK),
                                           _ceil_div(input_size_per_partition, FP8_BLOCK))
    else:
        name, shape = "weight_scale", (1,)
    layer.register_parameter(name, _meta_param(shape, torch.float32, loader))
    layer._fp8_scale_names = (name,)


def process_weights_after_loading(method, layer):
    """A no-op once every weight has arrived (quantization happened while loading);
    raises if some have not, naming what is missing."""
    if layer._fp8_ready:
        return
    if not hasattr(layer, "top_k"):
        raise RuntimeError("weight: the FP8 linear layer's weight has not been loaded")
    missing = [f"expert {e} {part}" for e in range(layer.local_num_experts)
               for part in ("w13", "w2") if (e, part) not in layer._fp8_done]
    raise RuntimeError(f"FP8 layer {layer.layer_name!r}: weights never arrived for "
                       f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _materialize(layer, names, dtype_of):
    """Gives each still-meta parameter real (uninitialised) storage on the target
    device, keeping the Parameter objects."""
    device = _target_device(layer)
    for name in names:
        param = layer._parameters[name]
        if param.is_meta:
            # swap_tensors keeps the Parameter object (dtype and device change).
            real = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype_of(name),
                                                  device=device), requires_grad=False)
            real.__dict__.update(param.__dict__)  # swap_tensors swaps attributes too
            torch.utils.swap_tensors(param, real)


def _materialize_moe_weights(layer):
    _materialize(layer, ("w13_weight", "w2_weight") + layer._fp8_scale_names,
                 lambda name: fp8.FP8 if name.endswith("_weight") else torch.float32)


FINITE_CHECK_CHUNK = 1 << 22  # elements: keeps the check's temporaries to a few MiB


def _all_finite(source):
    return all(bool(torch.isfinite(chunk).all())
               for chunk in source.reshape(-1).split(FINITE_CHECK_CHUNK))


def _quantize_into(source, weight, scale, block):
    """Quantizes one full-precision matrix into existing FP8 storage and scale(s)."""
    if not _all_finite(source):
        raise ValueError("loaded_weight: contains NaN or Inf; an FP8 layer cannot quantize it "
                         "(nothing was written)")
    if block:
        fp8.quantize_per_block_into(source, weight, scale)
    else:
        fp8.quantize_per_tensor_into(source, weight, scale)


def _quantize_expert(layer, source, weight, scales, local):
    block = layer.weight_block_size is not None
    scale = scales.data[local] if block else scales.data[local:local + 1]
    _quantize_into(source, weight.data[local], scale, block)


def moe_weight_loader(layer, param, loaded_weight, weight_name, shard_id, expert_id,
                      return_success=False):
    """The FusedMoE weight_loader of an online FP8 layer (same call as vLLM's)."""
    params = layer._parameters
    if param is params.get("w13_bias") or param is params.get("w2_bias"):
        _materialize(layer, (n for n in ("w13_bias", "w2_bias") if n in params),
                     lambda name: layer.orig_dtype)
        return layer.load_full_precision(param, loaded_weight, weight_name, shard_id, expert_id,
                                         return_success)
    if param is not params["w13_weight"] and param is not params["w2_weight"]:
        raise ValueError(f"weight_name: {weight_name!r}: an online FP8 layer computes its own "
                         "scales; load only full-precision w1/w2/w3 weights and biases")
    layer._check_shard(shard_id, loaded_weight, weight_name)
    if loaded_weight.dim() == 3:  # all experts at once
        experts = layer._this_ranks_experts(loaded_weight)
        for local in range(layer.local_num_experts):
            _load_expert(layer, experts[local], local, shard_id, weight_name)
        return True if return_success else None
    local = layer._to_local_expert(expert_id)
    if local == -1:
        return False if return_success else None
    _load_expert(layer, loaded_weight, local, shard_id, weight_name)
    return True if return_success else None


def _load_expert(layer, loaded_weight, local, shard_id, weight_name):
    _materialize_moe_weights(layer)
    params = layer._parameters
    w13_scales, w2_scales = (params[name] for name in layer._fp8_scale_names)
    device, dtype = _target_device(layer), layer.orig_dtype
    what = f"{weight_name} (shard {shard_id}, expert {local})"
    if shard_id == "w2":
        shape = tuple(params["w2_weight"].shape[1:])
        dim = 0 if getattr(params["w2_weight"], "is_transposed", False) else 1
        source = layer._narrow_shard(loaded_weight, dim, shape[dim], what)
        if tuple(source.shape) != shape:
            raise ValueError(f"loaded_weight: expected shape {shape} for {what}, got "
                             f"{tuple(source.shape)}")
        source = source.to(device=device, dtype=dtype).contiguous()
        _quantize_expert(layer, source, params["w2_weight"], w2_scales, local)
        layer._fp8_done.add((local, "w2"))
    else:
        staging = layer._fp8_staging.get(local)
        if staging is None:
            staging = (torch.empty(params["w13_weight"].shape[1:], dtype=dtype, device=device),
                       set())
        slot, rows = layer._w13_slot(staging[0], shard_id, 0)
        source = layer._narrow_shard(loaded_weight, 0, rows, what)
        copy_checked(slot, source, what)
        staging[1].add(shard_id)
        layer._fp8_staging[local] = staging
        if staging[1] >= ({"w1", "w3"} if layer.is_act_and_mul else {"w1"}):
            del layer._fp8_staging[local]
            _quantize_expert(layer, staging[0], params["w13_weight"], w13_scales, local)
            layer._fp8_done.add((local, "w13"))
    if len(layer._fp8_done) == 2 * layer.local_num_experts:
        layer._fp8_ready = True


def linear_weight_loader(layer, param, loaded_weight, *unused_args, **unused_kwargs):
    """moe_ext.Linear's loader under online FP8: quantizes the whole weight at once."""
    if param is not layer._parameters["weight"]:
        raise ValueError("loaded_weight: an online FP8 linear layer computes its own scale; "
                         "load only the full-precision weight")
    shape = tuple(param.shape)
    if tuple(loaded_weight.shape) != shape:
        raise ValueError(f"loaded_weight: expected shape {shape}, got "
                         f"{tuple(loaded_weight.shape)}")
    _materialize(layer, ("weight",) + layer._fp8_scale_names,
                 lambda name: fp8.FP8 if name == "weight" else torch.float32)
    source = loaded_weight.to(device=_target_device(layer), dtype=layer.orig_dtype).contiguous()
    scale = layer._parameters[layer._fp8_scale_names[0]]
    _quantize_into(source, param.data, scale.data, layer.weight_block_size is not None)
    layer._fp8_ready = True
