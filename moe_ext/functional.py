"""vLLM's functional fused-MoE API (fused_topk, grouped_topk, fused_experts,
fused_moe) for engines that hold their own weights. Shapes follow vLLM:
hidden_states [M, H], w1 [E, 2I, H] (gated) or [E, I, H], w2 [E, H, I]."""
import torch

from . import _C, packing

_NON_GATED_SUFFIX = "_no_mul"


def _ids_int32(topk_ids):
    if topk_ids.dtype != torch.int32:
        topk_ids = topk_ids.to(torch.int32)
    return topk_ids.contiguous()


def _cast_ids(topk_ids, indices_type):
    return topk_ids if indices_type is None else topk_ids.to(indices_type)


def _quant_mode(w1, w1_scale, w2_scale, a1_scale, a2_scale, block_shape):
    """'none', 'fp8_tensor' or 'fp8_block' from the weights and scales given (vLLM's
    fused_experts arguments); static activation scales are not supported."""
    given = [name for name, value in (("a1_scale", a1_scale), ("a2_scale", a2_scale))
             if value is not None]
    if given:
        raise NotImplementedError(f"{', '.join(given)}: static activation scales are not "
                                  "supported; FP8 activations are quantized dynamically")
    if w1.dtype != torch.float8_e4m3fn:
        if w1_scale is not None or w2_scale is not None or block_shape is not None:
            raise NotImplementedError("w1_scale, w2_scale, block_shape: quantized fused_experts "
                                      "needs float8_e4m3fn weights (INT8/WNA16 are not "
                                      "implemented)")
        return "none"
    if w1_scale is None or w2_scale is None:
        raise ValueError("w1_scale, w2_scale: float8_e4m3fn weights need their scales")
    if block_shape is None:
        return "fp8_tensor"
    if list(block_shape) != [128, 128]:
        raise NotImplementedError(f"block_shape: only [128, 128] is supported, got {block_shape}")
    return "fp8_block"


def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax"):
    """Top-k routing: (topk_weights float32 [M, k], topk_ids [M, k], token_expert_indices).

    token_expert_indices[t, j] = j * M + t, as vLLM's topk kernels report it."""
    _check_tokens(hidden_states, gating_output)
    weights, ids = _C.route(gating_output, topk, scoring_func=scoring_func,
                            renormalize=renormalize)
    m = gating_output.shape[0]
    token_expert_indices = (torch.arange(topk, dtype=torch.int32, device=ids.device)[None, :] * m
                            + torch.arange(m, dtype=torch.int32, device=ids.device)[:, None])
    return weights, _cast_ids(ids, indices_type), token_expert_indices


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None):
    """DeepSeek-style grouped top-k routing: (topk_weights float32, topk_ids int32)."""
    _check_tokens(hidden_states, gating_output)
    if not num_expert_group or not topk_group:
        raise ValueError("num_expert_group, topk_group: grouped_topk needs both (got "
                         f"{num_expert_group}, {topk_group})")
    return _C.route(gating_output, topk, scoring_func=scoring_func, renormalize=renormalize,
                    num_expert_group=num_expert_group, topk_group=topk_group,
                    routed_scaling_factor=routed_scaling_factor,
                    e_score_correction_bias=e_score_correction_bias)


def _check_tokens(hidden_states, gating_output):
    if hidden_states.dim() != 2 or gating_output.dim() != 2:
        raise ValueError("hidden_states, gating_output: expected 2-D tensors, got "
                         f"{tuple(hidden_states.shape)} and {tuple(gating_output.shape)}")
    if hidden_states.shape[0] != gating_output.shape[0]:
        raise ValueError("gating_output: expected one row per token "
                         f"({hidden_states.shape[0]}), got {gating_output.shape[0]}")


def parse_activation(activation, is_act_and_mul=None):
    """(activation name, is_act_and_mul) from a vLLM activation name."""
    name = str(activation).lower()
    if name.endswith(_NON_GATED_SUFFIX):
        return name[: -len(_NON_GATED_SUFFIX)], False
    return name, True if is_act_and_mul is None else is_act_and_mul


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False,
                  activation="silu", apply_router_weight_on_input=False, global_num_experts=-1,
                  expert_map=None, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None,
                  block_shape=None, w1_bias=None, w2_bias=None, swiglu_alpha=1.702,
                  swiglu_limit=7.0, is_act_and_mul=None):
    """The experts for a given routing; returns [M, H] in hidden_states.dtype
    (written into hidden_states when inplace=True). float8_e4m3fn weights with w1_scale /
    w2_scale run w8a8 (per tensor, or 128x128 blocks with block_shape=[128, 128])."""
    quant = _quant_mode(w1, w1_scale, w2_scale, a1_scale, a2_scale, block_shape)
    for name, weight in (("w1", w1), ("w2", w2)):
        if packing.is_packed(weight):
            raise ValueError(f"{name}: holds a FusedMoE's packed Hopper layout; the functional form "
                             "reads row-major weights (moe_ext.packing.row_major(layer, name))")
    act, gated = parse_activation(activation, is_act_and_mul)
    if is_act_and_mul is None and w1.dim() == 3 and w2.dim() == 3 and w1.shape[1] == w2.shape[2]:
        gated = False
    out = _C.experts(hidden_states, w1, w2, topk_weights, _ids_int32(topk_ids), activation=act,
                     is_act_and_mul=gated, w13_bias=w1_bias, w2_bias=w2_bias,
                     expert_map=expert_map, global_num_experts=global_num_experts,
                     apply_router_weight_on_input=apply_router_weight_on_input,
                     swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, quant=quant,
                     w13_scale=w1_scale, w2_scale=w2_scale)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out


def fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, inplace=False,
              activation="silu", use_grouped_topk=False, num_expert_group=None, topk_group=None,
              custom_routing_function=None, scoring_func="softmax", routed_scaling_factor=1.0,
              e_score_correction_bias=None, global_num_experts=-1, expert_map=None,
              apply_router_weight_on_input=False, w1_scale=None, w2_scale=None, a1_scale=None,
              a2_scale=None, block_shape=None, w1_bias=None, w2_bias=None):
    """Routing from gating_output, then fused_experts."""
    if custom_routing_function is not None:
        topk_weights, topk_ids = custom_routing_function(hidden_states, gating_output, topk,
                                                         renormalize)
        topk_weights = topk_weights.to(torch.float32).contiguous()
    else:
        _check_tokens(hidden_states, gating_output)
        groups = (num_expert_group or 0) if use_grouped_topk else 0
        kept = (topk_group or 0) if use_grouped_topk else 0
        if use_grouped_topk and (not groups or not kept):
            raise ValueError("num_expert_group, topk_group: use_grouped_topk needs both")
        topk_weights, topk_ids = _C.route(
            gating_output, topk, scoring_func=scoring_func, renormalize=renormalize,
            num_expert_group=groups, topk_group=kept,
            routed_scaling_factor=routed_scaling_factor,
            e_score_correction_bias=e_score_correction_bias)
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=inplace,
                         activation=activation,
                         apply_router_weight_on_input=apply_router_weight_on_input,
                         global_num_experts=global_num_experts, expert_map=expert_map,
                         w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale,
                         a2_scale=a2_scale, block_shape=block_shape, w1_bias=w1_bias,
                         w2_bias=w2_bias)
