"""Grouped FP8 quantize (lowbit.ops.quantize_grouped_fp8: G tensors stacked along the rows,
each with its own scale and amax) beside the ungrouped lowbit.ops.quantize_fp8 of the same
x in the same run. Prints time, GB/s and % of the measured device copy bandwidth, on the
wall clock and (on a GPU) from kernel time (bench/common.py), and the ratio to the
ungrouped op (the cost of grouping). Bytes counted: x read once + the FP8 copies written
(n * itemsize + n per copy), the least any grouped quantizer moves; current scaling reads
x twice (an amax pass first), so its % of copy is at most 2/3 of the fused kernel's
for bf16 with both copies (6 instead of 4 bytes per element moved).

    python bench/bench_quantize_grouped.py           # GPU: 16384x8192 bf16, G = 8 and 64
    python bench/bench_quantize_grouped.py --small   # CPU smoke run at tiny sizes
    python bench/bench_quantize_grouped.py --shapes 16384x8192 --groups 8 32 --split skewed

Group sizes (int32, passed as device data, as a MoE router would produce them): "even"
splits all rows equally; "skewed" splits 95% of the rows at random (seeded) uneven sizes,
some groups empty, the last 5% padding.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from lowbit.ops import quantize_fp8, quantize_grouped_fp8  # noqa: E402

LAYOUTS = {"both": (True, True), "rowwise": (True, False), "colwise": (False, True)}


def group_sizes(rows: int, groups: int, split: str) -> np.ndarray:
    if split == "even":
        sizes = np.full(groups, rows // groups, np.int64)
        sizes[: rows % groups] += 1
        return sizes.astype(np.int32)
    rng = np.random.default_rng(0)
    weights = rng.exponential(1.0, groups) * (rng.random(groups) > 0.1)  # ~10% empty groups
    weights = weights if weights.sum() > 0 else np.ones(groups)
    sizes = np.floor(weights / weights.sum() * int(rows * 0.95)).astype(np.int32)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_size_args(parser)
    parser.add_argument("--groups", nargs="*", type=int, default=None, help="G values (default 8 64)")
    parser.add_argument("--split", nargs="*", choices=["even", "skewed"], default=["even", "skewed"])
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=["both", "rowwise"])
    parser.add_argument("--scaling", nargs="*", choices=["delayed", "current"], default=["delayed", "current"])
    parser.add_argument("--sets", type=int, default=2, help="input sets = calls per timed program")
    args = parser.parse_args()

    shapes, iters, repeats = common.sizes(args, gpu_shapes=[(16384, 8192)], small_shapes=[(256, 512)])
    group_counts = args.groups or ([4] if args.small else [8, 64])
    bandwidth, bandwidth_dev = common.copy_bandwidths(args.small)

    rows_out = []
    for rows, cols in shapes:
        keys = jax.random.split(jax.random.key(0), args.sets)
        xs = [jax.random.normal(k, (rows, cols), jnp.bfloat16) for k in keys]
        for layout in args.layouts:
            rowwise, colwise = LAYOUTS[layout]
            nbytes = rows * cols * (2 + int(rowwise) + int(colwise))

            def timed(fn, sets):
                t = common.time_fn(fn, sets, iters, repeats)
                d = common.device_time_fn(fn, sets) if bandwidth_dev else None
                row = {"us": t * 1e6, "GB/s": nbytes / t / 1e9, "%copy": 100.0 * nbytes / t / bandwidth}
                if d:
                    row.update({"dev_us": d * 1e6, "%copy_dev": 100.0 * nbytes / d / bandwidth_dev})
                return row

            plain = lambda x, s: quantize_fp8(x, s, rowwise=rowwise, colwise=colwise)  # noqa: E731
            base = timed(plain, [(x, jnp.float32(0.5)) for x in xs])
            rows_out.append({"shape": f"{rows}x{cols}", "layout": layout, "op": "quantize_fp8", **base})
            for groups in group_counts:
                for split in args.split:
                    sizes = jnp.asarray(group_sizes(rows, groups, split))
                    for scaling in args.scaling:
                        if scaling == "delayed":
                            scale = jnp.full((groups,), 0.5, jnp.float32)
                            fn = lambda x, g, s: quantize_grouped_fp8(  # noqa: E731
                                x, g, s, rowwise=rowwise, colwise=colwise)
                            sets = [(x, sizes, scale) for x in xs]
                        else:
                            fn = lambda x, g: quantize_grouped_fp8(  # noqa: E731
                                x, g, rowwise=rowwise, colwise=colwise)
                            sets = [(x, sizes) for x in xs]
                        row = timed(fn, sets)
                        row.update({"shape": f"{rows}x{cols}", "layout": layout,
                                    "op": f"grouped G={groups} {split} {scaling}",
                                    "x ungrouped": row["us"] / base["us"]})
                        if "dev_us" in row and "dev_us" in base:
                            row["x ungrouped_dev"] = row["dev_us"] / base["dev_us"]
                        rows_out.append(row)
        del xs
    columns = ["shape", "layout", "op", "us", "GB/s", "%copy", "x ungrouped"]
    if bandwidth_dev:
        columns += ["dev_us", "%copy_dev", "x ungrouped_dev"]
    common.print_table(rows_out, columns)
    path = common.write_results("quantize_grouped" + ("_small" if args.small else ""),
                                {"dtype": "bfloat16", "fp8": "float8_e4m3fn", "copy_bandwidth_Bps": bandwidth,
                                 "copy_bandwidth_kernel_time_Bps": bandwidth_dev, "target_percent_of_copy": 85.0,
                                 "calls_per_program": args.sets, "rows": rows_out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
