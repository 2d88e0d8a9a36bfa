"""Block-scaled quantize (lowbit.ops.quantize_fp8_block, quantize_mxfp8) per format and
layout, beside the per-tensor FP8 quantize (lowbit.ops.quantize_fp8, the same copies) in
the same run. Prints time, GB/s (bytes read + written, scales included), % of the measured
device copy bandwidth and the ratio to the per-tensor kernel, and the block op's kernel time
per call (jax.profiler trace: every kernel of the call, GPU only); writes bench/results JSON.
"+dbias" configs also return the column sums (compute_dbias=True: fused into the block
kernel's pass, plus a small finalize kernel; the per-tensor kernel fuses its own), and
"+jnp dbias" is the unfused baseline: the block quantize plus XLA's jnp.sum over the rows.

    python bench/bench_quantize_block.py --configs "1x128 both,1x128 both+dbias,1x128 both+jnp dbias"

    python bench/bench_quantize_block.py            # GPU: 16384x8192 and 8192x32768 bf16
    python bench/bench_quantize_block.py --small    # CPU smoke run at tiny sizes
    python bench/bench_quantize_block.py --sweep LOWBIT_BLOCK_TILE_STAGED=1,0
        (every config timed once per value of a knob the C++ launchers read at every call,
        one value after the other on the same compiled function; an empty value unsets it)
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from lowbit.ops import quantize_fp8, quantize_fp8_block, quantize_mxfp8  # noqa: E402
from lowbit.ops.quantize_block import fp8_block_scale_shape, mxfp8_scale_shape  # noqa: E402

CONFIGS = {  # name -> (format, rowwise, colwise, dbias: None | "fused" | "jnp")
    "1x128 rowwise": ("1x128", True, False, None),
    "1x128 colwise": ("1x128", False, True, None),
    "1x128 both": ("1x128", True, True, None),
    "1x128 both+dbias": ("1x128", True, True, "fused"),
    "1x128 both+jnp dbias": ("1x128", True, True, "jnp"),
    "128x128 both": ("128x128", True, True, None),
    "mxfp8 rowwise": ("mxfp8", True, False, None),
    "mxfp8 colwise": ("mxfp8", False, True, None),
    "mxfp8 both": ("mxfp8", True, True, None),
    "mxfp8 both+dbias": ("mxfp8", True, True, "fused"),
}


def block_fn(fmt, rowwise, colwise, dbias=None):
    def f(x):
        fused = dbias == "fused"
        if fmt == "mxfp8":
            out = quantize_mxfp8(x, rowwise=rowwise, colwise=colwise, compute_dbias=fused)
        else:
            out = quantize_fp8_block(x, tile_2d=fmt == "128x128", rowwise=rowwise, colwise=colwise,
                                     compute_dbias=fused)
        if dbias == "jnp":
            return out, jnp.sum(x.astype(jnp.float32), axis=0).astype(x.dtype)
        return out

    return f


def tensor_fn(rowwise, colwise, dbias=None):
    def f(x):
        return quantize_fp8(x, jnp.float32(0.5), rowwise=rowwise, colwise=colwise, compute_dbias=dbias is not None)

    return f


def moved_bytes(rows, cols, fmt, rowwise, colwise, dbias=None) -> int:
    n = rows * cols
    total = 2 * n + (2 * cols if dbias else 0)  # bf16 in (and dbias out)
    for on, col in ((rowwise, False), (colwise, True)):
        if not on:
            continue
        if fmt == "mxfp8":
            scale_bytes = math.prod(mxfp8_scale_shape(rows, cols, col))
        else:
            r, c = (cols, rows) if col else (rows, cols)
            scale_bytes = 4 * math.prod(fp8_block_scale_shape(r, c, fmt == "128x128"))
        total += n + scale_bytes
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_size_args(parser)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    parser.add_argument("--sweep", default=None, help="VAR=v1,v2,...: time every config under each value")
    args = parser.parse_args()
    sweep_var, sweep_values = None, [None]
    if args.sweep:
        sweep_var, _, values = args.sweep.partition("=")
        if not sweep_var or not values:
            parser.error("--sweep: expected VAR=v1,v2,...")
        sweep_values = values.split(",")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; expected names from {list(CONFIGS)}")

    shapes, iters, repeats = common.sizes(args)
    bandwidth, kernel_bandwidth = common.copy_bandwidths(args.small)

    rows_out = []
    for rows, cols in shapes:
        keys = jax.random.split(jax.random.key(0), 2)
        sets = [(jax.random.normal(k, (rows, cols), jnp.bfloat16),) for k in keys]
        for name in names:
            fmt, rowwise, colwise, dbias = CONFIGS[name]
            nbytes = moved_bytes(rows, cols, fmt, rowwise, colwise, dbias)
            fn = jax.jit(block_fn(fmt, rowwise, colwise, dbias))
            t_tensor = common.time_fn(tensor_fn(rowwise, colwise, dbias), sets, iters, repeats)
            for value in sweep_values:
                if sweep_var is not None:
                    if value:
                        os.environ[sweep_var] = value
                    else:
                        os.environ.pop(sweep_var, None)
                t_block = common.time_fn(fn, sets, iters, repeats)
                k_block = common.device_time_fn(fn, sets)
                row = {"shape": f"{rows}x{cols}", "config": name}
                if sweep_var is not None:
                    row[sweep_var] = value
                rows_out.append({
                    **row,
                    "block_us": t_block * 1e6,
                    "block_GB/s": nbytes / t_block / 1e9,
                    "block_kernel_us": None if k_block is None else k_block * 1e6,
                    "%copy": 100.0 * nbytes / t_block / bandwidth,
                    "%copy_kernel": None if k_block is None or not kernel_bandwidth
                    else 100.0 * nbytes / k_block / kernel_bandwidth,
                    "per_tensor_us": t_tensor * 1e6,
                    "block/per_tensor": t_block / t_tensor,
                })
        del sets
    columns = ["shape", "config", *([sweep_var] if sweep_var else []), "block_us", "block_kernel_us", "block_GB/s",
               "%copy", "%copy_kernel", "per_tensor_us", "block/per_tensor"]
    common.print_table(rows_out, columns)
    path = common.write_results(
        "quantize_block" + ("_small" if args.small else ""),
        {"dtype": "bfloat16", "fp8": "float8_e4m3fn", "copy_bandwidth_Bps": bandwidth,
         "target_percent_of_copy": 85.0, "rows": rows_out},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
