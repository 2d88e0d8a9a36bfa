#!/usr/bin/env bash
# Nsight Compute over the seed Dense's block GEMMs (tools/block_gemm_calls.py): lowbit's wgmma
# kernel (with per-instruction warp-stall sampling, exported as SASS csv) and cuBLASLt's, one
# profiled launch per shape, details under $OUT (3 files per shape and ncu.log; the device
# tool returns at most 8 files, so two shapes per call). Through the device tool, after a build or
# with carried libraries (LIB_DIR, as tools/gpu_round.sh):
#   LIB_DIR=build/cuda SHAPES="fwd wgrad" GROUP=n8 bash tools/profile_block_gemm.sh
set -uo pipefail
OUT=${OUT:-/tmp/lowbit_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ -n "${LIB_DIR:-}" ] && export LOWBIT_LIBRARY_DIR=$PWD/$LIB_DIR
[ -n "${GROUP:-}" ] && export LOWBIT_BLOCK_GEMM_GROUP=$GROUP
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy"
for shape in ${SHAPES:-fwd wgrad}; do
  for path in wgmma cublaslt; do
    k=BlockGemmKernel; extra="--section SourceCounters --import-source no"
    [ $path = cublaslt ] && { k=nvjet; extra=""; }
    LOWBIT_BLOCK_GEMM=$path timeout 150 ncu --clock-control none -k "regex:$k" --launch-skip 1 --launch-count 1 \
      $SECTIONS $extra -o "$OUT/${path}_$shape" python3 tools/block_gemm_calls.py $shape >>"$OUT/ncu.log" 2>&1
    echo "$path $shape rc=$?"
    ncu -i "$OUT/${path}_$shape.ncu-rep" --print-details all >"$OUT/${path}_${shape}_details.txt" 2>&1
    [ $path = wgmma ] && ncu -i "$OUT/${path}_$shape.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip >"$OUT/${path}_${shape}_sass.csv.gz"
    rm -f "$OUT/${path}_$shape.ncu-rep"
  done
done
grep -HE "  Duration|SM Busy|L2 Cache Throughput|L2 Hit Rate|DRAM Throughput|Memory Throughput  .*byte/s" "$OUT"/*_details.txt
