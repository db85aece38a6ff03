#!/usr/bin/env bash
# Device run for the CUDA kernels and decode graphs. From the repo root on the H200 (device tool),
# with `.whl` (fla-core wheel), `.devcache` (Qwen tokenizer JSON) and optionally `.tcache` (a Triton
# cache from an earlier run, packed as .tcpack/tcache.tgz) carried. Stages: $@ (default: all). Outputs go to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/fla_core-*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD NINFER_QWEN_TOKENIZER_JSON=$PWD/.devcache/qwen3_6-tokenizer.json
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcpack/tcache.tgz ] && tar xzf .tcpack/tcache.tgz  # Triton/fla-autotune cache of an earlier run
stages=${*:-"checks bench27 profile timings tiny pytest"}
t0=$(date +%s)
for stage in $stages; do
  if [ $(( $(date +%s) - t0 )) -gt ${DEADLINE:-330} ]; then echo "=== skip $stage (past DEADLINE)"; continue; fi
  echo "=== $stage at $(( $(date +%s) - t0 )) s"
  case $stage in
    kernels) timeout 300 python3 bench/gpu_kernels.py --only checks engine timings > $OUT/gpu_kernels.jsonl ;;
    checks) timeout 200 python3 bench/gpu_kernels.py --only checks engine > $OUT/gpu_kernels.jsonl ;;
    timings) timeout 120 python3 bench/gpu_kernels.py --only timings > $OUT/gpu_timings.jsonl ;;
    bench27) timeout 200 python3 bench/engine_throughput.py --preset qwen3.6-27b --concurrency 1 8 \
               --prompt-len 128 --max-tokens 32 > $OUT/qwen27b_bench.jsonl ;;
    bench27long) timeout 200 python3 bench/engine_throughput.py --preset qwen3.6-27b --concurrency 1 8 \
               --prompt-len 128 --max-tokens 128 > $OUT/qwen27b_bench_128.jsonl ;;
    profile) timeout 150 python3 bench/gpu_kernels.py --only profile > $OUT/profile_27b.jsonl ;;
    tiny) timeout 90 python3 bench/engine_throughput.py --preset tiny-qwen3.6 --concurrency 1 8 \
            --prompt-len 128 --max-tokens 64 > $OUT/tiny_qwen_bench.jsonl ;;
    pytest) timeout 150 python3 -m pytest -q -m cuda tests/test_kernels.py -p no:cacheprovider > $OUT/pytest_cuda.log 2>&1 ;;
  esac
  echo "=== $stage rc=$? at $(( $(date +%s) - t0 )) s"
done
[ "${PACK:-1}" = 1 ] && tar czf $OUT/tcache.tgz .tcache 2>/dev/null; ls -la $OUT
