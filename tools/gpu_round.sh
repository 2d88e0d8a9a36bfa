#!/usr/bin/env bash
# One device call for a round of kernel work: build, the GPU tests of the named test files,
# racecheck/memcheck over a -k selection, and the named benchmark commands, each with its
# own time limit, logs under $OUT. Used while tuning; tools/gpu_check.sh is the full check.
#   TESTS="tests/a.py tests/b.py" RACE_K="..." RACE_FILES="..." BENCHES="bench/x.py --variants;bench/y.py" tools/gpu_round.sh
#   LIB_DIR=build/cuda ... tools/gpu_round.sh   # with libraries carried from here (below)
#   TEST_K="wgmma" narrows the tests (pytest -k)
set -uo pipefail
OUT=${OUT:-/tmp/lowbit_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# LIB_DIR: libraries built on the local machine (tools/build_cuda_here.sh) and carried; used
# when they load on this GPU (python -m lowbit reports the CUDA build and its demo passes),
# else lowbit is built here as without LIB_DIR.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${LIB_DIR:-}" ] && LOWBIT_LIBRARY_DIR=$PWD/$LIB_DIR python3 -m lowbit >"$OUT/report.log" 2>&1 \
    && grep -q "cuda_build *lowbit" "$OUT/report.log" && grep -q "on gpu .*OK" "$OUT/report.log"; then
  export LOWBIT_LIBRARY_DIR=$PWD/$LIB_DIR
  echo "carried libraries load ($LIB_DIR)"
else
  [ -n "${LIB_DIR:-}" ] && { echo "carried libraries do not load:"; grep -E "cuda_|Error" "$OUT/report.log" | head -5; }
  bash tools/gpu_check.sh build >/dev/null 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build ok"
fi
if [ -n "${TESTS:-}" ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_LIMIT:-240} python3 -m pytest -q -rf -n 6 -p no:cacheprovider ${TEST_MARK:+-m "$TEST_MARK"} ${TEST_K:+-k "$TEST_K"} $TESTS >"$OUT/tests.log" 2>&1
  grep -E "^FAILED|^ERROR| passed| failed" "$OUT/tests.log" | tail -25
fi
if [ -n "${RACE_K:-}" ]; then
  for tool in racecheck memcheck; do
    XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${RACE_LIMIT:-120} compute-sanitizer --tool $tool --error-exitcode 3 \
      python3 -m pytest -q -m gpu -p no:cacheprovider -k "$RACE_K" $RACE_FILES >"$OUT/$tool.log" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY| passed| failed" "$OUT/$tool.log" | tail -3
  done
fi
IFS=';' read -ra cmds <<<"${BENCHES:-}"
for c in "${cmds[@]}"; do
  [ -z "$c" ] && continue
  echo "=== $c" >>"$OUT/bench.log"
  timeout ${BENCH_LIMIT:-200} python3 $c 2>&1 | grep -vE "^E1122|Source Location|^external|cuda_executor" >>"$OUT/bench.log"
done
tar -cf "$OUT/bench_results.tar" bench/results 2>/dev/null
[ -f "$OUT/bench.log" ] && grep -vE "^\s*$" "$OUT/bench.log" | tail -${TAIL:-70}
exit 0
