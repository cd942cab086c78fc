"""FP8: the quantizers (bit-exact against a torch rendering of numerics.md), the forward of
online-FP8 FusedMoE layers (against float64 math on dequantized weights and fake-quantized
activations, and against the unquantized bf16 layer) and of moe_ext.Linear, on CPU and CUDA."""
import pytest
import torch

import moe_ext
from moe_ext import Fp8OnlineConfig, FusedMoE, packing
from helpers import capture_forward, keep_rows, randn, replay
import reference as ref
from test_loading import build_model, checkpoint, vllm_load

FP8 = torch.float8_e4m3fn
FP8_TOL = 2e-2       # numerics.md: fp8 layer vs float math on dequantized weights, fake-quant acts
FP8_VS_BF16 = 8e-2   # numerics.md: fp8 layer vs the unquantized bf16 layer
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
METHODS = {"tensor": None, "block": [128, 128]}

# odd sizes: H and I not multiples of 128 (edge blocks and groups), E odd, top_k 3
E, K, H, I = 7, 3, 200, 130


def u8(t):
    """The raw bytes of a tensor (any dtype), for bit-exact comparison."""
    return t.detach().contiguous().view(torch.uint8).cpu().clone()  # a copy, never an alias


def assert_bits_equal(q, q_ref, what="q"):
    got, want = u8(q), u8(q_ref)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got != want).nonzero()
    assert diff.numel() == 0, (f"{what}: {diff.shape[0]} of {got.numel()} bytes differ, first at "
                               f"{diff[0].tolist()}: {int(got[tuple(diff[0])])} != "
                               f"{int(want[tuple(diff[0])])}")


def assert_scales_equal(s, s_ref, what="scale"):
    assert s.dtype == torch.float32, f"{what}: dtype {s.dtype}"
    assert tuple(s.shape) == tuple(s_ref.shape), f"{what}: shape {tuple(s.shape)} != " \
                                                 f"{tuple(s_ref.shape)}"
    assert torch.equal(s.cpu().view(torch.int32), s_ref.cpu().view(torch.int32)), \
        f"{what}: {s.flatten()[:4].tolist()} != {s_ref.flatten()[:4].tolist()}"


def spread(gen, *shape, dtype=torch.float32, device="cpu"):
    """Random values over many magnitudes (subnormal FP8 results included), never zero."""
    mag = torch.exp2(torch.randint(-12, 6, shape, generator=gen).to(torch.float32))
    t = torch.randn(*shape, generator=gen) * mag
    t = torch.where(t == 0, torch.full_like(t, 0.37), t)
    return t.to(dtype).to(device)


# ================================================================ quantizers

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (33, 200), (3, 5, 130), (4096,)], ids=str)
def test_scaled_fp8_quant_dynamic(shape, dtype, device, gen):
    x = spread(gen, *shape, dtype=dtype, device=device)
    q, s = moe_ext.scaled_fp8_quant(x)
    q_ref, s_ref = ref.fp8_quant_tensor(x.cpu())
    assert q.dtype == FP8 and q.device == x.device and tuple(q.shape) == shape
    assert s.device == x.device
    assert_scales_equal(s, s_ref)
    assert_bits_equal(q, q_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_fp8_quant_tiny_input_uses_the_scale_floor(dtype, device, gen):
    x = (randn(gen, 17, 9) * 1e-6).to(dtype).to(device)  # amax / 448 < 1 / (448 * 512)
    q, s = moe_ext.scaled_fp8_quant(x)
    q_ref, s_ref = ref.fp8_quant_tensor(x.cpu())
    assert s_ref.item() == torch.tensor(1.0 / (448 * 512), dtype=torch.float32).item()
    assert_scales_equal(s, s_ref)
    assert_bits_equal(q, q_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("factor", [0.4, 1.0, 3.0])  # 0.4: most values saturate at +-448
def test_scaled_fp8_quant_static_scale(factor, dtype, device, gen):
    x = spread(gen, 45, 77, dtype=dtype, device=device)
    amax = x.float().abs().max()
    scale = (amax / 448 * factor).reshape(1).to(device)
    q, s = moe_ext.scaled_fp8_quant(x, scale=scale)
    q_ref, s_ref = ref.fp8_quant_tensor(x.cpu(), scale=scale.cpu())
    assert_scales_equal(s, s_ref)
    assert_bits_equal(q, q_ref)
    if factor < 1:
        assert (q.float().abs() == 448).any(), "saturation case did not saturate"
    assert torch.equal(scale, (amax / 448 * factor).reshape(1).to(device)), "scale was modified"


@pytest.mark.parametrize("use_ue8m0", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(200, 130), (1, 1), (128, 256), (3, 130, 257), (2, 2, 5, 129)],
                         ids=str)
def test_per_block_cast_to_fp8(shape, dtype, use_ue8m0, device, gen):
    x = spread(gen, *shape, dtype=dtype, device=device)
    q, sf = moe_ext.per_block_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    q_ref, sf_ref = ref.fp8_quant_block(x.cpu(), use_ue8m0=use_ue8m0)
    want = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    assert tuple(sf.shape) == want and sf.device == x.device
    assert q.dtype == FP8 and tuple(q.shape) == shape
    assert_scales_equal(sf, sf_ref)
    assert_bits_equal(q, q_ref)
    if use_ue8m0:
        mant, _ = torch.frexp(sf.cpu())
        assert (mant == 0.5).all(), "ue8m0 scales must be powers of two"


def test_per_block_cast_to_fp8_tiny_block_uses_the_floor(device, gen):
    x = randn(gen, 130, 140, device=device)
    x[:128, 128:] *= 1e-7  # block (0, 1): amax below 1e-4
    q, sf = moe_ext.per_block_cast_to_fp8(x)
    q_ref, sf_ref = ref.fp8_quant_block(x.cpu())
    assert sf[0, 1].item() == sf_ref[0, 1].item() == (torch.tensor(1e-4) / 448).item()
    assert_scales_equal(sf, sf_ref)
    assert_bits_equal(q, q_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [128, 64])
@pytest.mark.parametrize("shape", [(33, 200), (1, 1), (5, 130), (2, 3, 300), (7, 256)], ids=str)
def test_per_token_group_quant_fp8(shape, group_size, dtype, device, gen):
    x = spread(gen, *shape, dtype=dtype, device=device)
    q, s = moe_ext.per_token_group_quant_fp8(x, group_size)
    q_ref, s_ref = ref.fp8_quant_group(x.cpu(), group_size)
    assert tuple(s.shape) == (*shape[:-1], -(-shape[-1] // group_size))
    assert q.dtype == FP8 and tuple(q.shape) == shape
    assert_scales_equal(s, s_ref)
    assert_bits_equal(q, q_ref)


def test_per_token_group_quant_fp8_zero_group(device, gen):
    """A group of zeros gets the 1e-10 floor and quantizes to zeros."""
    x = randn(gen, 3, 200, device=device)
    x[1, 128:] = 0.0
    q, s = moe_ext.per_token_group_quant_fp8(x)
    q_ref, s_ref = ref.fp8_quant_group(x.cpu())
    assert s[1, 1].item() == (torch.tensor(1e-10) / 448).item()
    assert_scales_equal(s, s_ref)
    assert_bits_equal(q, q_ref)


def wild(gen, rows, cols, dtype):
    """Values over dtype's whole exponent range, subnormals and both zeros included; each row
    spans 40 binades under its own top, so its groups' quotients x / s run from 448 down to
    well under FP8's smallest subnormal."""
    lo, hi = (-24, 14) if dtype == torch.float16 else (-149, 126)
    top = torch.randint(lo + 20, hi + 1, (rows, 1), generator=gen)
    exps = (top - torch.randint(0, 40, (rows, cols), generator=gen)).clamp(min=lo)
    sign = torch.randint(0, 2, (rows, cols), generator=gen).to(torch.float32) * 2 - 1
    t = torch.ldexp(sign * (1 + torch.rand(rows, cols, generator=gen)), exps.to(torch.float32))
    zero = torch.rand(rows, cols, generator=gen) < 0.02
    return torch.where(zero, sign * 0.0, t).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [128, 64])
def test_per_token_group_quant_fp8_wild_values(group_size, dtype, device, gen):
    """The group quantizer's division keeps __fdiv_rn's bits (the CUDA one skips its range
    checks, csrc/cuda/fp8.cuh mx_fp8_div) over every magnitude, -0 included; a row with an
    infinity takes an infinite scale (NaN for the infinity itself, signed zeros elsewhere)."""
    x = wild(gen, 300, 1000, dtype)
    x[7, 300] = float("inf")
    x[8, 5] = float("-inf")
    assert (x.view(-1)[:2000].float().abs() < torch.finfo(torch.float32).tiny).any(), "no subnormals"
    q, s = moe_ext.per_token_group_quant_fp8(x.to(device), group_size)
    q_ref, s_ref = ref.fp8_quant_group(x, group_size)
    assert_scales_equal(s, s_ref)
    nan = q_ref.float().isnan()  # torch writes NaN as 0xff, the engines as 0x7f
    assert torch.equal(q.cpu().float().isnan(), nan) and nan.sum() == 2
    assert_bits_equal(q.cpu()[~nan], q_ref[~nan])
    assert (u8(q) == 0x80).any(), "no -0 byte was exercised"
    if q.is_cuda:
        assert_bits_equal(q, moe_ext.per_token_group_quant_fp8(x, group_size)[0], "CUDA vs CPU")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_fp8_quant_wild_values(dtype, device, gen):
    """Per tensor over every magnitude (a static scale, so most values saturate or flush)."""
    x = wild(gen, 50, 1000, dtype)
    for scale in (None, torch.tensor([1e-3])):
        q, s = moe_ext.scaled_fp8_quant(x.to(device), scale=None if scale is None else scale.to(device))
        q_ref, s_ref = ref.fp8_quant_tensor(x, scale=scale)
        assert_scales_equal(s, s_ref)
        assert_bits_equal(q, q_ref)


def test_quantizers_leave_their_input_alone(device, gen):
    x = randn(gen, 40, 200, dtype=torch.bfloat16, device=device)
    before = x.clone()
    moe_ext.scaled_fp8_quant(x)
    moe_ext.per_block_cast_to_fp8(x)
    moe_ext.per_token_group_quant_fp8(x)
    assert torch.equal(x, before)


def test_quantizers_non_contiguous_input(device, gen):
    x = randn(gen, 130, 200, device=device).t()  # [200, 130], column-major
    assert not x.is_contiguous()
    for got, want in ((moe_ext.scaled_fp8_quant(x), ref.fp8_quant_tensor(x.cpu())),
                      (moe_ext.per_block_cast_to_fp8(x), ref.fp8_quant_block(x.cpu())),
                      (moe_ext.per_token_group_quant_fp8(x), ref.fp8_quant_group(x.cpu()))):
        assert_scales_equal(got[1], want[1])
        assert_bits_equal(got[0], want[0])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8, torch.float64, FP8],
                         ids=str)
def test_quantizers_reject_other_dtypes(dtype):
    x = torch.ones(4, 130).to(dtype)
    for fn in (moe_ext.scaled_fp8_quant, moe_ext.per_block_cast_to_fp8,
               moe_ext.per_token_group_quant_fp8):
        with pytest.raises(TypeError):
            fn(x)


def test_per_block_cast_rejects_1d(gen):
    with pytest.raises(ValueError):
        moe_ext.per_block_cast_to_fp8(randn(gen, 300))


@pytest.mark.gpu
@pytest.mark.skipif(not moe_ext.cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (200, 130), (3, 130, 257), (1000, 4096)], ids=str)
def test_quantizers_cpu_and_cuda_bit_exact(shape, dtype, gen):
    x = spread(gen, *shape, dtype=dtype)
    xc = x.cuda()
    pairs = [(moe_ext.scaled_fp8_quant(x), moe_ext.scaled_fp8_quant(xc)),
             (moe_ext.scaled_fp8_quant(x, scale=torch.tensor([0.01])),
              moe_ext.scaled_fp8_quant(xc, scale=torch.tensor([0.01], device="cuda"))),
             (moe_ext.per_token_group_quant_fp8(x), moe_ext.per_token_group_quant_fp8(xc)),
             (moe_ext.per_token_group_quant_fp8(x, 64), moe_ext.per_token_group_quant_fp8(xc, 64))]
    for ue in (False, True):
        pairs.append((moe_ext.per_block_cast_to_fp8(x, use_ue8m0=ue),
                      moe_ext.per_block_cast_to_fp8(xc, use_ue8m0=ue)))
    for n, ((q_cpu, s_cpu), (q_gpu, s_gpu)) in enumerate(pairs):
        assert q_gpu.is_cuda and s_gpu.is_cuda
        assert_scales_equal(s_gpu, s_cpu, f"scale #{n}")
        assert_bits_equal(q_gpu, q_cpu, f"q #{n}")


# ================================================================ FusedMoE forward

CONFIGS = [
    # id, layer kwargs, checkpoint has biases / gated, interleaved w13
    ("silu", dict(activation="silu"), False, True, False),
    ("gelu", dict(activation="gelu"), False, True, False),
    ("swigluoai-bias", dict(activation="swigluoai", has_bias=True), True, True, True),
    ("relu2-nogate", dict(activation="relu2", is_act_and_mul=False), False, False, False),
]


def row_major_weights(layer):
    """The layer's (w13_weight, w2_weight), row-major copies where the layer packed them."""
    return tuple(packing.row_major(layer, name) for name in ("w13_weight", "w2_weight"))


def dequantized(layer):
    """The layer's FP8 weights as float64 (w13, w2), row-major where the layer packed them."""
    w13, w2 = row_major_weights(layer)
    if layer.quant_method.weight_block_size is None:
        return (ref.fp8_dequant_tensor(w13, layer.w13_weight_scale),
                ref.fp8_dequant_tensor(w2, layer.w2_weight_scale))
    return (ref.fp8_dequant_block(w13, layer.w13_weight_scale_inv),
            ref.fp8_dequant_block(w2, layer.w2_weight_scale_inv))


def fp8_reference(layer, x, logits, activation="silu", gated=True, act_amax_ulps=0):
    """(float64 reference of the FP8 layer, routing margin) from the layer's own quantized
    parameters (dequantized) and fake-quantized activations (act_amax_ulps: see
    reference.fp8_experts)."""
    weights, ids, margin = ref.route(logits.cpu(), layer.top_k)
    w13, w2 = dequantized(layer)
    params = dict(layer.named_parameters())
    want = ref.fp8_experts(
        x.cpu(), w13.cpu(), w2.cpu(), weights, ids,
        block=layer.quant_method.weight_block_size is not None, activation=activation,
        is_act_and_mul=gated, w13_bias=params.get("w13_bias"), w2_bias=params.get("w2_bias"),
        expert_map=layer.expert_map, act_dtype=x.dtype, act_amax_ulps=act_amax_ulps)
    return want, margin


def fp8_model(style, method, device="cpu", dtype=torch.bfloat16, e=E, k=K, h=H, i=I, **kw):
    return build_model(style, num_experts=e, top_k=k, hidden_size=h, intermediate_size=i,
                       params_dtype=dtype, quant_config=Fp8OnlineConfig(METHODS[method]),
                       device=device, **kw)


def compare(out, want, margin, tol, what):
    keep = keep_rows(margin)
    err = ref.rel_err(out.cpu()[keep], want.cpu()[keep])
    print(f"{what}: rel_err {err:.4g} (bound {tol})")
    assert err <= tol, f"{what}: rel_err {err:.4g} > {tol}"
    return err


@pytest.mark.parametrize("m", [0, 1, 33])
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_forward(method, cfg, m, device, gen):
    name, kw, has_bias, gated, interleaved = cfg
    style = "mixtral" if m % 2 else "qwen"
    model, layer = fp8_model(style, method, device, **kw)
    ckpt, t = checkpoint(gen, style, e=E, h=H, i=I, has_bias=has_bias, gated=gated,
                         dtype=torch.bfloat16)
    vllm_load(model, ckpt, style)
    assert layer.w13_weight.dtype == FP8 and layer.w13_weight.device.type == device
    x = randn(gen, m, H, dtype=torch.bfloat16, device=device)
    logits = randn(gen, m, E, device=device, scale=2.0)
    out = layer(x, logits)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (m, H)
    assert out.device.type == device
    if m == 0:
        return
    want, margin = fp8_reference(layer, x, logits, kw["activation"], gated)
    compare(out, want, margin, FP8_TOL, f"fp8 {method} {name} M={m} vs fake-quant reference")
    # the same checkpoint in an unquantized bf16 layer. The bound is a batch statistic: a single
    # token's FP8 rounding error alone reaches ~0.13 with these inputs, so M=1 is only printed.
    plain_model, plain = build_model(style, num_experts=E, top_k=K, hidden_size=H,
                                     intermediate_size=I, params_dtype=torch.bfloat16,
                                     device=device, **kw)
    vllm_load(plain_model, ckpt, style)
    compare(out, plain(x, logits).float(), margin, FP8_VS_BF16 if m >= 33 else float("inf"),
            f"fp8 {method} {name} M={m} vs bf16 layer")


@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_forward_fp16_layer(method, device, gen):
    model, layer = fp8_model("qwen", method, device, dtype=torch.float16)
    ckpt, _ = checkpoint(gen, "qwen", e=E, h=H, i=I, dtype=torch.float16)
    vllm_load(model, ckpt, "qwen")
    x = randn(gen, 33, H, dtype=torch.float16, device=device)
    logits = randn(gen, 33, E, device=device, scale=2.0)
    out = layer(x, logits)
    assert out.dtype == torch.float16
    want, margin = fp8_reference(layer, x, logits)
    compare(out, want, margin, FP8_TOL, f"fp8 {method} fp16 layer")


@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_multiblock_sizes(method, device, gen):
    """H and I spanning several full 128-blocks plus a partial one."""
    e, k, h, i = 5, 2, 300, 260
    model, layer = fp8_model("mixtral", method, device, e=e, k=k, h=h, i=i)
    ckpt, _ = checkpoint(gen, "mixtral", e=e, h=h, i=i, dtype=torch.bfloat16)
    vllm_load(model, ckpt, "mixtral")
    x = randn(gen, 40, h, dtype=torch.bfloat16, device=device)
    logits = randn(gen, 40, e, device=device, scale=2.0)
    want, margin = fp8_reference(layer, x, logits)
    compare(layer(x, logits), want, margin, FP8_TOL, f"fp8 {method} H={h} I={i}")


def routed_case(gen, style, method, device, m):
    """The FP8 layer of `style` (default sizes) loaded from a random bf16 checkpoint, m random
    tokens, their logits and their routing."""
    model, layer = fp8_model(style, method, device)
    ckpt, _ = checkpoint(gen, style, e=E, h=H, i=I, dtype=torch.bfloat16)
    vllm_load(model, ckpt, style)
    x = randn(gen, m, H, dtype=torch.bfloat16, device=device)
    logits = randn(gen, m, E, device=device, scale=2.0)
    topk_weights, topk_ids = FusedMoE.select_experts(x, logits, K, False, True)
    return layer, x, logits, topk_weights, topk_ids


def functional_fp8(layer, method, x, topk_weights, topk_ids, weights=None, **kw):
    """moe_ext.fused_experts (vLLM's functional form) on the FP8 layer's own weights (row-major:
    the functional form does not read the Hopper packed layout; weights: row_major_weights(layer)
    made once by the caller) and scales."""
    scales = [layer._parameters[n] for n in layer._fp8_scale_names]
    w13, w2 = weights if weights is not None else row_major_weights(layer)
    return moe_ext.fused_experts(x, w13, w2, topk_weights, topk_ids,
                                 w1_scale=scales[0], w2_scale=scales[1], block_shape=METHODS[method], **kw)


@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_apply_matches_forward(method, device, gen):
    """quant_method.apply(layer, x, topk_weights, topk_ids) is the forward after routing."""
    layer, x, logits, topk_weights, topk_ids = routed_case(gen, "qwen", method, device, 33)
    out = layer.quant_method.apply(layer, x, topk_weights, topk_ids)
    want = ref.fp8_experts(x.cpu(), *(w.cpu() for w in dequantized(layer)), topk_weights.cpu(),
                           topk_ids.cpu(), block=method == "block", act_dtype=torch.bfloat16)
    err = ref.rel_err(out, want)
    assert err <= FP8_TOL, f"apply: rel_err {err:.4g}"
    assert torch.equal(out, layer(x, logits)), "apply and forward differ on the same routing"


@pytest.mark.parametrize("method", list(METHODS))
def test_functional_fused_experts_fp8(method, device, gen):
    """vLLM's functional fused_experts with float8 weights and w1_scale / w2_scale (and
    block_shape) computes what the FP8 layer holding those weights computes."""
    layer, x, logits, topk_weights, topk_ids = routed_case(gen, "mixtral", method, device, 21)
    out = functional_fp8(layer, method, x, topk_weights, topk_ids)
    assert torch.equal(out, layer(x, logits))
    want = ref.fp8_experts(x.cpu(), *(w.cpu() for w in dequantized(layer)), topk_weights.cpu(),
                           topk_ids.cpu(), block=method == "block", act_dtype=torch.bfloat16)
    assert ref.rel_err(out, want) <= FP8_TOL
    with pytest.raises(ValueError, match="w1_scale"):
        moe_ext.fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
    with pytest.raises(NotImplementedError, match="a1_scale"):
        functional_fp8(layer, method, x, topk_weights, topk_ids, a1_scale=torch.ones(1))


@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_forward_is_repeatable(method, device, gen):
    model, layer = fp8_model("qwen", method, device)
    ckpt, _ = checkpoint(gen, "qwen", e=E, h=H, i=I, dtype=torch.bfloat16)
    vllm_load(model, ckpt, "qwen")
    x = randn(gen, 33, H, dtype=torch.bfloat16, device=device)
    logits = randn(gen, 33, E, device=device, scale=2.0)
    x0, l0 = x.clone(), logits.clone()
    first = layer(x, logits)
    assert torch.equal(layer(x, logits), first)
    assert torch.equal(x, x0) and torch.equal(logits, l0), "forward modified its inputs"
    # one token alone gives that token's row of a batch only up to the per-tensor scale
    alone = layer(x[5:6].clone(), logits[5:6].clone())
    want, margin = fp8_reference(layer, x[5:6], logits[5:6])
    compare(alone, want, margin, FP8_TOL, f"fp8 {method} single token")


TP_CONFIGS = [c for c in CONFIGS if c[0] in ("silu", "swigluoai-bias", "relu2-nogate")]


@pytest.mark.parametrize("cfg", TP_CONFIGS, ids=[c[0] for c in TP_CONFIGS])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_tensor_parallel_sum(method, cfg, device, gen):
    """tp_size=2: each rank quantizes its own slice; the ranks' outputs sum to the layer."""
    name, kw, has_bias, gated, interleaved = cfg
    ckpt, _ = checkpoint(gen, "qwen", e=E, h=H, i=I, has_bias=has_bias, gated=gated,
                         dtype=torch.bfloat16)
    x = randn(gen, 33, H, dtype=torch.bfloat16, device=device)
    logits = randn(gen, 33, E, device=device, scale=2.0)
    total = torch.zeros(33, H, dtype=torch.float64)
    total_ref = torch.zeros(33, H, dtype=torch.float64)
    for rank in range(2):
        model, layer = fp8_model("qwen", method, device, tp_size=2, tp_rank=rank, **kw)
        vllm_load(model, ckpt, "qwen")
        assert layer.intermediate_size_per_partition == I // 2
        assert layer.w2_weight.shape[-1] == I // 2
        out = layer(x, logits)
        want, margin = fp8_reference(layer, x, logits, kw["activation"], gated)
        compare(out, want, margin, FP8_TOL, f"fp8 {method} {name} tp rank {rank}")
        total += out.cpu().double()
        total_ref += want
    compare(total, total_ref, margin, FP8_TOL, f"fp8 {method} {name} tp sum")
    plain_model, plain = build_model("qwen", num_experts=E, top_k=K, hidden_size=H,
                                     intermediate_size=I, params_dtype=torch.bfloat16,
                                     device=device, **kw)
    vllm_load(plain_model, ckpt, "qwen")
    compare(total, plain(x, logits).float(), margin, FP8_VS_BF16,
            f"fp8 {method} {name} tp sum vs bf16 layer")


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_expert_parallel(method, strategy, device, gen):
    """ep_size=2: each rank holds and quantizes its experts only; the outputs sum to the layer.

    Token 0 holds the largest |x| and is routed to experts of both ranks, so the per-tensor
    input scale is the same whether taken over all tokens (vLLM) or over those with a local
    expert (abi.h). The per-tensor scales are each rank's own, so the sum is compared with the
    sum of the ranks' references; per-token-group quantization does not depend on the rank,
    so with block scales the sum also matches the unsharded FP8 layer."""
    ckpt, _ = checkpoint(gen, "mixtral", e=E, h=H, i=I, has_bias=True, dtype=torch.bfloat16)
    x = randn(gen, 33, H, dtype=torch.float32)
    x[0] *= 4.0
    logits = randn(gen, 33, E, scale=2.0)
    logits[0, 0] = logits[0, 5] = logits[0, 6] = 9.0  # experts 0 and 5/6 live on different ranks
    x, logits = x.to(torch.bfloat16).to(device), logits.to(device)
    full_model, full = fp8_model("mixtral", method, device, has_bias=True)
    vllm_load(full_model, ckpt, "mixtral")
    full_out = full(x, logits)
    total = torch.zeros(33, H, dtype=torch.float64)
    total_ref = torch.zeros(33, H, dtype=torch.float64)
    for rank in range(2):
        model, layer = fp8_model("mixtral", method, device, has_bias=True, ep_size=2,
                                 ep_rank=rank, expert_placement_strategy=strategy)
        ids = [g for g in range(E) if int(layer.expert_map[g]) >= 0]
        assert layer.local_num_experts == len(ids) and layer.w13_weight.shape[0] == len(ids)
        vllm_load(model, ckpt, "mixtral")
        # a rank's experts are quantized exactly as in the full layer
        assert torch.equal(u8(layer.w13_weight), u8(full.w13_weight[ids]))
        assert torch.equal(u8(layer.w2_weight), u8(full.w2_weight[ids]))
        out = layer(x, logits)
        want, margin = fp8_reference(layer, x, logits)
        compare(out, want, margin, FP8_TOL, f"fp8 {method} ep rank {rank} ({strategy})")
        total += out.cpu().double()
        total_ref += want
    compare(total, total_ref, margin, FP8_TOL, f"fp8 {method} ep sum ({strategy})")
    if method == "block":
        compare(total, full_out.float(), margin, FP8_TOL, f"fp8 {method} ep sum vs full layer")
    plain_model, plain = build_model("mixtral", num_experts=E, top_k=K, hidden_size=H,
                                     intermediate_size=I, params_dtype=torch.bfloat16,
                                     has_bias=True, device=device)
    vllm_load(plain_model, ckpt, "mixtral")
    compare(total, plain(x, logits).float(), margin, FP8_VS_BF16,
            f"fp8 {method} ep sum vs bf16 layer")


# 33 and 120 tokens (H = 200): the CUDA x quantizer in one block (256 / 800 threads); 160: two launches
@pytest.mark.parametrize("m", [33, 120, 160])
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_expert_parallel_input_scale_over_local_tokens(method, m, device, gen):
    """The per-tensor input scale covers the tokens with a local expert (abi.h): a token routed
    only to the other rank, however large, does not coarsen this rank's quantization."""
    ckpt, _ = checkpoint(gen, "qwen", e=E, h=H, i=I, dtype=torch.bfloat16)
    model, layer = fp8_model("qwen", method, device, ep_size=2, ep_rank=1)
    vllm_load(model, ckpt, "qwen")
    remote = [g for g in range(E) if int(layer.expert_map[g]) < 0]
    assert len(remote) >= K
    x = randn(gen, m, H)
    x[3] *= 50.0  # far the largest |x|, routed to experts of rank 0 only
    logits = randn(gen, m, E, scale=2.0)
    logits[3, remote[:K]] = 20.0
    x, logits = x.to(torch.bfloat16).to(device), logits.to(device)
    out = layer(x, logits)
    assert not out[3].any(), "a token without local experts must give a zero row"
    want, margin = fp8_reference(layer, x, logits)
    compare(out, want, margin, FP8_TOL, f"fp8 {method} ep input scale over local tokens")


# ================================================================ moe_ext.Linear

IN, OUT = 200, 130


def dequantized_linear(lin):
    if lin.quant_method.weight_block_size is None:
        return ref.fp8_dequant_tensor(lin.weight, lin.weight_scale)
    return ref.fp8_dequant_block(lin.weight, lin.weight_scale_inv)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("method", list(METHODS))
def test_linear_fp8(method, bias, device, gen):
    block = method == "block"
    lin = moe_ext.Linear(IN, OUT, bias=bias, params_dtype=torch.bfloat16,
                         quant_config=Fp8OnlineConfig(METHODS[method]), device=device)
    want_type = moe_ext.Fp8PerBlockOnlineLinearMethod if block \
        else moe_ext.Fp8PerTensorOnlineLinearMethod
    assert type(lin.quant_method) is want_type
    assert lin.quant_method.uses_meta_device is True
    assert lin.quant_method.weight_block_size == METHODS[method]
    assert lin.weight.is_meta and tuple(lin.weight.shape) == (OUT, IN)
    with pytest.raises(RuntimeError):
        lin(randn(gen, 3, IN, dtype=torch.bfloat16, device=device))
    w = randn(gen, OUT, IN, dtype=torch.bfloat16, scale=IN ** -0.5)
    weight = lin.weight
    weight.weight_loader(weight, w)
    assert lin.weight is weight, "the weight parameter was replaced"
    assert lin.weight.dtype == FP8 and tuple(lin.weight.shape) == (OUT, IN)
    assert lin.weight.device.type == device
    if block:
        assert not hasattr(lin, "weight_scale") or lin.weight_scale is None
        assert tuple(lin.weight_scale_inv.shape) == (-(-OUT // 128), -(-IN // 128))
        q_ref, s_ref = moe_ext.per_block_cast_to_fp8(w)
        assert_scales_equal(lin.weight_scale_inv, s_ref)
    else:
        assert tuple(lin.weight_scale.shape) == (1,)
        q_ref, s_ref = moe_ext.scaled_fp8_quant(w)
        assert_scales_equal(lin.weight_scale, s_ref)
    assert_bits_equal(lin.weight, q_ref, "weight")
    b = None
    if bias:
        b = randn(gen, OUT, dtype=torch.bfloat16, scale=0.5)
        lin.bias.weight_loader(lin.bias, b)
        assert lin.bias.dtype == torch.bfloat16 and torch.equal(lin.bias.cpu(), b)
    lin.process_weights_after_loading()
    before = {n: (p, p.data_ptr(), p.detach().clone()) for n, p in lin.named_parameters()}
    lin.process_weights_after_loading()
    for n, p in lin.named_parameters():
        assert p is before[n][0] and p.data_ptr() == before[n][1], f"{n} was replaced"
        assert torch.equal(u8(p), u8(before[n][2])), f"{n} changed"
    wd = dequantized_linear(lin).cpu()
    for shape in [(1, IN), (33, IN), (2, 5, IN)]:
        x = randn(gen, *shape, dtype=torch.bfloat16, device=device)
        out = lin(x)
        assert out.dtype == torch.bfloat16 and tuple(out.shape) == (*shape[:-1], OUT)
        rows = x.cpu().reshape(-1, IN)
        xq = ref.fake_quant_group(rows) if block else ref.fake_quant_tensor(rows)
        want = xq @ wd.T
        if bias:
            want = want + b.double()
        err = ref.rel_err(out.cpu().reshape(-1, OUT), want)
        print(f"linear fp8 {method} {shape}: rel_err {err:.4g}")
        assert err <= FP8_TOL, f"linear {method} {shape}: rel_err {err:.4g}"
        unquant = rows.double() @ w.double().T + (b.double() if bias else 0)
        err = ref.rel_err(out.cpu().reshape(-1, OUT), unquant)
        assert err <= FP8_VS_BF16, f"linear {method} {shape} vs unquantized: {err:.4g}"


@pytest.mark.parametrize("method", list(METHODS))
def test_linear_fp8_reload_in_place(method, device, gen):
    lin = moe_ext.Linear(IN, OUT, params_dtype=torch.bfloat16,
                         quant_config=Fp8OnlineConfig(METHODS[method]), device=device)
    lin.weight.weight_loader(lin.weight, randn(gen, OUT, IN, dtype=torch.bfloat16))
    lin.process_weights_after_loading()
    params = {n: (p, p.data_ptr()) for n, p in lin.named_parameters()}
    w = randn(gen, OUT, IN, dtype=torch.bfloat16, scale=3.0)
    lin.weight.weight_loader(lin.weight, w)
    lin.process_weights_after_loading()
    for n, p in lin.named_parameters():
        assert p is params[n][0] and p.data_ptr() == params[n][1], f"{n} was reallocated"
    q_ref, _ = (moe_ext.per_block_cast_to_fp8(w) if method == "block"
                else moe_ext.scaled_fp8_quant(w))
    assert_bits_equal(lin.weight, q_ref, "reloaded weight")


@pytest.mark.parametrize("method", list(METHODS))
def test_linear_fp8_load_errors(method, device, gen):
    lin = moe_ext.Linear(IN, OUT, params_dtype=torch.bfloat16,
                         quant_config=Fp8OnlineConfig(METHODS[method]), device=device)
    with pytest.raises(RuntimeError):
        lin.process_weights_after_loading()
    with pytest.raises(ValueError):
        lin.weight.weight_loader(lin.weight, randn(gen, OUT, IN + 1, dtype=torch.bfloat16))
    w = randn(gen, OUT, IN, dtype=torch.bfloat16)
    lin.weight.weight_loader(lin.weight, w)
    before = u8(lin.weight)
    scale_name = "weight_scale_inv" if method == "block" else "weight_scale"
    scale_before = getattr(lin, scale_name).clone()
    bad = w.clone()
    bad[3, 7] = float("nan")
    with pytest.raises(ValueError):
        lin.weight.weight_loader(lin.weight, bad)
    with pytest.raises(ValueError):
        lin.weight.weight_loader(lin.weight, randn(gen, OUT - 1, IN, dtype=torch.bfloat16))
    assert torch.equal(u8(lin.weight), before), "a failed load changed the weight"
    assert torch.equal(getattr(lin, scale_name), scale_before), "a failed load changed the scale"
    scale = getattr(lin, scale_name)
    with pytest.raises(ValueError):
        scale.weight_loader(scale, torch.ones_like(scale.cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_unquantized(bias, dtype, device, gen):
    lin = moe_ext.Linear(IN, OUT, bias=bias, params_dtype=dtype, device=device)
    assert lin.quant_method is None
    assert not lin.weight.is_meta and lin.weight.dtype == dtype
    w = randn(gen, OUT, IN, dtype=dtype, scale=IN ** -0.5)
    lin.weight.weight_loader(lin.weight, w)
    b = randn(gen, OUT, dtype=dtype) if bias else None
    if bias:
        lin.bias.weight_loader(lin.bias, b)
    for shape in [(33, IN), (2, 5, IN)]:
        x = randn(gen, *shape, dtype=dtype, device=device)
        want = x.cpu().double() @ w.double().T + (b.double() if bias else 0)
        err = ref.rel_err(lin(x), want)
        assert err <= ref.TOL[dtype], f"rel_err {err:.3g}"


# ================================================================ CUDA graphs

@pytest.mark.gpu
@pytest.mark.skipif(not moe_ext.cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", list(METHODS))
def test_fp8_moe_cuda_graph_replay_with_new_inputs(method, gen):
    model, layer = fp8_model("mixtral", method, "cuda", has_bias=True, activation="swigluoai")
    ckpt, _ = checkpoint(gen, "mixtral", e=E, h=H, i=I, has_bias=True, dtype=torch.bfloat16)
    vllm_load(model, ckpt, "mixtral")
    m = 33
    static_x = randn(gen, m, H, dtype=torch.bfloat16, device="cuda")
    static_logits = randn(gen, m, E, device="cuda", scale=2.0)
    graph, static_out = capture_forward(layer, static_x, static_logits, warmup=2)
    for _ in range(3):
        x = randn(gen, m, H, dtype=torch.bfloat16, device="cuda", scale=float(
            torch.rand(1, generator=gen) * 4 + 0.1))  # a new per-tensor scale each time
        logits = randn(gen, m, E, device="cuda", scale=2.0)
        replay(graph, static_x, static_logits, x, logits)
        want, margin = fp8_reference(layer, x, logits, "swigluoai")
        compare(static_out, want, margin, FP8_TOL, f"fp8 {method} graph replay")
        assert torch.equal(static_out, layer(x, logits)), "replay differs from eager forward"
