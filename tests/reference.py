"""Float64 reference of moe_ext numerics, from shared/spec/numerics.md alone (no moe_ext)."""
import math

import torch

F64 = torch.float64

# numerics.md "Tolerances": relative Frobenius error bound per layer dtype.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 5e-3}
# Routing ids are compared only where the k-th and (k+1)-th scores differ by this much.
NEAR_TIE = 1e-6


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in float64; fails on NaN/Inf in either and on an all-zero ref."""
    out = out.detach().to("cpu", F64)
    ref = ref.detach().to("cpu", F64)
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), "NaN in the output"
    assert torch.isfinite(out).all(), "Inf in the output"
    assert torch.isfinite(ref).all(), "non-finite reference"
    if ref.numel() == 0:
        return 0.0
    den = torch.linalg.vector_norm(ref)
    assert den > 0, "all-zero reference: the test inputs are degenerate"
    return float(torch.linalg.vector_norm(out - ref) / den)


# ---------------------------------------------------------------- routing

def scores(router_logits, scoring_func):
    """Softmax or sigmoid of the logits, in float64."""
    logits = router_logits.to(F64)
    if scoring_func == "softmax":
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        ex = torch.exp(shifted)
        return ex / ex.sum(dim=-1, keepdim=True)
    if scoring_func == "sigmoid":
        return 1.0 / (1.0 + torch.exp(-logits))
    raise ValueError(scoring_func)


def _topk_lower_index_first(values, k):
    """Indices of the k largest values per row, ties to the lower index (stable sort)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return order[:, :k]


def _gap(sorted_desc, k):
    """Per row: sorted[k-1] - sorted[k] (inf when there is no (k+1)-th or it is -inf)."""
    m = sorted_desc.shape[0]
    if sorted_desc.shape[1] <= k:
        return torch.full((m,), math.inf, dtype=F64, device=sorted_desc.device)
    a, b = sorted_desc[:, k - 1], sorted_desc[:, k]
    gap = a - b
    return torch.where(torch.isinf(b) & (b < 0), torch.full_like(gap, math.inf), gap)


def route(router_logits, top_k, renormalize=True, scoring_func="softmax", num_expert_group=0,
          topk_group=0, routed_scaling_factor=1.0, e_score_correction_bias=None):
    """numerics.md "Routing" in float64.

    Returns (topk_weights [M, k] f64, topk_ids [M, k] int64, margin [M] f64) where margin is the
    smallest score gap that decides the chosen set (k-th vs (k+1)-th choice score and, when
    grouped, the topk_group-th vs next group score); tokens with margin < NEAR_TIE are near-ties."""
    s = scores(router_logits, scoring_func)
    m, e = s.shape
    choice = s.clone()
    if e_score_correction_bias is not None:
        choice = choice + e_score_correction_bias.to(device=s.device, dtype=F64)[None, :]
    margin = torch.full((m,), math.inf, dtype=F64, device=s.device)
    if num_expert_group:
        groups = choice.view(m, num_expert_group, e // num_expert_group)
        if e_score_correction_bias is not None:
            group_score = groups.sort(dim=-1, descending=True).values[:, :, :2].sum(dim=-1)
        else:
            group_score = groups.max(dim=-1).values
        kept = _topk_lower_index_first(group_score, topk_group)
        margin = torch.minimum(margin, _gap(group_score.sort(dim=-1, descending=True).values,
                                            topk_group))
        keep = torch.zeros(m, num_expert_group, dtype=torch.bool, device=s.device)
        keep.scatter_(1, kept, True)
        keep = keep[:, :, None].expand(m, num_expert_group, e // num_expert_group).reshape(m, e)
        choice = choice.masked_fill(~keep, -math.inf)
    ids = _topk_lower_index_first(choice, top_k)
    margin = torch.minimum(margin, _gap(choice.sort(dim=-1, descending=True).values, top_k))
    weights = torch.gather(s, 1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    return weights, ids, margin


def sorted_by_id(weights, ids):
    """(weights, ids) with each row reordered by ascending id, to compare chosen sets."""
    ids = ids.to(torch.int64)
    order = ids.argsort(dim=-1)
    return torch.gather(weights.to(F64), 1, order), torch.gather(ids, 1, order)


# ---------------------------------------------------------------- experts

def _silu(v):
    return v / (1.0 + torch.exp(-v))


def _gelu_erf(v):
    return 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0)))


def activation_fn(h, activation, is_act_and_mul=True, swiglu_alpha=1.702, swiglu_limit=7.0):
    """act(h) for h [..., N1]: gated (N1 = 2I) or non-gated (N1 = I); float64 in and out."""
    if not is_act_and_mul:
        if activation == "relu2":
            return torch.clamp(h, min=0.0) ** 2
        if activation == "silu":
            return _silu(h)
        if activation == "gelu":
            return _gelu_erf(h)
        raise ValueError(activation)
    if activation == "swigluoai":
        gate, up = h[..., 0::2], h[..., 1::2]
        g = torch.clamp(gate, max=swiglu_limit)
        u = torch.clamp(up, min=-swiglu_limit, max=swiglu_limit)
        return (u + 1.0) * g * (1.0 / (1.0 + torch.exp(-swiglu_alpha * g)))
    i = h.shape[-1] // 2
    gate, up = h[..., :i], h[..., i:]
    if activation == "silu":
        return _silu(gate) * up
    if activation == "gelu":
        return _gelu_erf(gate) * up
    raise ValueError(activation)


def experts(hidden_states, w13, w2, topk_weights, topk_ids, activation="silu",
            is_act_and_mul=True, w13_bias=None, w2_bias=None, expert_map=None,
            apply_router_weight_on_input=False, swiglu_alpha=1.702, swiglu_limit=7.0,
            act_dtype=None):
    """numerics.md "Experts" in float64 -> [M, H] float64.

    w13 [E_local, N1, H] (N1 = 2I gated; gate/up interleaved for swigluoai), w2 [E_local, H, I];
    topk_ids are global ids; expert_map [E_global] (global -> local, -1 elsewhere) or None.
    act_dtype: when bf16/fp16, the activation output is rounded to it before the second GEMM."""
    dev = hidden_states.device
    x = hidden_states.to(F64)
    w13, w2 = w13.to(dev), w2.to(dev)  # converted to float64 one expert at a time below
    b13 = None if w13_bias is None else w13_bias.to(device=dev, dtype=F64)
    b2 = None if w2_bias is None else w2_bias.to(device=dev, dtype=F64)
    tw = topk_weights.to(device=dev, dtype=F64)
    ids = topk_ids.to(device=dev, dtype=torch.int64)
    m, hsize = x.shape
    out = torch.zeros(m, hsize, dtype=F64, device=dev)
    if m == 0:
        return out
    local = ids if expert_map is None else expert_map.to(device=dev, dtype=torch.int64)[ids]
    for e in torch.unique(local).tolist():
        if e < 0:
            continue  # expert on another rank: contributes nothing here
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        w = tw[tok, slot][:, None]
        xe = x[tok] * w if apply_router_weight_on_input else x[tok]
        h = xe @ w13[e].to(F64).T
        if b13 is not None:
            h = h + b13[e]
        a = activation_fn(h, activation, is_act_and_mul, swiglu_alpha, swiglu_limit)
        if act_dtype in (torch.bfloat16, torch.float16):
            a = a.to(act_dtype).to(F64)
        y = a @ w2[e].to(F64).T
        if b2 is not None:
            y = y + b2[e]
        if not apply_router_weight_on_input:
            y = y * w
        out.index_add_(0, tok, y)
    return out


def moe(hidden_states, router_logits, w13, w2, top_k, renormalize=True, scoring_func="softmax",
        num_expert_group=0, topk_group=0, routed_scaling_factor=1.0,
        e_score_correction_bias=None, **experts_kwargs):
    """Routing then experts; returns (out [M, H] f64, margin [M]) so near-tie tokens can be
    left out of a comparison."""
    weights, ids, margin = route(router_logits, top_k, renormalize, scoring_func,
                                 num_expert_group, topk_group, routed_scaling_factor,
                                 e_score_correction_bias)
    return experts(hidden_states, w13, w2, weights, ids, **experts_kwargs), margin


def gated_w13(w1, w3, interleaved=False):
    """[E, 2I, H] from gate w1 [E, I, H] and up w3 [E, I, H]: halves, or rows 2i / 2i+1."""
    if interleaved:
        return torch.stack([w1, w3], dim=2).reshape(w1.shape[0], 2 * w1.shape[1], *w1.shape[2:])
    return torch.cat([w1, w3], dim=1)


# ---------------------------------------------------------------- FP8 (numerics.md "FP8")
# Torch renderings of the quantizer formulas, every step in float32 in the order numerics.md
# writes it; moe_ext's quantizers must match them bit for bit.

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _pad_last(t, multiple, dim_from_end=1):
    """t zero-padded at the end of dimension -dim_from_end to a multiple of `multiple`."""
    size = t.shape[-dim_from_end]
    extra = -size % multiple
    if not extra:
        return t
    pad = [0, 0] * (dim_from_end - 1) + [0, extra]
    return torch.nn.functional.pad(t, pad)


def fp8_quant_tensor(x, scale=None):
    """Per tensor: scale = max(amax/448, 1/(448*512)) (or `scale` as given),
    q = fp8(clamp(x * (1/scale), -448, 448)) in float32. Returns (q, scale float32 [1])."""
    xf = x.detach().to(torch.float32)
    if scale is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=xf.device)
        floor = torch.tensor(1.0 / (448.0 * 512.0), dtype=torch.float32, device=xf.device)
        scale = torch.maximum(amax / FP8_MAX, floor)
    scale = scale.detach().to(device=xf.device, dtype=torch.float32).reshape(())
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.reshape(1)


def fp8_quant_block(x, block=(128, 128), use_ue8m0=False):
    """Per block over the last two dims, padded to multiples of the block:
    sf = max(amax, 1e-4)/448 (use_ue8m0: 2^ceil(log2 sf), exact through frexp),
    q = fp8(x * (1/sf)) in float32. Returns (q, sf [..., ceil(R/br), ceil(C/bc)])."""
    br, bc = block
    xf = x.detach().to(torch.float32)
    *lead, rows, cols = xf.shape
    padded = _pad_last(_pad_last(xf, bc, 1), br, 2)
    nr, nc = padded.shape[-2] // br, padded.shape[-1] // bc
    blocks = padded.reshape(*lead, nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(-3, -1))
    sf = amax.clamp(min=1e-4) / FP8_MAX
    if use_ue8m0:
        mant, expo = torch.frexp(sf)  # sf = mant * 2^expo, mant in [0.5, 1)
        sf = torch.where(mant == 0.5, sf, torch.ldexp(torch.ones_like(sf), expo))
    inv = 1.0 / sf
    q = (blocks * inv[..., :, None, :, None]).to(FP8)
    q = q.reshape(*lead, nr * br, nc * bc)[..., :rows, :cols]
    return q.contiguous(), sf


def fp8_quant_group(x, group_size=128):
    """Per row and `group_size` columns: s = max(amax, 1e-10)/448,
    q = fp8(clamp(x / s, -448, 448)) in float32. Returns (q, s [..., ceil(C/group)])."""
    xf = x.detach().to(torch.float32)
    *lead, cols = xf.shape
    padded = _pad_last(xf, group_size, 1)
    groups = padded.reshape(*lead, padded.shape[-1] // group_size, group_size)
    s = groups.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (groups / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.reshape(*lead, padded.shape[-1])[..., :cols]
    return q.contiguous(), s


def fp8_dequant_tensor(q, scale):
    """float64 q * scale (scale: one value, or [E] for a stacked [E, ...] q)."""
    s = scale.detach().to(device=q.device, dtype=F64)
    if s.numel() > 1:
        s = s.reshape(-1, *([1] * (q.dim() - 1)))
    else:
        s = s.reshape(())
    return q.to(F64) * s


def fp8_dequant_block(q, sf, block=(128, 128)):
    """float64 q * sf with each block's scale spread over its (cropped) block."""
    br, bc = block
    rows, cols = q.shape[-2:]
    full = sf.detach().to(device=q.device, dtype=F64)
    full = full.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :rows, :cols]
    return q.to(F64) * full


def fake_quant_tensor(x):
    """x through per-tensor FP8 and back, float64."""
    q, s = fp8_quant_tensor(x)
    return fp8_dequant_tensor(q, s)


def fake_quant_group(x, group_size=128):
    """x through per-token-group FP8 and back, float64."""
    q, s = fp8_quant_group(x, group_size)
    full = s.to(F64).repeat_interleave(group_size, dim=-1)[..., :x.shape[-1]]
    return q.to(F64) * full


def fp8_experts(hidden_states, w13, w2, topk_weights, topk_ids, block, activation="silu",
                is_act_and_mul=True, w13_bias=None, w2_bias=None, expert_map=None,
                swiglu_alpha=1.702, swiglu_limit=7.0, act_dtype=torch.bfloat16, act_amax_ulps=0):
    """numerics.md "Experts" + "FP8" w8a8 in float64 -> [M, H] float64.

    w13 / w2: the dequantized FP8 weights (any float dtype), [E_local, N1, H] / [E_local, H, I].
    GEMM1 input: x fake-quantized per tensor (block=False) with one scale over the tokens that
    have at least one local expert (all tokens without an expert_map; abi.h: quantization
    covers the rows of local experts only; vLLM takes all tokens, which differs only under EP),
    or per token and 128 columns (block=True). GEMM2 input: the activation output rounded to
    act_dtype, then fake-quantized per tensor over all (token, slot) rows of local experts, or
    per row and 128 columns. The block GEMMs' per-128-K-slice scaling equals
    dequantize-then-matmul exactly.

    act_amax_ulps (per tensor only): take the activation amax that many act_dtype ulps away
    from the reference's own. The per-tensor scale hangs on that one rounded value: an engine
    whose GEMM lands one ulp away on the largest activation (its FP8 tensor cores do not add in
    exact float32) re-rounds the whole tensor on a shifted grid, ~2% apart, while being as
    right as the reference."""
    dev = hidden_states.device
    m, hsize = hidden_states.shape
    out = torch.zeros(m, hsize, dtype=F64, device=dev)
    if m == 0:
        return out
    b13 = None if w13_bias is None else w13_bias.to(device=dev, dtype=F64)
    b2 = None if w2_bias is None else w2_bias.to(device=dev, dtype=F64)
    tw = topk_weights.to(device=dev, dtype=F64)
    ids = topk_ids.to(device=dev, dtype=torch.int64)
    local = ids if expert_map is None else expert_map.to(device=dev, dtype=torch.int64)[ids]
    has_local = (local >= 0).any(dim=1)
    if not bool(has_local.any()):
        return out
    if block:
        xq = fake_quant_group(hidden_states)
    else:
        _, x_scale = fp8_quant_tensor(hidden_states[has_local])
        xq = fp8_dequant_tensor(fp8_quant_tensor(hidden_states, x_scale)[0], x_scale)
    pieces = []  # (expert, tokens, slots, activation rows)
    for e in torch.unique(local).tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(local == e, as_tuple=True)
        h = xq[tok] @ w13[e].to(device=dev, dtype=F64).T
        if b13 is not None:
            h = h + b13[e]
        a = activation_fn(h, activation, is_act_and_mul, swiglu_alpha, swiglu_limit)
        pieces.append((e, tok, slot, a.to(act_dtype)))
    if not pieces:
        return out
    if block:
        quantized = [fake_quant_group(a) for *_, a in pieces]
    else:
        rows = torch.cat([a for *_, a in pieces])
        _, scale = fp8_quant_tensor(rows)
        if act_amax_ulps:
            amax = rows.abs().amax().reshape(1)  # act_dtype, exact
            bits = amax.view(torch.int16) + act_amax_ulps  # positive: the bit pattern steps one ulp
            shifted = bits.view(act_dtype).to(torch.float32)
            scale = torch.maximum(shifted / FP8_MAX, torch.tensor(1.0 / (448.0 * 512.0)))
        quantized = [fp8_dequant_tensor(fp8_quant_tensor(a, scale)[0], scale)
                     for *_, a in pieces]
    for (e, tok, slot, _), aq in zip(pieces, quantized):
        y = aq @ w2[e].to(device=dev, dtype=F64).T
        if b2 is not None:
            y = y + b2[e]
        out.index_add_(0, tok, y * tw[tok, slot][:, None])
    return out
