#!/usr/bin/env bash
# A/B of builds of the extension in one device call: bench_moe.py over the same points with each
# build in turn, the builds alternating within every round, each run's JSON and log packed into
# $OUT/ab.tgz after every run (a call cut short still returns what ran).
# Usage, on the lent GPU from the repository root:
#   bash benchmarks/ab_bench.sh "DIR..." ROUNDS "bench_moe.py args" ["bench_moe.py args" ...]
# Each DIR holds _C.abi3.so.gz (gzip -c moe_ext/_C.abi3.so of a build made here and carried in the
# working tree); it runs from a copy of moe_ext/*.py beside that module, with the NAME=value words
# of DIR/env (if there is one) in its environment (e.g. MOE_EXT_PACKED_WEIGHTS=0: two layouts of
# one build). Read the result with
#   mkdir r && tar xzf ab.tgz -C r && python3 benchmarks/ab_compare.py r A B
set -u
out="${OUT:-ab_out}"
# the runs are kept outside $out, which then holds ab.tgz and gpu.txt only: a device call returns
# a limited count of files, and one that returned every run's files lost them all
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
mkdir -p "$out"
builds="$1"
rounds="$2"
shift 2
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
for dir in $builds; do
  name=$(basename "$dir")
  mkdir -p "/tmp/ab_builds/$name/moe_ext"
  cp moe_ext/*.py "/tmp/ab_builds/$name/moe_ext/"
  gunzip -c "$dir/_C.abi3.so.gz" > "/tmp/ab_builds/$name/moe_ext/_C.abi3.so"
done
for round in $(seq 1 "$rounds"); do
  for dir in $builds; do
    name=$(basename "$dir")
    i=0
    for spec in "$@"; do
      i=$((i + 1))
      # the spec's index first: two specs alike in their first 40 characters stay two files
      tag="s${i}_$(echo "$spec" | tr -c 'a-z0-9\n' '_' | cut -c1-40)"
      file="$runs/$name-r$round-$tag"
      settings=""
      [ -f "$dir/env" ] && settings=$(cat "$dir/env")
      # word splitting of $settings and $spec is wanted: lists of NAME=value words and of
      # bench_moe.py arguments
      # shellcheck disable=SC2086
      env $settings PYTHONPATH="/tmp/ab_builds/$name" python3 benchmarks/bench_moe.py $spec --baselines '' \
        --out "$file.json" > "$file.log" 2>&1 || tail -5 "$file.log"
      tar czf "$out/ab.tgz" -C "$runs" .
      echo "$name round $round: $tag $(date +%T)"
    done
  done
done
