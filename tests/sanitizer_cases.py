"""Small CUDA forwards run under compute-sanitizer by test_sanitizer.py: routing modes,
bf16/fp16 experts with odd sizes, biases, expert_map, and both FP8 methods. Sizes with H and I
multiples of 16 reach the Hopper kernels on an H100/H200: the decode kernel (16-, 32-, 48- and
64-token tiles, split-K), the persistent kernel (>= 64 rows per expert; GEMM2 in k slices;
16-bit and both FP8 methods on ping-pong 64-row units), FP8 on both, and moe_ext.Linear; routing
fused with the sort (M <= 16) and apart, the sort in one block and split over chunks (> 8192
pairs)."""
import torch

import moe_ext


def fill(layer, gen):
    for p in layer.parameters():
        p.data.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))


def fp8_layer(gen, e, k, h, i, block=None):
    """A bf16 layer of e experts, top k, quantized online to FP8 (per tensor, or block scales) as
    random checkpoint shards load."""
    layer = moe_ext.FusedMoE(e, k, h, i, params_dtype=torch.bfloat16, device="cuda",
                             quant_config=moe_ext.Fp8OnlineConfig(weight_block_size=block))
    for expert in range(e):
        for shard, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i))):
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, torch.randn(*shape, generator=gen) * 0.05, "experts.weight",
                                shard_id=shard, expert_id=expert)
    return layer


def main():
    gen = torch.Generator().manual_seed(5)
    cases = [
        dict(num_experts=7, top_k=3, hidden_size=67, intermediate_size=45),
        dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128, has_bias=True,
             activation="swigluoai"),
        dict(num_experts=16, top_k=4, hidden_size=128, intermediate_size=96, use_grouped_topk=True,
             num_expert_group=4, topk_group=2, scoring_func="sigmoid", routed_scaling_factor=2.5),
        dict(num_experts=6, top_k=1, hidden_size=64, intermediate_size=32, is_act_and_mul=False,
             activation="relu2", ep_size=2, ep_rank=1),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for kw in cases:
            layer = moe_ext.FusedMoE(params_dtype=dtype, device="cuda", **kw)
            fill(layer, gen)
            for m in (1, 5, 33):
                x = torch.randn(m, kw["hidden_size"], generator=gen).to("cuda", dtype)
                logits = torch.randn(m, kw["num_experts"], generator=gen).cuda()
                assert torch.isfinite(layer(x, logits)).all()
    kw = cases[1]  # 8 experts, top 2: 100 / 300 tokens are 25 / 75 rows per expert
    layer = moe_ext.FusedMoE(params_dtype=torch.bfloat16, device="cuda", **kw)
    fill(layer, gen)
    for m in (100, 300):
        x = torch.randn(m, kw["hidden_size"], generator=gen).to("cuda", torch.bfloat16)
        assert torch.isfinite(layer(x, torch.randn(m, 8, generator=gen).cuda())).all()
    # the persistent GEMM2 in k slices: 4 experts with ~150 rows each and I = 2112 (33 k blocks),
    # the kernel's pick (2) and 3 forced; per-tensor FP8 (I = 768) with 3 forced
    layer = moe_ext.FusedMoE(4, 2, 256, 2112, params_dtype=torch.bfloat16, device="cuda", has_bias=True)
    fill(layer, gen)
    x = torch.randn(300, 256, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(300, 4, generator=gen).cuda()
    for splits in (0, 3):
        previous = moe_ext._C._set_sm90_down_splits(splits)
        assert torch.isfinite(layer(x, logits)).all()
        moe_ext._C._set_sm90_down_splits(previous)
    layer = fp8_layer(gen, 4, 2, 256, 768)
    previous = moe_ext._C._set_sm90_down_splits(3)  # 6 k blocks: 3 slices of 2
    assert torch.isfinite(layer(x, logits)).all()
    moe_ext._C._set_sm90_down_splits(previous)
    # 16-bit ping-pong units: 48 experts, top 4, 480 tokens (~40 rows each), I = 520 (5 n tiles)
    layer = moe_ext.FusedMoE(48, 4, 256, 520, params_dtype=torch.bfloat16, device="cuda", has_bias=True)
    fill(layer, gen)
    x = torch.randn(480, 256, generator=gen).to("cuda", torch.bfloat16)
    assert torch.isfinite(layer(x, torch.randn(480, 48, generator=gen).cuda())).all()
    # FP8 ping-pong units, per tensor and block scales: 48 experts, top 4, 1200 tokens (~100 rows
    # each, two 64-row tiles), I = 256 / H = 512 (2 n tiles each): ~192 units, so both
    # warpgroups of a CTA take units
    x = torch.randn(1200, 512, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(1200, 48, generator=gen).cuda()
    for block in (None, [128, 128]):
        assert torch.isfinite(fp8_layer(gen, 48, 4, 512, 256, block)(x, logits)).all()
    # 2100 tokens x top 4 = 8400 pairs: the sort splits over chunks (count / scan / scatter)
    layer = moe_ext.FusedMoE(32, 4, 128, 96, params_dtype=torch.bfloat16, device="cuda")
    fill(layer, gen)
    x = torch.randn(2100, 128, generator=gen).to("cuda", torch.bfloat16)
    assert torch.isfinite(layer(x, torch.randn(2100, 32, generator=gen).cuda())).all()
    for block in (None, [128, 128]):
        for h, i, tokens in ((200, 130, (1, 9)), (256, 192, (1, 40, 100, 300))):
            layer = fp8_layer(gen, 8, 2, h, i, block)
            for m in tokens:
                x = torch.randn(m, h, generator=gen).to("cuda", torch.bfloat16)
                assert torch.isfinite(layer(x, torch.randn(m, 8, generator=gen).cuda())).all()

        lin = moe_ext.Linear(256, 200, bias=True, params_dtype=torch.bfloat16, device="cuda",
                             quant_config=moe_ext.Fp8OnlineConfig(weight_block_size=block))
        lin.weight.weight_loader(lin.weight, torch.randn(200, 256, generator=gen) * 0.05)
        lin.bias.weight_loader(lin.bias, torch.randn(200, generator=gen))
        for rows in (3, 70):
            x = torch.randn(rows, 256, generator=gen).to("cuda", torch.bfloat16)
            assert torch.isfinite(lin(x)).all()
    torch.cuda.synchronize()
    print("sanitizer cases done")


if __name__ == "__main__":
    main()
