"""FusedMoE: vLLM's Mixture-of-Experts layer as a thin torch.nn.Module over the
C engine (moe_ext._C.MoECore). The module owns the parameters (so state_dict()
works) and vLLM's loading logic; every forward is one C call."""
import torch

from . import _C, fp8_online, packing
from .expert_map import PLACEMENT_STRATEGIES, determine_expert_map, local_expert_ids
from .weight_loading import ExpertWeightLoader

ACTIVATIONS = ("silu", "gelu", "swigluoai", "relu2")
GATED_ONLY = ("swigluoai",)
NON_GATED_ONLY = ("relu2",)
SCORING_FUNCS = ("softmax", "sigmoid")
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _distributed_world():
    """(world_size, rank) of torch.distributed, or (1, 0) when not initialized."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class UnquantizedFusedMoEMethod:
    """Full-precision experts (float32 / float16 / bfloat16): vLLM's default method."""

    supports_eplb = False
    uses_meta_device = False

    def __init__(self, moe=None):
        self.moe = moe

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        device = extra_weight_attrs.pop("device", None)
        rows = (2 if layer.is_act_and_mul else 1) * intermediate_size_per_partition

        def register(name, *shape):
            param = torch.nn.Parameter(torch.empty(*shape, dtype=params_dtype, device=device),
                                       requires_grad=False)
            for key, value in extra_weight_attrs.items():
                setattr(param, key, value)
            layer.register_parameter(name, param)

        register("w13_weight", num_experts, rows, hidden_size)
        register("w2_weight", num_experts, hidden_size, intermediate_size_per_partition)
        if layer.has_bias:
            register("w13_bias", num_experts, rows)
            register("w2_bias", num_experts, hidden_size)

    def process_weights_after_loading(self, layer):
        """Nothing to convert here: FusedMoE packs the weights for the Hopper kernels
        itself (moe_ext.packing)."""

    def get_fused_moe_quant_config(self, layer):
        return None

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts_input=None):
        return layer.forward_routed(x, topk_weights, topk_ids)


class FusedMoE(ExpertWeightLoader, torch.nn.Module):
    """vLLM's FusedMoE (see ../shared/spec/api.md): same constructor keywords,
    parameters, loader and forward; moe_ext-only keywords: tp_rank, ep_rank,
    device, expert_placement_strategy, swiglu_alpha, swiglu_limit."""

    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, params_dtype=None,
                 reduce_results=False, renormalize=True, use_grouped_topk=False,
                 num_expert_group=None, topk_group=None, quant_config=None, tp_size=None,
                 ep_size=None, dp_size=None, pcp_size=None, prefix="",
                 custom_routing_function=None, scoring_func="softmax",
                 routed_scaling_factor=1.0, e_score_correction_bias=None,
                 apply_router_weight_on_input=False, activation="silu", is_act_and_mul=True,
                 enable_eplb=False, num_redundant_experts=0, has_bias=False,
                 is_sequence_parallel=False, expert_mapping=None, n_shared_experts=None,
                 router_logits_dtype=None, gate=None, shared_experts=None,
                 routed_input_transform=None, *, tp_rank=None, ep_rank=None, device=None,
                 expert_placement_strategy="linear", swiglu_alpha=1.702, swiglu_limit=7.0):
        super().__init__()
        _reject_unsupported(dp_size=dp_size, pcp_size=pcp_size,
                            enable_eplb=enable_eplb, num_redundant_experts=num_redundant_experts,
                            is_sequence_parallel=is_sequence_parallel, gate=gate,
                            routed_input_transform=routed_input_transform)
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        if params_dtype not in PARAM_DTYPES:
            raise TypeError(f"params_dtype: expected float32, float16 or bfloat16, got {params_dtype}")
        world_size, world_rank = _distributed_world()
        tp_size = world_size if tp_size is None else tp_size
        ep_size = 1 if ep_size is None else ep_size
        tp_rank = world_rank % tp_size if tp_rank is None else tp_rank
        ep_rank = world_rank % ep_size if ep_rank is None else ep_rank
        _check_config(num_experts, top_k, hidden_size, intermediate_size, tp_size, tp_rank,
                      ep_size, ep_rank, use_grouped_topk, num_expert_group, topk_group,
                      scoring_func, activation, is_act_and_mul, apply_router_weight_on_input,
                      expert_placement_strategy)
        if reduce_results and (tp_size > 1 or ep_size > 1):
            raise NotImplementedError("reduce_results=True with tp_size/ep_size > 1: the "
                                      "all-reduce is left to the caller (sum the ranks' outputs)")

        self.params_dtype = params_dtype
        self.global_num_experts = num_experts + num_redundant_experts
        self.logical_num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = intermediate_size // tp_size
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.dp_size, self.pcp_size = dp_size or 1, pcp_size or 1
        self.reduce_results = reduce_results
        self.renormalize = renormalize
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.custom_routing_function = custom_routing_function
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.e_score_correction_bias = e_score_correction_bias  # by reference, see api.md
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.activation = activation
        self.is_act_and_mul = is_act_and_mul
        self.has_bias = has_bias
        self.enable_eplb = enable_eplb
        self.is_sequence_parallel = is_sequence_parallel
        self.expert_mapping = expert_mapping
        self.n_shared_experts = n_shared_experts
        self.router_logits_dtype = router_logits_dtype
        self.layer_name = prefix
        self.expert_placement_strategy = expert_placement_strategy
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self._shared_experts = shared_experts

        self.register_buffer("_expert_map", None)
        self.update_expert_map()
        self.quant_config = quant_config
        if quant_config is not None and not hasattr(quant_config, "get_quant_method"):
            raise NotImplementedError(f"quant_config: {type(quant_config).__name__} is not a "
                                      "supported quantization config (use Fp8OnlineConfig)")
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method = method if method is not None else UnquantizedFusedMoEMethod()
        quant = getattr(self.quant_method, "block_quant", None)
        self._core = _C.MoECore(
            top_k, activation=activation, is_act_and_mul=is_act_and_mul,
            scoring_func=scoring_func, renormalize=renormalize,
            num_expert_group=num_expert_group if use_grouped_topk else 0,
            topk_group=topk_group if use_grouped_topk else 0,
            routed_scaling_factor=routed_scaling_factor,
            apply_router_weight_on_input=apply_router_weight_on_input,
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
            intermediate_size=self.intermediate_size_per_partition,
            global_num_experts=self.global_num_experts,
            quant="none" if quant is None else ("fp8_block" if quant else "fp8_tensor"))
        self._fp8_scale_names = (None, None)
        self._fp8_ready = True
        self.register_state_dict_post_hook(_row_major_state)
        self.register_load_state_dict_pre_hook(_unpack_before_load)
        self.quant_method.create_weights(
            layer=self, num_experts=self.local_num_experts, hidden_size=hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            params_dtype=params_dtype, weight_loader=self.weight_loader, device=device)
        if device is not None and self._expert_map is not None:
            self._expert_map = self._expert_map.to(device)

    # ---- attributes as in vLLM ----
    @property
    def use_ep(self):
        return self.ep_size > 1

    @property
    def expert_map(self):
        return self._expert_map

    @property
    def shared_experts(self):
        return self._shared_experts

    def _local_expert_ids(self):
        """Global ids of this rank's experts, in local order."""
        if not self.use_ep:
            return list(range(self.global_num_experts))
        return local_expert_ids(self.ep_size, self.ep_rank, self.global_num_experts,
                                self.expert_placement_strategy)

    def update_expert_map(self):
        """Recomputes local_num_experts and expert_map from ep_size / ep_rank."""
        device = self._expert_map.device if self._expert_map is not None else None
        local, expert_map, _ = determine_expert_map(
            self.ep_size, self.ep_rank, self.global_num_experts, self.expert_placement_strategy)
        self.local_num_experts = local
        self._expert_map = expert_map if device is None or expert_map is None \
            else expert_map.to(device)

    def extra_repr(self):
        return (f"global_num_experts={self.global_num_experts}, "
                f"local_num_experts={self.local_num_experts}, "
                f"top_k={self.top_k}, "
                f"intermediate_size_per_partition={self.intermediate_size_per_partition}, "
                f"tp_size={self.tp_size},\n"
                f"ep_size={self.ep_size}, "
                f"reduce_results={self.reduce_results}, ")

    # ---- forward ----
    def forward(self, hidden_states, router_logits):
        """[M, H] hidden states and [M, E] router logits -> [M, H] in hidden_states.dtype;
        (shared_out, routed_out) when the layer has shared_experts."""
        if not self._fp8_ready:
            raise RuntimeError(f"FusedMoE {self.layer_name!r}: the FP8 weights are not fully "
                               "loaded yet")
        if self.custom_routing_function is None:
            p = self._parameters
            w13_scale, w2_scale = self._fp8_scale_names
            out = self._core.forward(hidden_states, router_logits, p["w13_weight"],
                                     p["w2_weight"], p.get("w13_bias"), p.get("w2_bias"),
                                     p.get(w13_scale), p.get(w2_scale),
                                     self.e_score_correction_bias, self._expert_map)
        else:
            topk_weights, topk_ids = self.select_experts(
                hidden_states, router_logits, self.top_k, False, self.renormalize,
                custom_routing_function=self.custom_routing_function,
                global_num_experts=self.global_num_experts)
            out = self.forward_routed(hidden_states, topk_weights, topk_ids)
        if self._shared_experts is not None:
            return self._shared_experts(hidden_states), out
        return out

    def forward_routed(self, hidden_states, topk_weights, topk_ids):
        """The experts for routing computed elsewhere (float32 weights, int32 ids)."""
        p = self._parameters
        w13_scale, w2_scale = self._fp8_scale_names
        return self._core.forward_routed(hidden_states, topk_weights, topk_ids, p["w13_weight"],
                                         p["w2_weight"], p.get("w13_bias"), p.get("w2_bias"),
                                         p.get(w13_scale), p.get(w2_scale), self._expert_map)

    @staticmethod
    def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
                       topk_group=None, num_expert_group=None, custom_routing_function=None,
                       scoring_func="softmax", routed_scaling_factor=1.0,
                       e_score_correction_bias=None, indices_type=None, enable_eplb=False,
                       global_num_experts=None, **unused_eplb_state):
        """Routing: (topk_weights float32 [M, k], topk_ids int32 [M, k] or indices_type)."""
        if enable_eplb:
            raise NotImplementedError("enable_eplb: the expert-parallel load balancer is not "
                                      "supported")
        if custom_routing_function is not None:
            topk_weights, topk_ids = custom_routing_function(hidden_states, router_logits, top_k,
                                                             renormalize)
            experts = global_num_experts or router_logits.shape[-1]
            topk_weights, topk_ids = _checked_custom_routing(topk_weights, topk_ids,
                                                             hidden_states.shape[0], experts)
        else:
            if use_grouped_topk and (not num_expert_group or not topk_group):
                raise ValueError("num_expert_group, topk_group: use_grouped_topk needs both")
            topk_weights, topk_ids = _C.route(
                router_logits, top_k, scoring_func=scoring_func, renormalize=renormalize,
                num_expert_group=num_expert_group if use_grouped_topk else 0,
                topk_group=topk_group if use_grouped_topk else 0,
                routed_scaling_factor=routed_scaling_factor,
                e_score_correction_bias=e_score_correction_bias)
        if indices_type is not None:
            topk_ids = topk_ids.to(indices_type)
        return topk_weights, topk_ids

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id,
                      return_success=False):
        """vLLM's FusedMoE.weight_loader: copies one checkpoint tensor into its slice of
        `param` (online FP8 layers quantize each expert as soon as it is complete).
        Returns False (with return_success=True) for experts on other EP ranks.
        Packed weights are unpacked first; process_weights_after_loading() packs
        them again."""
        if self.weights_packed and any(param is self._parameters.get(name)
                                        for name in ("w13_weight", "w2_weight")):
            self._set_weights_packed(False)
        if getattr(self.quant_method, "uses_meta_device", False):
            return fp8_online.moe_weight_loader(self, param, loaded_weight, weight_name,
                                                shard_id, expert_id, return_success)
        return self.load_full_precision(param, loaded_weight, weight_name, shard_id, expert_id,
                                        return_success)

    def process_weights_after_loading(self):
        """Idempotent: hands the loaded weights to the quant method, then packs w13 / w2
        for the Hopper kernels where the layer's device and shapes allow it
        (moe_ext.packing; unpacks them where they no longer do)."""
        self.quant_method.process_weights_after_loading(self)
        w13, w2 = self._parameters["w13_weight"], self._parameters["w2_weight"]
        self._set_weights_packed(packing.enabled() and packing.packable(self.params_dtype, w13, w2))

    @property
    def weights_packed(self):
        """Whether w13_weight / w2_weight hold the packed layout of the Hopper kernels
        (moe_ext.packing; packing.row_major(layer, name) gives the row-major form). The
        engine's flag, read by every forward, is the layer's record of it; _set_weights_packed
        sets it together with the parameters' own mark (packing.is_packed, which the
        functional form checks, having no layer)."""
        return self._core.weights_packed

    def _set_weights_packed(self, packed):
        if packed == self.weights_packed:
            return
        convert = packing.pack_ if packed else packing.unpack_
        for name in ("w13_weight", "w2_weight"):
            convert(self._parameters[name])
        self._core.weights_packed = packed

    # ---- reductions vLLM model code asks the layer about (seed 001) ----
    def must_reduce_shared_expert_outputs(self):
        """False: no all-to-all combine kernels here, so shared-expert outputs are reduced
        once, together with the routed output, at the end of the MoE block."""
        return False

    def maybe_all_reduce_tensor_model_parallel(self, final_hidden_states):
        """Sums the ranks' outputs over torch.distributed when the layer is sharded
        (tp_size or ep_size > 1); returns the tensor unchanged otherwise."""
        if self.tp_size == 1 and self.ep_size == 1:
            return final_hidden_states
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("maybe_all_reduce_tensor_model_parallel: a sharded layer needs "
                               "torch.distributed initialized to sum the ranks' outputs")
        dist.all_reduce(final_hidden_states)
        return final_hidden_states

    # ---- expert-parallel load balancer hooks (vLLM seed 001) ----
    def get_expert_weights(self):
        """Per-expert views [local_num_experts, -1] of every expert parameter (not the
        routing bias, which is per logical expert, nor shared-expert parameters)."""
        return [p.view(self.local_num_experts, -1) for name, p in self.named_parameters()
                if p.dim() > 0 and name != "e_score_correction_bias"
                and not name.startswith(("_shared_experts.", "_gate."))]

    def set_eplb_state(self, moe_layer_idx, expert_load_view, logical_to_physical_map,
                       logical_replica_count):
        self.expert_load_view = expert_load_view[moe_layer_idx]
        self.logical_to_physical_map = logical_to_physical_map[moe_layer_idx]
        self.logical_replica_count = logical_replica_count[moe_layer_idx]

    @classmethod
    def make_expert_params_mapping(cls, model=None, ckpt_gate_proj_name=None,
                                   ckpt_down_proj_name=None, ckpt_up_proj_name=None,
                                   num_experts=None, num_redundant_experts=0):
        """[(param_name, weight_name, expert_id, shard_id)] as vLLM builds it; `model` may be
        omitted (the older signature, names first, is accepted too)."""
        if isinstance(model, str):  # make_expert_params_mapping(gate, down, up, num_experts)
            model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts = (
                None, model, ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name)
        if None in (ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, num_experts):
            raise ValueError("ckpt_gate_proj_name, ckpt_down_proj_name, ckpt_up_proj_name, "
                             "num_experts: all are required")
        physical_to_logical = list(range(num_experts)) + [
            i % num_experts for i in range(num_redundant_experts)]
        base_layer = ""
        if model is not None and any(".base_layer." in name
                                     for name, _ in model.named_parameters()):
            base_layer = "base_layer."
        shards = [("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name),
                  ("w3", ckpt_up_proj_name)]
        return [
            (f"experts.{base_layer}w13_" if name in (ckpt_gate_proj_name, ckpt_up_proj_name)
             else f"experts.{base_layer}w2_",
             f"experts.{physical_to_logical[expert_id]}.{name}.{base_layer}",
             expert_id, shard_id)
            for expert_id in range(num_experts + num_redundant_experts)
            for shard_id, name in shards
        ]

    def load_weights(self, weights):
        """Loads (checkpoint name, tensor) pairs through expert_mapping; yields the names of
        the parameters loaded."""
        if self.expert_mapping is None:
            raise ValueError("expert_mapping: must be given to the constructor to use "
                             "load_weights")
        for expert_name, loaded_weight in weights:
            qual_name = f"{self.layer_name}.{expert_name}"
            for param_name, weight_name, expert_id, shard_id in self.expert_mapping:
                if weight_name not in qual_name:
                    continue
                new_name = qual_name.replace(weight_name, param_name)
                param_name = new_name.removeprefix(f"{self.layer_name}.")
                param = getattr(self, param_name)
                if self.weight_loader(param, loaded_weight, new_name, shard_id=shard_id,
                                      expert_id=expert_id, return_success=True):
                    yield param_name


def _row_major_state(layer, state, prefix, local_metadata):
    """state_dict() holds the row-major layout, packed or not (a copy where packed)."""
    if layer.weights_packed:
        for name in ("w13_weight", "w2_weight"):
            if prefix + name in state:
                state[prefix + name] = packing.unpacked(state[prefix + name])


def _unpack_before_load(layer, state, prefix, *unused):
    """load_state_dict() writes row-major weights: a packed layer is unpacked first (and
    packed again by process_weights_after_loading(), as after the weight loader)."""
    layer._set_weights_packed(False)


def _checked_custom_routing(topk_weights, topk_ids, num_tokens, num_experts):
    """Validates a custom routing function's output. The id range is checked on the
    CPU only: on a GPU that would be a host sync, and the CUDA engine instead lets
    out-of-range ids contribute nothing."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype.is_floating_point or \
            topk_ids.dtype == torch.bool:
        raise TypeError("custom_routing_function: topk_ids must be an integer tensor")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or \
            tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError("custom_routing_function: expected topk_weights and topk_ids of shape "
                         f"[{num_tokens}, k], got {tuple(topk_weights.shape)} and "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.numel() and not topk_ids.is_cuda:
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"custom_routing_function: topk_ids holds expert id "
                             f"{low if low < 0 else high}, outside [0, {num_experts})")
    return topk_weights.to(torch.float32).contiguous(), topk_ids.to(torch.int32).contiguous()


def _reject_unsupported(**features):
    defaults = {"dp_size": (None, 1), "pcp_size": (None, 1), "num_redundant_experts": (0,),
                "enable_eplb": (False,), "is_sequence_parallel": (False,)}
    for name, value in features.items():
        if value is None or value in defaults.get(name, (None,)):
            continue
        what = {
            "dp_size": "data parallelism across ranks (dp_size > 1) is not supported",
            "pcp_size": "prefill context parallelism (pcp_size > 1) is not supported",
            "enable_eplb": "the expert-parallel load balancer is not supported",
            "num_redundant_experts": "redundant experts (EPLB) are not supported",
            "is_sequence_parallel": "sequence-parallel MoE is not supported",
            "gate": "a gate module run inside the layer is not supported; pass router_logits",
            "routed_input_transform": "routed_input_transform is not supported",
        }[name]
        raise NotImplementedError(f"{name}: {what}")


def _check_config(num_experts, top_k, hidden_size, intermediate_size, tp_size, tp_rank, ep_size,
                  ep_rank, use_grouped_topk, num_expert_group, topk_group, scoring_func,
                  activation, is_act_and_mul, apply_router_weight_on_input,
                  expert_placement_strategy):
    def positive(name, value):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")

    for name, value in (("num_experts", num_experts), ("top_k", top_k),
                        ("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                        ("tp_size", tp_size), ("ep_size", ep_size)):
        positive(name, value)
    if top_k > num_experts:
        raise ValueError(f"top_k: {top_k} exceeds num_experts ({num_experts})")
    if intermediate_size % tp_size:
        raise ValueError(f"intermediate_size: {intermediate_size} is not divisible by "
                         f"tp_size {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: expected 0 <= tp_rank < {tp_size}, got {tp_rank}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank: expected 0 <= ep_rank < {ep_size}, got {ep_rank}")
    if expert_placement_strategy not in PLACEMENT_STRATEGIES:
        raise ValueError("expert_placement_strategy: expected 'linear' or 'round_robin', got "
                         f"{expert_placement_strategy!r}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func: expected 'softmax' or 'sigmoid', got {scoring_func!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if is_act_and_mul and activation in NON_GATED_ONLY:
        raise ValueError(f"activation: {activation!r} needs is_act_and_mul=False")
    if not is_act_and_mul and activation in GATED_ONLY:
        raise ValueError(f"activation: {activation!r} needs is_act_and_mul=True")
    if apply_router_weight_on_input and top_k != 1:
        raise ValueError(f"apply_router_weight_on_input: only supported with top_k == 1, "
                         f"got top_k = {top_k}")
    if use_grouped_topk:
        if num_expert_group is None or topk_group is None:
            raise ValueError("num_expert_group, topk_group: use_grouped_topk needs both")
        positive("num_expert_group", num_expert_group)
        positive("topk_group", topk_group)
        if num_experts % num_expert_group:
            raise ValueError(f"num_expert_group: {num_expert_group} does not divide "
                             f"num_experts ({num_experts})")
        if topk_group > num_expert_group:
            raise ValueError(f"topk_group: {topk_group} exceeds num_expert_group "
                             f"({num_expert_group})")
        if topk_group * (num_experts // num_expert_group) < top_k:
            raise ValueError(f"top_k: {top_k} exceeds the experts in {topk_group} kept groups")
