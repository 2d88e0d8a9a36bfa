"""FP8 per-tensor quantize (lowbit.ops.quantize_fp8) per layout, beside XLA's fused jnp
quantization of the same tensor (amax + rowwise cast + transposed colwise cast, + column
sums for dbias) in the same run. Prints time, GB/s (bytes read + written), % of the
measured device copy bandwidth, and the speedup over XLA; writes bench/results JSON.

    python bench/bench_quantize.py            # GPU: 16384x8192 and 8192x32768 bf16
    python bench/bench_quantize.py --small    # CPU smoke run at tiny sizes
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from lowbit.ops import quantize_fp8  # noqa: E402

LAYOUTS = {  # name -> (rowwise, colwise, dbias)
    "rowwise": (True, False, False),
    "colwise": (False, True, False),
    "both": (True, True, False),
    "both+dbias": (True, True, True),
}


def lowbit_fn(rowwise, colwise, dbias):
    def f(x, scale):
        return quantize_fp8(x, scale, rowwise=rowwise, colwise=colwise, compute_dbias=dbias)

    return f


def xla_fn(rowwise, colwise, dbias):
    """The jnp reference, fused by XLA: the same outputs as lowbit's op."""

    def f(x, scale):
        xf = x.astype(jnp.float32)
        q = jnp.clip(xf * scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)
        out = [jnp.max(jnp.abs(xf))]
        if rowwise:
            out.append(q)
        if colwise:
            out.append(q.T)
        if dbias:
            out.append(jnp.sum(xf, axis=0).astype(x.dtype))
        return tuple(out)

    return f


def moved_bytes(rows: int, cols: int, itemsize: int, rowwise: bool, colwise: bool, dbias: bool) -> int:
    n = rows * cols
    return n * itemsize + n * (int(rowwise) + int(colwise)) + (cols * itemsize if dbias else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny sizes, runs on the CPU")
    parser.add_argument("--shapes", nargs="*", default=None, help="ROWSxCOLS, e.g. 16384x8192")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()

    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    else:
        shapes = [(256, 512), (128, 1024)] if args.small else [(16384, 8192), (8192, 32768)]
    iters = args.iters or (3 if args.small else 20)
    repeats = 2 if args.small else 5
    bandwidth = common.copy_bandwidth(1 << 20 if args.small else 1 << 30)
    print(f"device {common.device_name()}, copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")

    scale = jnp.float32(0.5)
    rows_out = []
    for rows, cols in shapes:
        keys = jax.random.split(jax.random.key(0), 2)
        sets = [(jax.random.normal(k, (rows, cols), jnp.bfloat16), scale) for k in keys]
        for name, (rowwise, colwise, dbias) in LAYOUTS.items():
            nbytes = moved_bytes(rows, cols, 2, rowwise, colwise, dbias)
            t_lowbit = common.time_fn(lowbit_fn(rowwise, colwise, dbias), sets, iters, repeats)
            t_xla = common.time_fn(xla_fn(rowwise, colwise, dbias), sets, iters, repeats)
            gbps = nbytes / t_lowbit / 1e9
            rows_out.append({
                "shape": f"{rows}x{cols}",
                "layout": name,
                "lowbit_us": t_lowbit * 1e6,
                "lowbit_GB/s": gbps,
                "%copy": 100.0 * nbytes / t_lowbit / bandwidth,
                "xla_us": t_xla * 1e6,
                "xla_GB/s": nbytes / t_xla / 1e9,
                "speedup": t_xla / t_lowbit,
            })
        del sets
    columns = ["shape", "layout", "lowbit_us", "lowbit_GB/s", "%copy", "xla_us", "xla_GB/s", "speedup"]
    common.print_table(rows_out, columns)
    path = common.write_results(
        "quantize" + ("_small" if args.small else ""),
        {"dtype": "bfloat16", "fp8": "float8_e4m3fn", "copy_bandwidth_Bps": bandwidth,
         "target_percent_of_copy": 85.0, "rows": rows_out},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
