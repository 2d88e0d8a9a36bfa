"""NVFP4 quantize (lowbit.ops.quantize_nvfp4) per configuration: time per call (wall, and
device time from a profiler trace), GB/s and % of the measured device copy bandwidth, counting
the bytes an ideal one-pass kernel moves (x read once, plus the random words with SR; packed
data, scales with padding and global scales written). The kernels read x twice (a global-amax
pass, then the quantize pass), so `%copy_2pass` also counts the second read: the ceiling of
this design is 100% there. %copy is wall time against the wall-clock copy bandwidth (as the
other quantize benches); %copy_dev* are device time against the device-time copy bandwidth
(wall ratios where there is no trace, e.g. on the CPU). Writes bench/results JSON.

    python bench/bench_quantize_nvfp4.py            # GPU: 16384x8192 and 8192x32768 bf16
    python bench/bench_quantize_nvfp4.py --small    # CPU smoke run at tiny sizes
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

from lowbit.ops.quantize_nvfp4 import quantize_nvfp4, rht_sign_bits, scale_shape, sr_random_bits  # noqa: E402

CONFIGS = {  # name -> (rowwise, colwise, tile_2d, sr, rht)
    "rowwise": (True, False, False, False, False),
    "colwise": (False, True, False, False, False),
    "both": (True, True, False, False, False),
    "both rht": (True, True, False, False, True),
    "both sr rht": (True, True, False, True, True),
    "rowwise sr": (True, False, False, True, False),
    "16x16 both": (True, True, True, False, False),
}


def quantize_fn(rowwise, colwise, tile_2d, sr, rht):
    def f(x, rnd, bits):
        return quantize_nvfp4(x, random=rnd if sr else None, rht_sign_bits=bits if rht else None,
                              tile_2d=tile_2d, rowwise=rowwise, colwise=colwise)

    return f


def moved_bytes(rows, cols, itemsize, rowwise, colwise, sr) -> int:
    n = rows * cols
    total = itemsize * n + (4 * n if sr else 0)
    for on, (r, c) in ((rowwise, (rows, cols)), (colwise, (cols, rows))):
        if on:
            total += r * math.ceil(c / 2) + math.prod(scale_shape(r, c)) + 4
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_size_args(parser)
    args = parser.parse_args()

    shapes, iters, repeats = common.sizes(args)
    bandwidth, dev_bandwidth = common.copy_bandwidths(args.small)

    rows_out = []
    for rows, cols in shapes:
        keys = jax.random.split(jax.random.key(0), 2)
        sets = [(jax.random.normal(k, (rows, cols), jnp.bfloat16), sr_random_bits(k, (rows, cols)),
                 rht_sign_bits(k)) for k in keys]
        for name, (rowwise, colwise, tile_2d, sr, rht) in CONFIGS.items():
            fn = quantize_fn(rowwise, colwise, tile_2d, sr, rht)
            nbytes = moved_bytes(rows, cols, 2, rowwise, colwise, sr)
            t = common.time_fn(fn, sets, iters, repeats)
            t_dev = common.device_time_fn(fn, sets, iters=max(iters // 2, 2))
            # Device-time ratios against the device-time copy bandwidth where traced.
            t_ref, bw_ref = (t_dev, dev_bandwidth) if t_dev and dev_bandwidth else (t, bandwidth)
            rows_out.append({
                "shape": f"{rows}x{cols}",
                "config": name,
                "us": t * 1e6,
                "device_us": t_dev * 1e6 if t_dev else None,
                "GB/s": nbytes / t / 1e9,
                "%copy": 100.0 * nbytes / t / bandwidth,
                "%copy_dev": 100.0 * nbytes / t_ref / bw_ref,
                "%copy_dev_2pass": 100.0 * (nbytes + 2 * rows * cols) / t_ref / bw_ref,
            })
        del sets
    columns = ["shape", "config", "us", "device_us", "GB/s", "%copy", "%copy_dev", "%copy_dev_2pass"]
    common.print_table(rows_out, columns)
    path = common.write_results(
        "quantize_nvfp4" + ("_small" if args.small else ""),
        {"dtype": "bfloat16", "copy_bandwidth_Bps": bandwidth, "device_copy_bandwidth_Bps": dev_bandwidth,
         "target_percent_of_copy": 60.0, "rows": rows_out},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
