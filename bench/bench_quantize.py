"""FP8 per-tensor quantize (lowbit.ops.quantize_fp8) per layout, beside XLA's fused jnp
quantization of the same tensor (amax + rowwise cast + transposed colwise cast, + column
sums for dbias) in the same run. Prints time, GB/s (bytes read + written), % of the
measured device copy bandwidth, and the speedup over XLA; writes bench/results JSON. On a
GPU it also prints the kernel (device) time of lowbit, XLA and the copy from a profiler
trace (bench/common.py device_time_fn) and % of copy from those: the wall clock adds the
host's dispatch gaps between programs to every call.

    python bench/bench_quantize.py            # GPU: 16384x8192 and 8192x32768 bf16
    python bench/bench_quantize.py --small    # CPU smoke run at tiny sizes
    python bench/bench_quantize.py --variants # GPU: every tiled-kernel variant, colwise/both/both+dbias

--variants [V ...] times the layouts that run the tiled CUDA kernel once per tile variant
(LOWBIT_QUANTIZE_TILE_VARIANT, see csrc/quantize/quantize.h), each in a subprocess of its
own with the variable set, and prints one table (no XLA baseline) plus the best variant
per shape and layout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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


# Tile variants --variants times by default: the default (256-row tiles) first, then 128- and 64-row
# tiles, and banded tile orders (bands of 16 tile rows).
DEFAULT_VARIANTS = ["r256s2", "r128s2", "r256s2b16", "r64s2", "r64s2b16"]
VARIANT_ENV = "LOWBIT_QUANTIZE_TILE_VARIANT"
ROWS_MARK = "BENCH_ROWS_JSON "


def moved_bytes(rows: int, cols: int, itemsize: int, rowwise: bool, colwise: bool, dbias: bool) -> int:
    n = rows * cols
    return n * itemsize + n * (int(rowwise) + int(colwise)) + (cols * itemsize if dbias else 0)


def run_variants(args, variants: list[str]) -> None:
    """One subprocess per variant (the env var set), then one combined table."""
    layouts = args.layouts or ["colwise", "both", "both+dbias"]
    rows_out, bandwidth = [], None
    for variant in variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--no-xla", "--emit-rows", "--layouts", *layouts]
        if args.shapes:
            cmd += ["--shapes", *args.shapes]
        if args.small:
            cmd.append("--small")
        if args.iters:
            cmd += ["--iters", str(args.iters)]
        env = dict(os.environ, **{VARIANT_ENV: variant})
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(ROWS_MARK)]
        if proc.returncode != 0 or not lines:
            print(f"variant {variant}: failed (exit {proc.returncode})\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
            continue
        payload = json.loads(lines[-1][len(ROWS_MARK):])
        bandwidth = payload["copy_bandwidth_Bps"]
        for row in payload["rows"]:
            rows_out.append({"variant": variant, **row})
    if not rows_out:
        sys.exit("no variant ran")
    print(f"device {common.device_name()}, copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    columns = ["variant", "shape", "layout", "lowbit_us", "lowbit_GB/s", "%copy"]
    common.print_table(rows_out, columns)
    best = {}
    for row in rows_out:
        key = (row["shape"], row["layout"])
        if key not in best or row["lowbit_us"] < best[key]["lowbit_us"]:
            best[key] = row
    print("best per shape and layout:")
    common.print_table(list(best.values()), columns)
    path = common.write_results(
        "quantize_variants" + ("_small" if args.small else ""),
        {"dtype": "bfloat16", "fp8": "float8_e4m3fn", "copy_bandwidth_Bps": bandwidth,
         "target_percent_of_copy": 85.0, "rows": rows_out},
    )
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_size_args(parser)
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=None,
                        help="layouts to time (default: all; with --variants: colwise both both+dbias)")
    parser.add_argument("--variants", nargs="*", default=None,
                        help=f"time each tile variant in a subprocess (default list: {' '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--no-xla", action="store_true", help="skip the XLA baseline")
    parser.add_argument("--sets", type=int, default=2,
                        help="input sets = calls per timed program (more amortize its dispatch gap)")
    parser.add_argument("--rowwise-kernel", choices=["chunks1", "chunks2", "tiled"], default=None,
                        help="sets LOWBIT_QUANTIZE_ROWWISE_KERNEL (the rowwise-only kernel, quantize.h)")
    parser.add_argument("--emit-rows", action="store_true", help=argparse.SUPPRESS)  # --variants' children
    args = parser.parse_args()
    if args.rowwise_kernel:
        os.environ["LOWBIT_QUANTIZE_ROWWISE_KERNEL"] = args.rowwise_kernel
    if args.variants is not None:
        run_variants(args, args.variants or DEFAULT_VARIANTS)
        return

    shapes, iters, repeats = common.sizes(args)
    layouts = {name: LAYOUTS[name] for name in (args.layouts or LAYOUTS)}
    bandwidth, bandwidth_dev = common.copy_bandwidths(args.small)
    if os.environ.get(VARIANT_ENV):
        print(f"{VARIANT_ENV}={os.environ[VARIANT_ENV]}")

    scale = jnp.float32(0.5)
    rows_out = []
    for rows, cols in shapes:
        keys = jax.random.split(jax.random.key(0), args.sets)
        sets = [(jax.random.normal(k, (rows, cols), jnp.bfloat16), scale) for k in keys]
        for name, (rowwise, colwise, dbias) in layouts.items():
            nbytes = moved_bytes(rows, cols, 2, rowwise, colwise, dbias)
            t_lowbit = common.time_fn(lowbit_fn(rowwise, colwise, dbias), sets, iters, repeats)
            row = {
                "shape": f"{rows}x{cols}",
                "layout": name,
                "lowbit_us": t_lowbit * 1e6,
                "lowbit_GB/s": nbytes / t_lowbit / 1e9,
                "%copy": 100.0 * nbytes / t_lowbit / bandwidth,
            }
            # Kernel time (no host dispatch gaps), against the copy's kernel time.
            d_lowbit = common.device_time_fn(lowbit_fn(rowwise, colwise, dbias), sets) if bandwidth_dev else None
            if d_lowbit:
                row.update({"lowbit_dev_us": d_lowbit * 1e6, "%copy_dev": 100.0 * nbytes / d_lowbit / bandwidth_dev})
            if not args.no_xla:
                t_xla = common.time_fn(xla_fn(rowwise, colwise, dbias), sets, iters, repeats)
                row.update({"xla_us": t_xla * 1e6, "xla_GB/s": nbytes / t_xla / 1e9, "speedup": t_xla / t_lowbit})
                d_xla = common.device_time_fn(xla_fn(rowwise, colwise, dbias), sets) if d_lowbit else None
                if d_xla:
                    row.update({"xla_dev_us": d_xla * 1e6, "xla_%copy_dev": 100.0 * nbytes / d_xla / bandwidth_dev,
                                "speedup_dev": d_xla / d_lowbit})
            rows_out.append(row)
        del sets
    columns = ["shape", "layout", "lowbit_us", "lowbit_GB/s", "%copy"]
    if not args.no_xla:
        columns += ["xla_us", "xla_GB/s", "speedup"]
    if bandwidth_dev:
        columns += ["lowbit_dev_us", "%copy_dev"] + ([] if args.no_xla else ["xla_dev_us", "speedup_dev"])
    common.print_table(rows_out, columns)
    payload = {"dtype": "bfloat16", "fp8": "float8_e4m3fn", "copy_bandwidth_Bps": bandwidth,
               "copy_bandwidth_kernel_time_Bps": bandwidth_dev,
               "target_percent_of_copy": 85.0, "rows": rows_out}
    if args.emit_rows:
        print(ROWS_MARK + json.dumps(payload))
        return
    payload["calls_per_program"] = args.sets
    path = common.write_results("quantize" + ("_small" if args.small else "")
                                + ("" if args.sets == 2 else f"_sets{args.sets}"), payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
