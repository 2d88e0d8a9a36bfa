#!/usr/bin/env bash
# A/B of kernels under Nsight Compute: the kernels of tools/profile_ops.py OPS, profiled once
# with each library directory, alternating A B A B, one log per run under $OUT (or ./ncu_ab).
# ROUNDS (2) rounds. Prints each kernel's time, warp instructions, DRAM throughput and issue-slot use.
#
#   tools/ncu_ab.sh A_LIBDIR B_LIBDIR 'regex:TileKernel|multiply' block_step [OPS...]
#
# Each library directory holds liblowbit.so and liblowbit_cuda.so (LOWBIT_LIBRARY_DIR); build
# the old one from a git worktree (docs/developing.md). Clocks are left to the card
# (--clock-control none): compare within one call only.
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 A_LIBDIR B_LIBDIR KERNEL_FILTER OPS..." >&2
  exit 2
fi
a_dir=$1 b_dir=$2 filter=$3
shift 3
out=${OUT:-ncu_ab}
mkdir -p "$out"
metrics=gpu__time_duration.sum,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics=$metrics,sm__inst_issued.avg.pct_of_peak_sustained_active
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in A B; do
    dir=$a_dir
    [ "$side" = B ] && dir=$b_dir
    log="$out/ncu_${side}${round}.log"
    LOWBIT_LIBRARY_DIR=$dir ncu --clock-control none --kernel-name-base demangled -k "$filter" \
      --metrics "$metrics" python3 tools/profile_ops.py "$@" > "$log" 2>&1 || { tail -20 "$log"; exit 1; }
    echo "== $side (round $round, $dir)"
    # One line per launch: time (us), instructions, DRAM %, issue %, kernel name (shortened).
    # ncu prints a launch's metrics sorted by name: smsp__inst_executed comes last.
    awk '/^  [^ ].*\(/ { name = $0; sub(/\(.*/, "", name); sub(/^ +/, "", name) }
         /gpu__time_duration.sum/ { t = $NF }
         /sm__inst_issued/ { s = $NF }
         /dram__throughput/ { d = $NF }
         /smsp__inst_executed.sum/ { i = $NF; printf "%9s us %14s inst %6s%% dram %6s%% issue  %s\n", t, i, d, s, substr(name, 1, 110) }' \
      "$log"
  done
done
