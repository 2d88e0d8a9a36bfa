"""Grouped FP8 quantize (lowbit.ops.quantize_grouped_fp8: G tensors stacked along the rows,
each with its own scale and amax) beside the ungrouped lowbit.ops.quantize_fp8 of the same
x in the same run; and the grouped block formats (lowbit.ops.quantize_grouped_block: MXFP8,
FP8 block 1x128 and 128x128, colwise and rowwise+colwise) beside the ungrouped
quantize_mxfp8 / quantize_fp8_block of the same x and layout. Prints time, GB/s and % of
the measured device copy bandwidth, on the wall clock and (on a GPU) from kernel time
(bench/common.py), and the ratio to the ungrouped op (the cost of grouping). Bytes counted: x read once + the FP8 copies written
(n * itemsize + n per copy), the least any grouped quantizer moves; current scaling reads
x twice (an amax pass first), so its % of copy is at most 2/3 of the fused kernel's
for bf16 with both copies (6 instead of 4 bytes per element moved).

    python bench/bench_quantize_grouped.py           # GPU: 16384x8192 bf16, G = 8 and 64
    python bench/bench_quantize_grouped.py --small   # CPU smoke run at tiny sizes
    python bench/bench_quantize_grouped.py --shapes 16384x8192 --groups 8 32 --split skewed
    python bench/bench_quantize_grouped.py --formats mxfp8 fp8_block   # block formats only
    python bench/bench_quantize_grouped.py --formats nvfp4 --split even skewed   # grouped NVFP4

Block formats: bytes counted as above (the scales, < 1% for 16384x8192, are not counted).
"skewed" sizes are not multiples of 8, so most FP8-block colwise writes (the transposed
copy, whose group columns then start unaligned) fall back from 8-byte to byte stores.
Group sizes (int32, passed as device data, as a MoE router would produce them): "even"
splits all rows equally; "skewed" splits 95% of the rows at random (seeded) uneven sizes,
some groups empty, the last 5% padding.
NVFP4 (`--formats nvfp4`: lowbit.ops.quantize_grouped_nvfp4, every copy group-bound, beside the
ungrouped quantize_nvfp4 of the same x and copies; "both" and "both sr rht"): bytes counted are
x read once + rows * cols / 2 per copy (packed E2M1; scales and the SR words not counted); both
NVFP4 ops read x twice (an amax pass first), so their ceiling here is below 100%.
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

from lowbit.ops import (quantize_fp8, quantize_fp8_block, quantize_grouped_block, quantize_grouped_fp8,  # noqa: E402
                        quantize_grouped_nvfp4, quantize_mxfp8, quantize_nvfp4)
from lowbit.ops.quantize_nvfp4 import rht_sign_bits, sr_random_bits  # noqa: E402

LAYOUTS = {"both": (True, True), "rowwise": (True, False), "colwise": (False, True)}
# Block formats: (scaling_mode, tile_2d) and the ungrouped op of the same layout.
BLOCK_FORMATS = {
    "mxfp8": ("mxfp8", False, lambda x, r, c: quantize_mxfp8(x, rowwise=r, colwise=c)),
    "fp8_block": ("fp8_block", False, lambda x, r, c: quantize_fp8_block(x, rowwise=r, colwise=c)),
    "fp8_block_2d": ("fp8_block", True, lambda x, r, c: quantize_fp8_block(x, tile_2d=True, rowwise=r, colwise=c)),
}
NVFP4_CONFIGS = {"both": False, "both sr rht": True}  # name -> stochastic rounding and RHT


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
    parser.add_argument("--formats", nargs="*", choices=["fp8"] + list(BLOCK_FORMATS) + ["nvfp4"],
                        default=["fp8"] + list(BLOCK_FORMATS) + ["nvfp4"])
    parser.add_argument("--block-layouts", nargs="*", choices=["both", "colwise"], default=["both", "colwise"],
                        help="layouts of the block formats (rowwise alone is the ungrouped op itself)")
    args = parser.parse_args()

    shapes, iters, repeats = common.sizes(args, gpu_shapes=[(16384, 8192)], small_shapes=[(256, 512)])
    group_counts = args.groups or ([4] if args.small else [8, 64])
    bandwidth, bandwidth_dev = common.copy_bandwidths(args.small)

    rows_out = []
    for rows, cols in shapes:
        keys = jax.random.split(jax.random.key(0), args.sets)
        xs = [jax.random.normal(k, (rows, cols), jnp.bfloat16) for k in keys]

        def timed(fn, sets, nbytes):
            t = common.time_fn(fn, sets, iters, repeats)
            d = common.device_time_fn(fn, sets) if bandwidth_dev else None
            row = {"us": t * 1e6, "GB/s": nbytes / t / 1e9, "%copy": 100.0 * nbytes / t / bandwidth}
            if d:
                row.update({"dev_us": d * 1e6, "%copy_dev": 100.0 * nbytes / d / bandwidth_dev})
            return row

        def grouped_row(row, base, layout, op):
            row.update({"shape": f"{rows}x{cols}", "layout": layout, "op": op, "x ungrouped": row["us"] / base["us"]})
            if "dev_us" in row and "dev_us" in base:
                row["x ungrouped_dev"] = row["dev_us"] / base["dev_us"]
            return row

        for layout in args.layouts if "fp8" in args.formats else []:
            rowwise, colwise = LAYOUTS[layout]
            nbytes = rows * cols * (2 + int(rowwise) + int(colwise))
            timed_fp8 = lambda fn, sets, n=nbytes: timed(fn, sets, n)  # noqa: E731
            plain = lambda x, s: quantize_fp8(x, s, rowwise=rowwise, colwise=colwise)  # noqa: E731
            base = timed_fp8(plain, [(x, jnp.float32(0.5)) for x in xs])
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
                        rows_out.append(grouped_row(timed_fp8(fn, sets), base, layout,
                                                    f"grouped G={groups} {split} {scaling}"))
        for name in [f for f in args.formats if f in BLOCK_FORMATS]:
            mode, tile_2d, plain_block = BLOCK_FORMATS[name]
            for layout in args.block_layouts:
                rowwise, colwise = LAYOUTS[layout]
                nbytes = rows * cols * (2 + int(rowwise) + int(colwise))
                base = timed(lambda x, r=rowwise, c=colwise, q=plain_block: q(x, r, c), [(x,) for x in xs], nbytes)
                rows_out.append({"shape": f"{rows}x{cols}", "layout": layout, "op": name, **base})
                for groups in group_counts:
                    for split in args.split:
                        sizes = jnp.asarray(group_sizes(rows, groups, split))
                        fn = lambda x, g, m=mode, t=tile_2d, r=rowwise: quantize_grouped_block(  # noqa: E731
                            x, g, scaling_mode=m, tile_2d=t, rowwise=r, colwise=True)
                        row = timed(fn, [(x, sizes) for x in xs], nbytes)
                        rows_out.append(grouped_row(row, base, layout, f"{name} grouped G={groups} {split}"))
        if "nvfp4" in args.formats:
            nbytes = rows * cols * 2 + 2 * rows * (-(-cols // 2))
            for config, sr_rht in NVFP4_CONFIGS.items():
                # (x, random, sign bits) per input set; None where not used (RNE, no RHT).
                extra = [(sr_random_bits(k, x.shape), rht_sign_bits(k)) if sr_rht else (None, None)
                         for x, k in zip(xs, keys)]
                plain = lambda x, r=None, b=None: quantize_nvfp4(x, random=r, rht_sign_bits=b, colwise=True)  # noqa: E731
                base = timed(plain, [(x, *e) if sr_rht else (x,) for x, e in zip(xs, extra)], nbytes)
                rows_out.append({"shape": f"{rows}x{cols}", "layout": config, "op": "nvfp4", **base})
                for groups in group_counts:
                    for split in args.split:
                        sizes = jnp.asarray(group_sizes(rows, groups, split))
                        fn = lambda x, g, r=None, b=None: quantize_grouped_nvfp4(  # noqa: E731
                            x, g, random=r, rht_sign_bits=b, colwise=True)
                        sets = [(x, sizes, *e) if sr_rht else (x, sizes) for x, e in zip(xs, extra)]
                        row = timed(fn, sets, nbytes)
                        rows_out.append(grouped_row(row, base, config, f"nvfp4 grouped G={groups} {split}"))
                del extra
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
