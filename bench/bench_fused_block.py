"""Fused elementwise + block quantization (lowbit.ops.act_quantize_block, norm_quantize_block)
against the unfused lowbit path (the op's high-precision output, then the block quantizer),
rowwise + colwise copies with their scales, 16384 x 8192 bf16 (--small: 256 x 512, CPU smoke
run). Prints time, GB/s and % of the measured copy bandwidth of the fused path, the unfused
time and the speedup; with a GPU also the kernel time from a profiler trace (bench/common.py
device_time_fn) and its % of the kernel-time copy bandwidth. Writes
bench/results/fused_block_<device>.json.

Bytes counted (what the fused op must move): x read once (bf16), both fp8 copies and the
scales written (MXFP8: 2 x n/32 bytes; FP8 block 1x128: 2 x 4n/128); gamma / beta / mu /
rsigma are negligible. The norm rows run two launches, the norm forward's statistics pass
(reads x) and the fused quantize (reads x again), so their ceiling is about 4/6 of copy.

    python bench/bench_fused_block.py
    python bench/bench_fused_block.py --small
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from lowbit.ops.activation import act_forward  # noqa: E402
from lowbit.ops.fused_block import act_quantize_block, norm_quantize_block, norm_stats  # noqa: E402
from lowbit.ops.norm import norm_forward  # noqa: E402
from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8  # noqa: E402


def quantizer(mx):
    if mx:
        return lambda y: quantize_mxfp8(y, rowwise=True, colwise=True)
    return lambda y: quantize_fp8_block(y, rowwise=True, colwise=True)


def cases():
    """(name, mxfp8, fused fn, unfused fn, takes gamma/beta)."""
    out = []
    for mx, tag in ((True, "mxfp8"), (False, "fp8_1x128")):
        q = quantizer(mx)
        out.append((f"gelu+{tag}", mx, lambda x, g, b, mx=mx: act_quantize_block(x, "gelu", mxfp8=mx, colwise=True),
                    lambda x, g, b, q=q: q(act_forward(x, "gelu").y)))

        def fused_norm(x, g, b, mx=mx):
            mu, rs = norm_stats(x, g, b)
            return norm_quantize_block(x, g, b, mu, rs, mxfp8=mx, colwise=True)

        out.append((f"layernorm+{tag}", mx, fused_norm, lambda x, g, b, q=q: q(norm_forward(x, g, b).y)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    rows, hidden = (256, 512) if args.small else (16384, 8192)
    iters = 2 if args.small else args.iters
    copy_bw = common.copy_bandwidth(1 << 22 if args.small else 1 << 30)
    copy_dev = common.copy_bandwidth(1 << 22 if args.small else 1 << 30, device_time=True)
    rng = np.random.default_rng(0)
    gamma = jnp.asarray(rng.standard_normal(hidden, dtype=np.float32) * 0.5 + 1)
    beta = jnp.asarray(rng.standard_normal(hidden, dtype=np.float32))
    sets = [(jnp.asarray(rng.standard_normal((rows, hidden), dtype=np.float32), jnp.bfloat16), gamma, beta)
            for _ in range(2)]
    n = rows * hidden
    table = []
    for name, mx, fused, unfused in cases():
        moved = 2 * n + 2 * n + (2 * n // 32 if mx else 2 * 4 * n // 128)
        t_f = common.time_fn(fused, sets, iters=iters)
        t_u = common.time_fn(unfused, sets, iters=iters)
        row = dict(op=name, fused_us=t_f * 1e6, unfused_us=t_u * 1e6, GBps=moved / t_f / 1e9,
                   pct_copy=100 * moved / t_f / copy_bw, speedup=t_u / t_f)
        d = common.device_time_fn(fused, sets) if copy_dev else None
        if d:
            du = common.device_time_fn(unfused, sets)
            row.update(fused_dev_us=d * 1e6, pct_copy_dev=100 * moved / d / copy_dev,
                       unfused_dev_us=du * 1e6 if du else None)
        table.append(row)
    print(f"device {common.device_name()}, copy bandwidth {copy_bw / 1e9:.1f} GB/s"
          + (f", {copy_dev / 1e9:.1f} GB/s from kernel time" if copy_dev else "") + f"; {rows} x {hidden} bf16")
    common.print_table(table, ["op", "fused_us", "unfused_us", "GBps", "pct_copy", "speedup"]
                       + (["fused_dev_us", "pct_copy_dev", "unfused_dev_us"] if copy_dev else []))
    if not args.small:
        path = common.write_results("fused_block", dict(copy_GBps=copy_bw / 1e9,
                                                        copy_kernel_time_GBps=copy_dev / 1e9 if copy_dev else None,
                                                        rows=rows, hidden=hidden, results=table))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
