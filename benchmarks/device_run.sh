#!/usr/bin/env bash
# One device call: build for sm_90a, run the GPU tests and the demo, then the benchmark and its
# issue-5 scorecard. Usage (on the lent GPU): bash benchmarks/device_run.sh [bench_moe.py args...]
# Logs and the result JSON go to $OUT (or ./device_out when OUT is unset). Set MOE_EXT_COMMIT to the
# commit under test: the copy of the tree on the device may carry a stale .git (2026-11-22: a run
# of 24aa61e was labelled 72b3e3e).
set -uo pipefail
[ -n "${MOE_EXT_COMMIT:-}" ] || echo "device_run.sh: MOE_EXT_COMMIT is unset; the result is labelled from .git" >&2
out="${OUT:-device_out}"
mkdir -p "$out"
# the editable install is not always on the device python's path: import from the tree
export MOE_EXT_CUDA_ARCHS=90a PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "WARNING: Running pip" | tail -5
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/pytest_gpu.log" | tail -15
python3 -m moe_ext.demo 2>&1 | tee "$out/demo.log"
python3 benchmarks/bench_moe.py --out "$out/bench.json" "$@" 2>&1 | tee "$out/bench.log" | tail -60
[ -f "$out/bench.json" ] && python3 benchmarks/compare_anchor.py "$out/bench.json" | tee "$out/anchor.txt"
