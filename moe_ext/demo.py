"""The main job: build a FusedMoE layer, load a random checkpoint through vLLM's
weight_loader loop, run it, check it against a float32 reference and time it.

    python -m moe_ext.demo [--tokens 32] [--device cpu|cuda] [--dtype bf16]

Default config is Qwen3-MoE-shaped (E=128, top_k=8, H=2048, I=768); the GPU is
used when the CUDA engine sees one."""
import argparse
import statistics
import time

import torch

import moe_ext
from moe_ext import packing

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 5e-3, torch.float32: 1e-5}


class MoEBlock(torch.nn.Module):
    """The part of a vLLM model that owns the experts (as Qwen3-MoE does)."""

    def __init__(self, args, dtype, device):
        super().__init__()
        self.experts = moe_ext.FusedMoE(
            num_experts=args.experts, top_k=args.top_k, hidden_size=args.hidden,
            intermediate_size=args.intermediate, params_dtype=dtype, renormalize=True,
            prefix="model.layers.0.mlp.experts", device=device)


def random_checkpoint(args, dtype, generator):
    """Yields Qwen-style per-expert (name, tensor) pairs in the checkpoint dtype, random
    normal * 0.02 (never zeros), one at a time as a checkpoint reader would."""
    shapes = {"gate_proj": (args.intermediate, args.hidden),
              "up_proj": (args.intermediate, args.hidden),
              "down_proj": (args.hidden, args.intermediate)}
    for e in range(args.experts):
        for proj, shape in shapes.items():
            tensor = (torch.randn(*shape, generator=generator) * 0.02).to(dtype)
            yield f"experts.{e}.{proj}.weight", tensor


def load_like_vllm(model, checkpoint, num_experts):
    """The loop vLLM model code runs over a checkpoint."""
    mapping = moe_ext.FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj", num_experts=num_experts)
    params = dict(model.named_parameters())
    for name, tensor in checkpoint:
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name in name:
                target = name.replace(weight_name, param_name)
                param = params[target]
                param.weight_loader(param, tensor, target, shard_id=shard_id,
                                    expert_id=expert_id)
                break
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def reference(layer, x, logits):
    """float32 math of numerics.md on the layer's own weights (softmax routing)."""
    w13, w2 = (packing.row_major(layer, name).float() for name in ("w13_weight", "w2_weight"))
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, layer.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    inter = layer.intermediate_size_per_partition
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        h = x[rows].float() @ w13[e].T
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype).float()
        out.index_add_(0, rows, (act @ w2[e].T) * weights[rows, slots, None])
    return out


def time_forward(layer, x, logits, repeats):
    on_gpu = x.is_cuda
    samples = []
    for _ in range(repeats + 3):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        layer(x, logits)
        if on_gpu:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[3:]) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if moe_ext.cuda_available() else "cpu")
    dtype = DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(0)

    started = time.perf_counter()
    model = MoEBlock(args, dtype, device)
    load_like_vllm(model, random_checkpoint(args, dtype, generator), args.experts)
    load_s = time.perf_counter() - started
    layer = model.experts
    x = (torch.randn(args.tokens, args.hidden, generator=generator)).to(device, dtype)
    logits = torch.randn(args.tokens, args.experts, generator=generator).to(device)

    out = layer(x, logits)
    ref = reference(layer, x, logits)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ms = time_forward(layer, x, logits, args.repeats)
    ok = err <= TOLERANCE[dtype]
    print(f"moe_ext demo: {layer.extra_repr().replace(chr(10), ' ')}")
    print(f"device={device} dtype={args.dtype} tokens={args.tokens} "
          f"threads={torch.get_num_threads()} load={load_s:.1f}s")
    print(f"forward median {ms:.2f} ms over {args.repeats} runs; rel_err vs float32 "
          f"reference {err:.2e} ({'OK' if ok else 'FAIL'}, bound {TOLERANCE[dtype]:.1e})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
