#!/usr/bin/env bash
# One command for the GPU machine (run through the device tool from the repository root):
# builds lowbit for sm_90a, prints the environment report, runs the GPU tests and a quick
# benchmark (lowbit's Dense vs bf16 vs Flax's FP8, side by side). Logs go to $OUT (at most 8
# files come back: keep it that way). The default stages fit one device call (600 s): on a
# fresh H200 machine (2026-11-27) 470 s in all: the build 93 s (~270 s before the activation,
# fused-block and block-quantize kernels compiled as several translation units each), the
# 4543 GPU tests 316 s with 15 workers, the quick benchmark 58 s; on a fresh H100 535 s
# (bench/results/gpu_check_*_2026-11-27.log). On another fresh H100 the GPU tests alone ran
# past 360 s: their limit is TEST_LIMIT (default 450 s).
#
#   tools/gpu_check.sh                 # build test bench (the quick benchmark)
#   tools/gpu_check.sh build suite     # the rest of the suite on the CUDA backend (175 s, H100)
#   tools/gpu_check.sh build sanitize  # compute-sanitizer memcheck, one process per kernel
#     family of tools/sanitize_families.txt, SANITIZE_JOBS (4) at a time, 240 s each
#   SANITIZE_FAMILIES="norm gemm" tools/gpu_check.sh build sanitize   # some of the families
#   (a family that dies by a signal with no memcheck report: run it again alone, SANITIZE_JOBS=1;
#   on an H200 compute-sanitizer itself once crashed with four at a time, sanitize_*_2026-11-29.log)
#   BENCH=all tools/gpu_check.sh build bench   # every benchmark and the seed tutorials (long)
#   BENCH="bench/bench_quantize.py bench/bench_gemm.py" tools/gpu_check.sh build bench
#   BENCH="tools/sweep_fused_backward.py --rounds 3" tools/gpu_check.sh build bench   # tools/ too
#   PROFILE_OPS="norm softmax" tools/gpu_check.sh build profile   # ncu over the kernels
#   SANITIZE_K="amax or codecs" tools/gpu_check.sh build sanitize     # one -k over all tests
# On a 4-GPU machine (device kind nvidia-h100-x4) the GPU tests include the seed tutorial's
# DP=2/TP=2 step against one GPU (tests/test_sharding_gpu.py) and BENCH=all times it
# (bench/bench_dense_multi.py, ~5 minutes); with fewer GPUs both skip.
set -uo pipefail
OUT=${OUT:-/tmp/lowbit_out}
mkdir -p "$OUT"
stages=${*:-build test bench}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
has() { [[ " $stages " == *" $1 "* ]]; }
step() {  # step NAME LOGFILE TIMEOUT_S CMD...: runs CMD with a time limit, logs, tracks failure
  local name=$1 log=$2 limit=$3; shift 3
  echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$OUT/$log"
  timeout "$limit" "$@" >>"$OUT/$log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc" | tee -a "$OUT/$log"
  [ $rc -eq 0 ] || status=1
  return $rc
}

if has build; then
  {
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
    nvcc --version | tail -1
    $PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  } >"$OUT/env.log" 2>&1
  export SKBUILD_CMAKE_DEFINE="LOWBIT_CUDA=ON;LOWBIT_CUDA_ARCH_FLAGS=${LOWBIT_CUDA_ARCH_FLAGS:--gencode=arch=compute_90a,code=sm_90a}"
  step "build" build.log 400 $PY -m pip install --no-build-isolation --no-deps -v -e . || { echo "build failed"; tail -40 "$OUT/build.log"; exit 1; }
  step "report" env.log 120 $PY -m lowbit
fi

if has test || has suite; then
  # Several pytest workers share the GPU: allocate on demand instead of 75% each.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  # The device has 16 cores; the tests are bound by the workers' compiles, not the GPU.
  has test && step "gpu tests" tests.log ${TEST_LIMIT:-450} $PY -m pytest -q -rf -n ${WORKERS:-15} -m gpu -p no:cacheprovider tests
  has suite && step "suite on CUDA" tests.log 300 $PY -m pytest -q -rf -n ${WORKERS:-15} -m "not gpu" -p no:cacheprovider tests
  grep -E "^FAILED|^ERROR| passed| failed" "$OUT/tests.log" | tail -40
  unset XLA_PYTHON_CLIENT_PREALLOCATE
fi

if has sanitize; then
  # One buffer per allocation, so memcheck sees out-of-bounds accesses of our kernels
  # instead of hits inside XLA's memory pool.
  export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false
  if [ -n "${SANITIZE_K:-}" ]; then  # one filter over the whole suite, as before the families
    step "compute-sanitizer memcheck" sanitizer.log 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
      $PY -m pytest -q -m gpu -p no:cacheprovider -k "$SANITIZE_K" tests
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer.log" | tail -5
  else
    # The kernel families of tools/sanitize_families.txt (SANITIZE_FAMILIES: some of their
    # names), SANITIZE_JOBS processes at a time, each under its own limit; their logs are
    # joined into sanitizer.log in the families' order.
    mkdir -p /tmp/sanitize && rm -f /tmp/sanitize/*.log
    names=()
    while IFS= read -r line; do
      [[ -z $line || $line == \#* ]] && continue
      name=${line%%:*}
      [ -n "${SANITIZE_FAMILIES:-}" ] && [[ " $SANITIZE_FAMILIES " != *" $name "* ]] && continue
      names+=("$name")
      eval "args=(${line#*:})"
      while [ "$(jobs -rp | wc -l)" -ge "${SANITIZE_JOBS:-4}" ]; do wait -n; done
      (
        echo "=== memcheck $name ($(date +%T), limit ${SANITIZE_LIMIT:-240}s): ${line#*: }"
        timeout "${SANITIZE_LIMIT:-240}" compute-sanitizer --tool memcheck --error-exitcode 3 \
          $PY -m pytest -q -m gpu -p no:cacheprovider "${args[@]}"
        echo "=== memcheck $name: rc=$?"
      ) </dev/null >"/tmp/sanitize/$name.log" 2>&1 &
    done < tools/sanitize_families.txt
    wait
    for name in "${names[@]}"; do
      cat "/tmp/sanitize/$name.log" >>"$OUT/sanitizer.log"
      grep -q "^=== memcheck $name: rc=0$" "/tmp/sanitize/$name.log" || status=1
      printf '%-16s %s | %s\n' "$name" "$(grep -E "^=== memcheck $name: rc=" "/tmp/sanitize/$name.log" | sed 's/.*: //')" \
        "$(grep -hE "ERROR SUMMARY|[0-9]+ (passed|failed|skipped)" "/tmp/sanitize/$name.log" | tr '\n' ' ')"
    done
  fi
  unset XLA_PYTHON_CLIENT_ALLOCATOR XLA_PYTHON_CLIENT_PREALLOCATE
fi

if has profile; then  # Nsight Compute over the memory-bound kernels (tools/profile_ops.py)
  # No preallocation: kernel replay saves and restores all allocated device memory. One
  # process per op family, so that a crash at exit loses one family's report, not all.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  for ops in ${PROFILE_OPS:-quantize norm act softmax}; do
    step "ncu $ops" profile.log 300 ncu --clock-control none -k "regex:${NCU_K:-Quantize|Norm|Act|Softmax|Dbias}" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      --section WarpStateStats --section ComputeWorkloadAnalysis \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" $PY tools/profile_ops.py $ops
  done
  unset XLA_PYTHON_CLIENT_PREALLOCATE
fi

if has bench; then
  if [ "${BENCH:-}" = all ]; then
    scripts=$(ls bench/bench_*.py 2>/dev/null)
  else
    scripts=${BENCH:-"bench/bench_dense.py --variants bf16,flax_fp8,module_delayed --rounds 1"}
  fi
  IFS=$'\n'
  for script in $(tr ' ' '\n' <<<"$scripts" | awk '/^(bench|tools)\//{if (c) print c; c=$0; next} {c=c" "$0} END {if (c) print c}'); do
    unset IFS
    limit=240; [[ $script == *dense_multi* ]] && limit=420  # 4 GPUs: ~5 minutes
    # the seed layer: its variants' compiles alone passed 240 s on a fresh H100 (2026-11-27)
    [[ $script == *bench_layer* ]] && limit=480
    step "$script" bench.log $limit $PY $script || true
  done
  unset IFS
  if [ "${BENCH:-}" = all ]; then  # the seed tutorials at their own shapes
    for recipe in DelayedScaling Float8CurrentScaling; do
      step "layer tutorial $recipe" bench.log 180 $PY examples/te_integration_layer.py --recipe $recipe --iters 20 || true
      step "dense tutorial $recipe" bench.log 180 $PY examples/dense_tutorial.py --recipe $recipe --iters 20 || true
    done
  fi
  tar -cf "$OUT/bench_results.tar" bench/results 2>/dev/null
  grep -vE "^\s*$" "$OUT/bench.log" | tail -60
fi

exit $status
