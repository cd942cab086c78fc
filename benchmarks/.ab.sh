export MOE_EXT_CUDA_ARCHS=90a PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build_a.log 2>&1
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_route_align.py tests/test_gpu_sm90.py -p no:cacheprovider 2>&1 | tail -2
P="--models mixtral,qwen3moe,gptoss,deepseekv3 --tokens 128,512,1024 --dtypes bf16,fp8_tensor,fp8_block --baselines ,"
python3 benchmarks/bench_moe.py $P --out $OUT/a.json > $OUT/a.log 2>&1
sed -i 's/rows < 24 \* local_experts/rows < 40 * local_experts/' csrc/cuda/gemm_configs.cuh
grep -n "rows < 40" csrc/cuda/gemm_configs.cuh
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/build_b.log 2>&1
python3 benchmarks/bench_moe.py $P --out $OUT/b.json > $OUT/b.log 2>&1
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
a = {(p["model"], p["dtype"], p["M"]): p for p in json.load(open(f"{out}/a.json"))["points"] if p["method"] == "moe_ext"}
b = {(p["model"], p["dtype"], p["M"]): p for p in json.load(open(f"{out}/b.json"))["points"] if p["method"] == "moe_ext"}
for key in a:
    if a[key].get("us") and b.get(key, {}).get("us"):
        print(key, f"{a[key]['us']:.1f} -> {b[key]['us']:.1f} us ({a[key]['us'] / b[key]['us']:.3f}x)")
PY
