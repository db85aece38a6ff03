#!/usr/bin/env bash
# One device session's checks and benchmarks, in stages that fit the device tool's 10-minute calls.
# From the repo root on the H200, with `.whl` (fla-core wheel), `.devcache` (Qwen tokenizer JSON) and
# optionally `.tcpack/tcache.tgz` (a Triton cache of an earlier run) carried; outputs go to $OUT. A fresh checkout
# makes the first two with `bash bench/device_prep.sh`.
#   bash bench/h200_session.sh checks pytest   # call 1 (~5 min): every kernel vs its reference, the CUDA tests
#   bash bench/h200_session.sh bench27 bench35 # call 2 (~8 min): the issue-10 figures, ninfer beside transformers
#   bash bench/h200_session.sh profile         # decode + chunked-prefill profile of the 27B shape (profile35: 35B-A3B,
#                                              # profile_nvfp4: 27B with NVFP4 weights,
#                                              # profile_nvfp4_lm_head: its lm_head in NVFP4 too)
# Single stages: fused gemv nvfp4 kv kv_fp4 moe (NVFP4_ARGS=--sweep adds the NVFP4 GEMV config sweep), decode27
# (27B decode only, NVFP4 and bf16, C = 1, 2, 3, 4, 8), decode27_nvfp4 (NVFP4 only), pytest_nvfp4,
# pytest_nvfp4_kernels, pytest_pdl, pytest_pieces, pytest_mma, sweep_mma (the tensor-core NVFP4 GEMV), sweep_mma_wide (its 8..32-row verify launches),
# sweep_mma_staging (it with cp.async staging / L2 prefetch), verify_mma (verify vs plain, decode on tensor cores),
# e2e_mma (MTP3 end to end at C=1, the speculative table and the plain one), verify27, gc27 (bench/gc_pause.py),
# pytest_spec (the speculative CUDA tests), mtp_s22 (s21: MTP graphs at start-up, the NVFP4 head, C=8 adaptive),
# probe_profile (where the adaptive engine's probe steps go at C=8), timeline_c1 (GPU idle per MTP round at C=1), pieces_spec (MTP rounds
# with piecewise graphs), draft_head_nvfp4 (the proposal head in NVFP4), spec_c8_512 / e2e_c1_256 (s25: C=8 adaptive
# over 512 tokens, MTP3 at C=1 over 256), host_c1 (s26: C=1 MTP3 with the loop's parts timed), penalized_c1 (s28:
# C=1 MTP3 greedy, then with a presence penalty), ahead_c1 / ahead_c8 (s29: e2e_c1_256 / spec_c8_512 without, then
# with the MTP head drafting ahead; ahead_c1_fp4: with the proposal head in NVFP4 too), host_c8 (s29: C=8 adaptive with the loop's parts timed), fused_gdn (s29: a verify's GDN positions
# in one launch, A/B), few_ab (s36: the N = 5120 linears' launch, the table's against sweep_mma_down's fastest), sweep_mma_cap (s36: 24 and 32 rows, registers capped), pytest_caps (s36: their CUDA tests), attn_tiles (s37: the decode attention's tiles at short contexts), host_c1_x2 (s38: host_c1 at acceptance 3.0 with NVFP4 heads, twice), host_threads_ab (its runs with the CPU thread pools at one thread, then default), pytest_overlap / overlap_ab /
# overlap_lm_head / overlap_c8 (s39: verify rounds queued before the last read back: CUDA tests, MTP3 at C=1 without
# and with them, the same with an NVFP4 lm_head, C=8 adaptive), overlap_auto (s40: queued rounds timed by the engine, off, on, in one process; NVFP4 then bf16 lm_head), pytest_log (s43: the request log's CUDA intervals), overlap_auto_fp4 (s43: its NVFP4 lm_head run alone), sweep_mma_group / group_ab (s30, call 1-2's grouped loads: removed), sweep_mma_paired / paired_ab /
# pytest_s30 (s30: the mma GEMV on weights stored paired), gates_ab / pytest_s31 (s31: the GDN gates computed in the
# recurrent kernels), gdn_loads_ab (s32: the GDN verify kernels' loads first, against the
# file AB_OLD_GDN), sweep_mma_pad (s32: the mma GEMV on rows stored apart), read_ceiling (s34: the 27B linears' bytes read without decoding), sweep_mma_tiled / tiled_ab / pytest_tiled (s34: the mma GEMV on tiled weights; the verify and MTP3 at C=1 with them; their CUDA tests), rollback_ab (s33: rollback by copy, then by
# trading state slots, C = 1 and 8), e2e_c1_mtp3 (MTP3 at C=1, 256 tokens), lm_head_c1 (s30:
# MTP3 at C=1 with an NVFP4 lm_head), profile_c1 (s30: the C=1 MTP3 round's kernels), spec_c8
# (MTP speculation at real C = 8, controlled acceptance), pieces27 / pieces35 (short-prompt TTFT by the prefill plan), pytest_graphs (the CUDA-graph
# tests), prefetch (the NVFP4 GEMV's L2 prefetch sweep), sampled35 (35B-A3B bf16 decode, greedy and
# sampled), sampled35_torch (the same with the torch sampler), engine35 / engine27 (engine-level decode: bench/gpu_engine.py). Any stage with the
# suffix _nopdl runs with NINFER_PDL=0 (kernels launched without programmatic dependent launch), its files
# under $OUT/nopdl.
# A stage past DEADLINE seconds (default 540) is skipped with a line saying so.
set -u
[ -s .devcache/qwen3_6-tokenizer.json ] || { echo "no .devcache/qwen3_6-tokenizer.json: run bench/device_prep.sh here and carry it"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target .site .whl/fla_core-*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD NINFER_QWEN_TOKENIZER_JSON=$PWD/.devcache/qwen3_6-tokenizer.json
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.tcache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcpack/tcache.tgz ] && tar xzf .tcpack/tcache.tgz
t0=$(date +%s)
left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - t0) )); }
# the launch for verify_mma: MMA_LAUNCH, else the fastest checked one of a sweep_mma_staging result
# (s20: a quote inside ${knobs:-...} in a case branch swallowed the next branches: verify_mma ran e2e_mma)
best_mma() { if [ -n "${MMA_LAUNCH:-}" ]; then echo "$MMA_LAUNCH"; else python3 -m bench.selfcheck_nvfp4 --best-mma "$1" 2>/dev/null; fi; }
# A/B of one environment knob, 0 then 1: the verify step against a plain one (C = 1, 8; k = 1, 3) and MTP3 at C=1
# (NVFP4 heads, drafting ahead, 256 tokens), into $out/<prefix>_verify_<value>.log and $out/<prefix>_c1_<value>.log
knob_ab() {
  local knob=$1 prefix=$2 value
  for value in 0 1; do
    env "$knob=$value" timeout 150 python3 bench/spec_verify.py --shape qwen3.6-27b --weights nvfp4 \
      --concurrency 1 8 --drafts 1 3 > $out/${prefix}_verify_$value.log 2>&1
    env "$knob=$value" timeout 120 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
      --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 3.5 --max-tokens 256 \
      > $out/${prefix}_c1_$value.log 2>&1
  done
}
stages=()  # "checks": every kernel against its reference, the five stages below
for s in "$@"; do if [ "$s" = checks ]; then stages+=(fused gemv nvfp4 kv moe); else stages+=("$s"); fi; done
for stage in "${stages[@]}"; do
  if [ "$(left)" -lt 30 ]; then echo "=== skip $stage (past DEADLINE)"; continue; fi
  echo "=== $stage at $(( $(date +%s) - t0 )) s"
  out=$OUT; unset NINFER_PDL
  if [ "${stage%_nopdl}" != "$stage" ]; then  # <stage>_nopdl: the same without PDL, into $OUT/nopdl
    export NINFER_PDL=0; out=$OUT/nopdl; mkdir -p "$out"
  fi
  case ${stage%_nopdl} in
    fused)
      timeout 60 python3 -c "import json, torch; from bench.selfcheck_fused import check_fused
print(json.dumps(check_fused('cuda', torch.bfloat16)))" > $out/fused.jsonl 2>&1 ;;
    gemv)
      timeout 90 python3 -m bench.selfcheck_gemv --only check,time > $out/gemv.jsonl 2>&1 ;;
    nvfp4)
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 ${NVFP4_ARGS:-} --out $out/nvfp4.json > $out/nvfp4.log 2>&1 ;;
    kv)  # every quantized storage: kernels vs reference, 27B-shape nvfp4/k8v4 checks and timings, engine graphs
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_kv > $out/kv.jsonl 2>&1 ;;
    kv_fp4)  # the same for nvfp4 / k8v4 only, without the engine checks (no tokenizer or fla-core needed)
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_kv --kv-dtypes nvfp4 k8v4 --no-engine \
        > $out/kv_fp4.jsonl 2>&1 ;;
    moe)
      timeout 60 python3 -c "from bench import selfcheck_moe as s; s.main()" > $out/moe.jsonl 2>&1 ;;
    pytest)  # only the modules with CUDA tests: the device lacks the server tests' packages (SDKs, uvicorn)
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider \
        $(grep -l "needs_cuda\|mark.cuda" tests/test_*.py) > $out/pytest_cuda.log 2>&1 ;;
    pytest_nvfp4)  # the NVFP4 CUDA tests only (kernel checks, MoE experts, engine greedy with and without graphs)
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_nvfp4.py tests/test_nvfp4_moe.py \
        > $out/pytest_nvfp4.log 2>&1 ;;
    pytest_graphs)  # the CUDA-graph and sampler tests: graphs against eager, no host sync, fused sampler check
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_graphs.py \
        tests/test_kernels.py tests/test_triton_sampler.py -k "graph or sync or sampl or dependent" > $out/pytest_graphs.log 2>&1 ;;
    pytest_nvfp4_kernels)  # the NVFP4 GEMV against its reference at every tile the table uses (prefetch ones included)
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_nvfp4.py -k kernels_on_cuda \
        > $out/pytest_nvfp4_kernels.log 2>&1 ;;
    pytest_pdl)  # PDL against no PDL (engine greedy, CUDA graphs), then graphs against eager with PDL on
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels.py \
        -k "dependent or identical" > $out/pytest_pdl.log 2>&1 ;;
    sampled35)  # 35B-A3B bf16 decode, greedy and under the non-thinking sampler preset (sampler graphs)
      timeout $(( $(left) - 5 )) python3 bench/gpu_decode.py --shape qwen3.6-35b-a3b --weights bf16 --decode-only \
        --sampled --skip-transformers > $out/qwen35b_sampled_decode.log 2>&1 ;;
    sampled35_torch)  # the same with the torch sampler (NINFER_SAMPLER=torch): the fused sampler's A/B
      NINFER_SAMPLER=torch timeout $(( $(left) - 5 )) python3 bench/gpu_decode.py --shape qwen3.6-35b-a3b --weights bf16 \
        --decode-only --sampled --skip-transformers > $out/qwen35b_sampled_decode_torch_sampler.log 2>&1 ;;
    engine35)  # engine-level decode (the engine loop's host work included), 35B-A3B bf16, greedy and sampled
      timeout $(( $(left) - 5 )) python3 bench/gpu_engine.py --shape qwen3.6-35b-a3b > $out/qwen35b_engine_decode.log 2>&1 ;;
    engine27)  # the same for the 27B shape, NVFP4 weights
      timeout $(( $(left) - 5 )) python3 bench/gpu_engine.py --shape qwen3.6-27b --weights nvfp4 \
        > $out/qwen27b_nvfp4_engine_decode.log 2>&1 ;;
    bench27)
      timeout 330 python3 bench/gpu_decode.py --shape qwen3.6-27b --weights bf16 nvfp4 --deadline 300 \
        --hf-reserve 80 > $out/qwen27b_gpu_decode.log 2>&1 ;;
    bench35)
      timeout $(( $(left) - 5 )) python3 bench/gpu_decode.py --shape qwen3.6-35b-a3b --weights bf16 nvfp4 \
        --deadline $(( $(left) - 20 )) --hf-reserve 60 > $out/qwen35b_gpu_decode.log 2>&1 ;;
    pytest_mma)  # the tensor-core NVFP4 GEMV against the reference (every sweep tile), the NVFP4 kernel checks
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_nvfp4.py \
        -k "mma or kernels_on_cuda or greedy or rows_like" > $out/pytest_mma.log 2>&1 ;;
    sweep_mma)  # the tensor-core NVFP4 GEMV tiles against the packed-fp16 one at M = 1, 2, 4, 8 (27B shapes)
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma --out $out/nvfp4_mma.json \
        > $out/nvfp4_mma.log 2>&1 ;;
    sweep_mma_paired)  # s30: the tensor-core NVFP4 GEMV on weights stored paired: bitwise against K order, times
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma-paired --out $out/mma_paired.json \
        > $out/mma_paired.log 2>&1 ;;
    sweep_mma_pad)  # s32 (not run yet): the paired mma GEMV with weight rows stored 128..2048 bytes apart
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma-pad --out $out/mma_pad.json \
        > $out/mma_pad.log 2>&1 ;;
    sweep_mma_tiled)  # s34: the paired mma GEMV on tiled weights (each 16-row tile one contiguous run), bitwise, times
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma-tiled ${TILED_MS:+--ms $TILED_MS} --out $out/mma_tiled.json \
        > $out/mma_tiled.log 2>&1 ;;
    sweep_mma_down)  # s35: mlp_down and o_proj on tiled weights at other depths, unrolls and warps a program
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma-down --out $out/mma_down.json \
        > $out/mma_down.log 2>&1 ;;
    pytest_caps)  # s36: register caps and the few / wide launch keys change no bit; verify rows equal decode rows
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_nvfp4.py \
        -k "register_caps or rows_like_on_cuda" > $out/pytest_caps.log 2>&1 ;;
    attn_tiles)  # s37: the 27B decode attention's tiles at 256..64k context, one row and a verify's four (registers)
      timeout $(( $(left) - 10 )) python3 -m bench.attn_decode_tiles --out $out/attn_tiles.json > $out/attn_tiles.log 2>&1 ;;
    sweep_mma_cap)  # s36: 24 and 32 rows (three, four token tiles) with registers capped at 128 and not
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma-cap --out $out/mma_cap.json \
        > $out/mma_cap.log 2>&1 ;;
    few_ab)  # s36: the N = 5120 linears' launch (NINFER_NVFP4_MMA_FEW) as the table has it, then as the fastest 8-warp
      # config of sweep_mma_down's result (FEW_AB, else from $out/mma_down.json): the verify against a plain step at
      # C = 1, 8 (k = 3), MTP3 at C=1 (NVFP4 heads, 256 tokens)
      few=${FEW_AB:-$(python3 -m bench.selfcheck_nvfp4 --best-few $out/mma_down.json)}
      echo "few_ab: NINFER_NVFP4_MMA_FEW=$few" | tee $out/few_ab.txt
      for v in off on; do
        json={}; [ $v = on ] && json=$few
        NINFER_NVFP4_MMA_FEW=$json timeout 150 python3 bench/spec_verify.py --shape qwen3.6-27b --weights nvfp4 \
          --concurrency 1 8 --drafts 3 > $out/few_verify_$v.log 2>&1
        NINFER_NVFP4_MMA_FEW=$json timeout 120 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 \
          --with-mtp --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 3.5 \
          --max-tokens 256 > $out/few_c1_$v.log 2>&1
      done ;;
    tiled_ab)  # s34: the verify step against a plain one (C = 1, 8; k = 1, 3) and MTP3 at C=1, paired weights, then
      # paired and tiled (NINFER_NVFP4_TILED)
      knob_ab NINFER_NVFP4_TILED tiled ;;
    pytest_tiled)  # s34: the NVFP4 CUDA tests (tiled weights in rows_like and the kernels) and the speculative ones
      # with tiled storage on (greedy output with drafts equals without)
      NINFER_NVFP4_TILED=1 timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider \
        tests/test_nvfp4.py tests/test_speculative.py -k "mma or rows_like or greedy" > $out/pytest_tiled.log 2>&1 ;;
    read_ceiling)  # s34: the five 27B linears read without decoding (the GEMV's loads alone, then flat per program)
      timeout $(( $(left) - 10 )) python3 -m bench.read_ceiling --out $out/read_ceiling.json > $out/read_ceiling.log 2>&1 ;;
    paired_ab)  # s30: the verify step and MTP3 at C=1 (NVFP4 heads), K-order weights then paired (NINFER_NVFP4_PAIRED)
      knob_ab NINFER_NVFP4_PAIRED paired ;;
    pytest_s30)  # s30: the mma GEMV's CUDA tests (rows_like verification, K order and paired weights) and the
      # GDN kernels' (the one-step and multi-position kernels after sharing their helpers)
      timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_nvfp4.py tests/test_kernels.py \
        -k "mma or rows_like or kernels_on_cuda or verify_gdn_steps or recurrent or gdn" > $out/pytest_s30.log 2>&1 ;;
    gates_ab)  # s31: the GDN gates in the recurrent kernels (the ba projection's split-K partial sums reduced there too)
      # against the gates kernel and the reduction first (NINFER_FUSED_GDN_GATES)
      knob_ab NINFER_FUSED_GDN_GATES gates ;;
    pytest_s31)  # s31: the recurrent kernels on raw gate projections (bitwise), the GDN verify kernels, the mma GEMV's
      # paired weights, and the speculative CUDA tests (greedy output equal with drafts, on graphs)
      timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_nvfp4.py tests/test_kernels.py \
        -k "${S31_K:-mma or rows_like or raw_projections or verify_gdn_steps or greedy}" > $out/pytest_s31.log 2>&1
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_speculative.py \
        tests/test_mtp.py > $out/pytest_s31_spec.log 2>&1 ;;
    gdn_loads_ab)  # s32: the GDN verify kernels with every position's loads first (the tree's) against the file
      # AB_OLD_GDN (an earlier triton_gdn.py): the verify step against a plain one (C = 1, 8; k = 1, 3), old first
      cp ninfer/kernels/triton_gdn.py .gdn_new.py
      for v in 0 1; do
        if [ $v = 0 ]; then cp "$AB_OLD_GDN" ninfer/kernels/triton_gdn.py; else cp .gdn_new.py ninfer/kernels/triton_gdn.py; fi
        timeout 150 python3 bench/spec_verify.py --shape qwen3.6-27b --weights nvfp4 --concurrency 1 8 --drafts 1 3 \
          > $out/gdn_loads_verify_$v.log 2>&1
      done ;;
    rollback_ab)  # s33 (not run yet): rollback by copying the accepted state back (NINFER_ROLLBACK_COPY=1, before s33)
      # against trading slots (0): MTP3 at C=1 (NVFP4 heads, acceptance 3.0), then k=3 every round at C=8 (2.5)
      for v in 1 0; do
        NINFER_ROLLBACK_COPY=$v timeout 150 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
          --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 --max-tokens 256 \
          > $out/rollback_c1_$v.log 2>&1
        NINFER_ROLLBACK_COPY=$v timeout 150 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
          --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 8 --acceptance 2.5 --max-tokens 128 \
          > $out/rollback_c8_$v.log 2>&1
      done ;;
    e2e_c1_mtp3)  # MTP3 at C=1 (NVFP4 heads, drafting ahead, 256 tokens), as knob_ab's end-to-end half
      timeout 150 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp --draft-head 32768 \
        --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 3.5 --max-tokens 256 > $out/e2e_c1_mtp3.log 2>&1 ;;
    lm_head_c1)  # s30: MTP3 at C=1 (NVFP4 heads, drafting ahead) on an artifact whose lm_head is NVFP4 too
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --nvfp4-lm-head \
        --with-mtp --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 3.5 \
        --max-tokens 256 > $out/lm_head_c1.log 2>&1 ;;
    profile_c1)  # s30: the C=1 MTP3 round's kernels (NVFP4 heads); run as profile_c1_nopdl for unoverlapped durations
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.5 --max-tokens 128 \
        --profile 60 > $out/profile_c1.log 2>&1 ;;
    sweep_mma_wide)  # the tensor-core NVFP4 GEMV at 8..32 rows (verification): bitwise against 8-row launches, times
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma-wide --out $out/mma_wide.json \
        > $out/mma_wide.log 2>&1 ;;
    sweep_mma_staging)  # the tensor-core GEMV with shared-memory staging / L2 prefetch: Triton's cache warmed by 8
      # processes at once (each compiles and checks a slice of the configs), then bitwise checks and times in one
      for i in 0 1 2 3 4 5 6 7; do
        timeout $(( $(left) - 60 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma-staging --part $i/8 \
          > $out/mma_staging_warm$i.log 2>&1 &
      done
      wait
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-mma-staging --out $out/mma_staging.json \
        > $out/mma_staging.log 2>&1 ;;
    verify_mma)  # exact verify against a plain step, the table's GEMVs then decode on tensor cores from one row
      # (NINFER_NVFP4_MMA_MIN_M=1; the launch: MMA_LAUNCH from the caller, else sweep_mma_staging's best at M = 1 and 4)
      timeout $(( $(left) / 2 )) python3 bench/spec_verify.py --shape qwen3.6-27b --weights nvfp4 --concurrency 1 4 \
        --drafts 1 3 > $out/spec_verify_table.log 2>&1
      knobs=$(best_mma "$out/mma_staging.json")
      echo "decode on tensor cores from one row, launch ${knobs:-as the table}"
      NINFER_NVFP4_MMA_MIN_M=1 NINFER_NVFP4_MMA_LAUNCH="$knobs" timeout $(( $(left) - 10 )) python3 bench/spec_verify.py \
        --shape qwen3.6-27b --weights nvfp4 --concurrency 1 4 --drafts 1 3 > $out/spec_verify_mma.log 2>&1 ;;
    e2e_mma)  # 27B NVFP4 MTP3 end to end at C=1 (fixed k=3, acceptance 2.5 / 3 / 3.5): the speculative engine's table
      # (tensor cores from one row), then packed fp16 at 1-2 rows as engines without drafts run (NINFER_NVFP4_MMA_MIN_M=3)
      for table in spec plain; do
        [ $table = plain ] && export NINFER_NVFP4_MMA_MIN_M=3
        timeout $(( $(left) / 2 - 5 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
          --draft-head 32768 --concurrency 1 --acceptance 2.5 3.0 3.5 --max-tokens 128 > $out/e2e_c1_$table.log 2>&1
        unset NINFER_NVFP4_MMA_MIN_M
      done ;;
    mtp_s22)  # s21's changes, unmeasured on a GPU: the MTP graphs captured at start-up (setup record: mtp_graphs,
      # mtp_capture_s) at C=1, bf16 head then NVFP4 head (convert hf --nvfp4-mtp's form), then adaptive at C=8
      for extra in "" --nvfp4-mtp; do
        timeout 150 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp --draft-head 32768 \
          $extra --concurrency 1 --acceptance 2.5 3.0 3.5 --max-tokens 128 > $out/e2e_c1${extra:+_nvfp4_mtp}.log 2>&1
      done
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --adaptive --concurrency 8 --acceptance 1.5 2.5 3.5 --settle 3 --max-tokens 128 \
        > $out/spec_c8_adaptive.log 2>&1 ;;
    probe_profile)  # adaptive C=8 at acceptance 1.5 under the stack sampler and kernel profiler: what a probe step
      # (32-43 ms on the H100 in s21, against 19 ms for a width-2 step) spends on the MTP head's catch-up
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --adaptive --concurrency 8 --acceptance 1.5 --max-tokens 128 --profile 40 \
        > $out/probe_profile_c8.log 2>&1 ;;
    timeline_c1)  # MTP3 at C=1 (k=3 every round, acceptance 3.5) under the profiler's timeline: where the GPU
      # idles per round, by engine phase and host op (bench/gpu_timeline.py; host times profiler-inflated)
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --concurrency 1 --acceptance 3.5 --max-tokens 128 --timeline > $out/timeline_c1.log 2>&1 ;;
    pieces_spec)  # MTP3 at C=1 (NVFP4 head, k=3 every round) with decode and verify graphs whole, then in pieces
      # (NINFER_GRAPH_PIECES=1): whether launching a round's graphs piecewise hides their launch
      for pieces in 0 1; do
        NINFER_GRAPH_PIECES=$pieces timeout 170 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 \
          --with-mtp --draft-head 32768 --nvfp4-mtp --concurrency 1 --acceptance 3.0 3.5 --max-tokens 128 \
          > $out/e2e_c1_pieces$pieces.log 2>&1
      done ;;
    draft_head_nvfp4)  # MTP3 at C=1 (NVFP4 head, k=3 every round): the proposal head's rows in bf16, then NVFP4
      for extra in "" --nvfp4-draft-head; do
        timeout 170 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp --draft-head 32768 \
          --nvfp4-mtp $extra --concurrency 1 --acceptance 3.0 3.5 --max-tokens 128 \
          > $out/e2e_c1${extra:+_nvfp4_draft_head}.log 2>&1
      done ;;
    pytest_spec)  # the speculative engine's CUDA tests: drafters keep greedy output (MTP graphs)
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_speculative.py \
        tests/test_mtp.py tests/test_overlapped_rounds.py > $out/pytest_spec.log 2>&1 ;;
    pytest_overlap)  # s39: rounds queued before the read back keep greedy and seeded output on CUDA (~1 min)
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_overlapped_rounds.py \
        > $out/pytest_overlap.log 2>&1 ;;
    overlap_ab)  # s39: MTP3 at C=1 (NVFP4 heads, 256 tokens) without queued rounds (NINFER_OVERLAP_ROUNDS=0) and with
      # them (the default), interleaved, two processes each
      for run in 1 2; do
        for value in 0 1; do
          NINFER_OVERLAP_ROUNDS=$value timeout 120 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 \
            --with-mtp --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 3.5 \
            --max-tokens 256 > $out/overlap_${value}_$run.log 2>&1
        done
      done ;;
    debug_overlap)  # s39: seeded and greedy output with and without queued rounds, where the first difference lies
      timeout 130 python3 bench/debug_overlap_seeded.py /tmp/tiny-mtp.ninfer > $out/debug_overlap.log 2>&1 ;;
    timeline_overlap)  # s39: MTP3 at C=1 (NVFP4 heads, acceptance 3.0, 128 tokens) under the profiler's timeline, without
      # queued rounds then with them: the GPU's idle time a round (bench/gpu_timeline.py)
      for value in 0 1; do
        NINFER_OVERLAP_ROUNDS=$value timeout 150 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 \
          --with-mtp --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 \
          --max-tokens 128 --timeline > $out/timeline_overlap_$value.log 2>&1
      done ;;
    overlap_pairs)  # s39: overlap_lm_head's pair (queued rounds off, on), then overlap_ab's first pair
      for head in --nvfp4-lm-head ""; do
        for value in 0 1; do
          NINFER_OVERLAP_ROUNDS=$value timeout 110 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 $head \
            --with-mtp --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 3.5 \
            --max-tokens 256 > $out/pair_${head:-bf16}_$value.log 2>&1
        done
      done ;;
    overlap_auto)  # s40: MTP3 at C=1 (NVFP4 heads, 256 tokens, acceptance 3.0 / 3.5, medians of 3 runs), queued rounds
      # timed by the engine (the CUDA default since s40), off and on, interleaved in one process (spec_e2e
      # --overlap-modes); with an NVFP4 lm_head, then a bf16 one
      for head in --nvfp4-lm-head ""; do
        timeout 200 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 $head --with-mtp --draft-head 32768 \
          --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 3.5 --max-tokens 256 --repeat 3 \
          --overlap-modes timed off on > $out/auto${head:+_fp4head}.log 2>&1
      done ;;
    overlap_auto_fp4)  # s43: overlap_auto's NVFP4 lm_head run alone (issue 21's C=1 figure in one short call)
      timeout 200 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --nvfp4-lm-head --with-mtp \
        --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 3.5 --max-tokens 256 \
        --repeat 3 --overlap-modes timed off on > $out/auto_fp4head.log 2>&1 ;;
    overlap_lm_head)  # s39: overlap_ab's runs on an artifact whose lm_head is NVFP4 too, with queued rounds then without
      for value in 1 0; do
        NINFER_OVERLAP_ROUNDS=$value timeout 120 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 \
          --nvfp4-lm-head --with-mtp --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 \
          --acceptance 3.0 3.5 --max-tokens 256 > $out/overlap_lm_head_$value.log 2>&1
      done ;;
    pytest_log)  # s43: the request log's CUDA-event intervals (work.gpu_seconds, context_transfers) on the device
      timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_context_cache.py > $out/pytest_log.log 2>&1 ;;
    overlap_c8)  # s39: adaptive MTP at C=8 (NVFP4 heads, 256 tokens) with queued rounds, against no speculation
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --adaptive --concurrency 8 --acceptance 1.5 3.0 --settle 2 \
        --max-tokens 256 > $out/overlap_c8.log 2>&1 ;;
    verify27)  # exact verify against a plain step, 27B NVFP4 in a speculative engine (tensor cores from one row)
      timeout $(( $(left) - 10 )) python3 bench/spec_verify.py --shape qwen3.6-27b --weights nvfp4 \
        --concurrency 1 2 4 8 --drafts 1 3 > $out/spec_verify.log 2>&1 ;;
    gc27)  # a full garbage collection over a 27B NVFP4 engine process, before and after the start-up freeze
      timeout $(( $(left) - 10 )) python3 bench/gc_pause.py --preset qwen3.6-27b --weights nvfp4 \
        > $out/gc_pause_27b.jsonl 2>&1 ;;
    spec_c8_512)  # s25: adaptive MTP at C=8 over 512 tokens against an engine without speculation (~3 min)
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --adaptive --concurrency 8 --acceptance 1.5 2.5 --settle 3 --max-tokens 512 --repeat 3 \
        > $out/spec_c8_adaptive_512.log 2>&1 ;;
    e2e_c1_256)  # s25: MTP3 at C=1 (NVFP4 head, k=3 every round) over 256 tokens: the 350 tok/s goal (~2 min)
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --nvfp4-mtp --concurrency 1 --acceptance 3.0 3.5 --max-tokens 256 \
        > $out/e2e_c1_256.log 2>&1 ;;
    penalized_c1)  # s28: MTP3 at C=1 (as host_c1, without the timers), greedy then greedy with presence penalty 1.5
      # (the full sampler, each verify position counting the drafts before it)
      for pp in 0 1.5; do
        timeout 120 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp --draft-head 32768 \
          --nvfp4-mtp --concurrency 1 --acceptance 3.5 --max-tokens 128 --presence-penalty $pp > $out/penalized_c1_pp$pp.log 2>&1
      done ;;
    ahead_c1)  # s29: MTP3 at C=1 over 256 tokens (as e2e_c1_256), without then with drafting ahead (NINFER_DRAFT_AHEAD)
      for ahead in 0 1; do
        NINFER_DRAFT_AHEAD=$ahead timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b \
          --weights nvfp4 --with-mtp --draft-head 32768 --nvfp4-mtp --concurrency 1 --acceptance 3.0 3.5 \
          --max-tokens 256 > $out/ahead_c1_$ahead.log 2>&1
      done ;;
    ahead_c1_fp4)  # s29: ahead_c1 with the proposal head in NVFP4 too, as the loader serves an NVFP4 MTP artifact
      for ahead in 0 1; do
        NINFER_DRAFT_AHEAD=$ahead timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b \
          --weights nvfp4 --with-mtp --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 \
          --acceptance 3.0 3.5 --max-tokens 256 > $out/ahead_c1_fp4_$ahead.log 2>&1
      done ;;
    fused_gdn)  # s29: a verify's GDN positions in one launch per layer (NINFER_FUSED_VERIFY_STEPS): the kernels' bitwise
      # CUDA test, then the verify step against a plain one and MTP3 at C=1 (NVFP4 heads), per-position launches then fused
      timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels.py -k verify_gdn_steps \
        > $out/fused_gdn_test.log 2>&1
      knob_ab NINFER_FUSED_VERIFY_STEPS fused_gdn ;;
    fused_gdn_c1)  # s29: fused_gdn's kernel test, then the verify step at C=1 only, twice each way (process noise)
      timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels.py -k verify_gdn_steps \
        > $out/fused_gdn_test.log 2>&1
      for fused in 0 1 0 1; do
        NINFER_FUSED_VERIFY_STEPS=$fused timeout 100 python3 bench/spec_verify.py --shape qwen3.6-27b --weights nvfp4 \
          --concurrency 1 --drafts 3 >> $out/fused_gdn_verify_c1_$fused.log 2>&1
      done ;;
    ahead_c8)  # s29: adaptive MTP at C=8 over 512 tokens (as spec_c8_512), without then with drafting ahead
      for ahead in 0 1; do
        NINFER_DRAFT_AHEAD=$ahead timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b \
          --weights nvfp4 --with-mtp --draft-head 32768 --adaptive --concurrency 8 --acceptance 1.5 2.5 --settle 3 \
          --max-tokens 512 --repeat 3 > $out/ahead_c8_$ahead.log 2>&1
      done ;;
    host_c8)  # s29: adaptive MTP at C=8 (acceptance 1.5, 256 tokens) with the engine loop's parts timed: where the
      # speculative engine's plain steps spend more than the plain engine's
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --adaptive --concurrency 8 --acceptance 1.5 --settle 2 --max-tokens 256 --host-breakdown \
        > $out/host_c8.log 2>&1 ;;
    host_c1)  # s26: MTP3 at C=1 (as e2e_c1_256, 128 tokens) with the engine loop's parts timed (--host-breakdown):
      # where a round's ~0.9 ms of host time goes
      timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
        --draft-head 32768 --nvfp4-mtp --concurrency 1 --acceptance 3.5 --max-tokens 128 --host-breakdown \
        > $out/host_c1.log 2>&1 ;;
    host_c1_x2)  # s38: MTP3 at C=1 (NVFP4 heads, acceptance 3.0, 128 tokens) with the loop's parts timed, in two processes
      # (s38 saw a round's host time at ~0.55 or ~1.0 ms from one process to the next on the same H200)
      for run in 1 2; do
        timeout $(( ($(left) - 10) / (3 - run) )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 \
          --with-mtp --draft-head 32768 --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 \
          --max-tokens 128 --host-breakdown > $out/host_c1_$run.log 2>&1
      done ;;
    host_threads_ab)  # next (s38's question): is a round's host time (0.55 or 1.0 ms from one process to the next on the
      # s38 H200) the CPU thread pools'? host_c1_x2's run with torch's and OpenMP's pools at one thread, then as default
      for threads in 1 default; do
        for run in 1 2; do
          ( [ $threads = 1 ] && export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
            timeout 100 python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp --draft-head 32768 \
              --nvfp4-mtp --nvfp4-draft-head --concurrency 1 --acceptance 3.0 --max-tokens 128 --host-breakdown \
              > $out/host_threads_${threads}_$run.log 2>&1 )
        done
      done ;;
    spec_c8)  # 27B NVFP4 MTP speculation at real C = 8 with controlled acceptance (--settle), adaptive then k = 3
      for mode in --adaptive ""; do
        timeout $(( $(left) - 10 )) python3 bench/spec_e2e.py --shape qwen3.6-27b --weights nvfp4 --with-mtp \
          --draft-head 32768 $mode --concurrency 8 --acceptance 1.5 2.5 3.5 --settle 3 --max-tokens 128 \
          > $out/spec_c8${mode:+_adaptive}.log 2>&1
      done ;;
    prefetch)  # the NVFP4 GEMV tiles with L2 prefetch distances 0 / 2 / 4 (M = 1, 2; 27B shapes)
      timeout $(( $(left) - 10 )) python3 -m bench.selfcheck_nvfp4 --sweep-prefetch --out $out/nvfp4_prefetch.json \
        > $out/nvfp4_prefetch.log 2>&1 ;;
    decode27_nvfp4)  # 27B NVFP4 decode only; NINFER_NVFP4_PREFETCH and DECODE_ARGS (e.g. --nvfp4-lm-head) from the caller
      timeout $(( $(left) - 5 )) python3 bench/gpu_decode.py --shape qwen3.6-27b --weights nvfp4 --decode-only \
        --concurrency 1 2 4 8 --skip-transformers ${DECODE_ARGS:-} > $out/qwen27b_nvfp4_decode.log 2>&1 ;;
    pieces27|pieces35)  # short-prompt TTFT by the prefill plan against one eager forward (PIECES_WEIGHTS, default bf16)
      shape=qwen3.6-27b; [ "${stage%_nopdl}" = pieces35 ] && shape=qwen3.6-35b-a3b
      timeout $(( $(left) - 5 )) python3 bench/gpu_decode.py --shape $shape --weights ${PIECES_WEIGHTS:-bf16} \
        --concurrency 1 --no-long --skip-transformers > $out/${stage%_nopdl}_prefill_pieces.log 2>&1 ;;
    pytest_pieces)  # the (padded) piece graphs against eager pieces, the chunk graph against eager chunks, engine
      # greedy with and without graphs, the fused kernels (KV writes skip padding) against their references
      timeout $(( $(left) - 10 )) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_graphs.py \
        tests/test_kernels.py tests/test_fused.py -k "piece or prefill_graph or fused or rope" > $out/pytest_pieces.log 2>&1 ;;
    decode27)  # decode only, NVFP4 and bf16, no transformers: the quick check of a GEMV change
      timeout 300 python3 bench/gpu_decode.py --shape qwen3.6-27b --weights nvfp4 bf16 --decode-only \
        --concurrency 1 2 3 4 8 --skip-transformers > $out/qwen27b_decode.log 2>&1 ;;
    profile)
      timeout 200 python3 bench/gpu_kernels.py --only profile > $out/profile_27b.jsonl 2>&1 ;;
    profile_nvfp4)  # the 27B decode + prefill profile with NVFP4 weights
      timeout 240 python3 bench/gpu_kernels.py --only profile --weights nvfp4 > $out/profile_27b_nvfp4.jsonl 2>&1 ;;
    profile_nvfp4_lm_head)  # the same with the lm_head in NVFP4 too
      timeout 240 python3 bench/gpu_kernels.py --only profile --weights nvfp4 --nvfp4-lm-head \
        > $out/profile_27b_nvfp4_lm_head.jsonl 2>&1 ;;
    profile35)
      timeout 200 python3 bench/gpu_kernels.py --only profile --shape qwen3.6-35b-a3b > $out/profile_35b.jsonl 2>&1 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage rc=$? at $(( $(date +%s) - t0 )) s"
done
[ "${PACK:-1}" = 1 ] && tar czf $OUT/tcache.tgz .tcache 2>/dev/null
# the device returns at most 8 files (s35 lost three rollback_ab logs): more go back as one results.tgz
results=$(cd $OUT && find . -type f ! -name tcache.tgz)
if [ "$(echo "$results" | wc -l)" -gt 7 ]; then (cd $OUT && tar czf results.tgz --remove-files $results); fi
ls -laR $OUT
