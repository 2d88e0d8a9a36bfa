"""LayerNorm/RMSNorm forward (plain, and fused with FP8 rowwise + colwise quantization) and
backward through lowbit.ops, beside XLA's fused jnp LayerNorm (+ jnp quantization) in the
same run. Prints time, GB/s, % of the measured device copy bandwidth and the speedup over
XLA; writes bench/results/norm_<device>.json.

Bytes counted: forward reads x and gamma (+ beta) and writes y (and q rowwise + colwise,
one byte each); backward reads dz, x and gamma and writes dx (mu/rsigma/dgamma are
per-row or per-column, negligible at these shapes, and are not counted).

    python bench/bench_norm.py            # GPU: 16384 x 4096 and 16384 x 8192, bf16
    python bench/bench_norm.py --small    # CPU smoke run at tiny sizes
    python bench/bench_norm.py --variants # GPU: the forward per launch-tuning variant

--variants times the two forward cases once per LOWBIT_NORM_FWD_VARIANT setting (the
forward launcher's tuning knob, csrc/norm/norm_plan.h: items per thread, cp.async row
stages, block sizes, colwise block tile, column segment length / cluster, tile order,
barrier split and fences, gamma/beta in shared memory or registers), each in its own
subprocess, and prints one table (XLA alongside);
--variants "items=8;items=16,stages=4" times the given ';'-separated settings instead.
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

from lowbit.ops import norm_backward, norm_forward  # noqa: E402

E4M3_MAX = 448.0


def jnp_layernorm(x, gamma, beta, eps=1e-6):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, -1, keepdims=True)
    rs = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mu), -1, keepdims=True) + eps)
    return ((xf - mu) * rs * gamma + beta), mu, rs


def jnp_fwd(x, gamma, beta):
    y, _, _ = jnp_layernorm(x, gamma, beta)
    return y.astype(x.dtype)


def jnp_fwd_quant(x, gamma, beta, scale):
    y, _, _ = jnp_layernorm(x, gamma, beta)
    q = jnp.clip(y * scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return y.astype(x.dtype), q, q.T, jnp.max(jnp.abs(y))


def jnp_bwd(dz, x, gamma, beta):
    _, vjp = jax.vjp(lambda x, g, b: jnp_layernorm(x, g, b)[0].astype(x.dtype), x, gamma, beta)
    return vjp(dz)


def lowbit_fwd(x, gamma, beta):
    return norm_forward(x, gamma, beta).y


def lowbit_fwd_quant(x, gamma, beta, scale):
    o = norm_forward(x, gamma, beta, quant_scale=scale, colwise=True)
    return o.y, o.q_rowwise, o.q_colwise, o.amax


def make_lowbit_bwd(x, gamma, beta):
    o = jax.jit(lambda x: norm_forward(x, gamma, beta))(x)
    return lambda dz, x, g, b: norm_backward(dz, x, o.mu, o.rsigma, g)


# Launch-tuning settings timed by --variants ("" = the built-in defaults), at most 12. The
# sweep of 35efbbb ruled out colspan 64/128, colorder=0, l1keep=1, stages=3, items=8 and
# coltile=8 at the then-defaults; the next (bench/results/norm_variants_*) made the
# shared-memory-only cluster barriers (colbar=1) and one block of 1024 threads per SM
# (colblock=1024) the defaults and found parsmem no faster; the next
# (bench/results/norm_variants_parkeep_*) made gamma/beta in registers with 3 row stages
# (parkeep=1, parstages=3) the default, and removed 16-row column segments (colspan=16|0,
# 2x slower) and L2 evict-first hints (stream, no faster). This list re-times the
# neighbours of the parkeep defaults: its row stages, the per-row gamma/beta kernel, the
# block tile / cluster shape, tile order, barrier split and fences.
VARIANTS = ["", "parstages=2", "parstages=4", "parkeep=0", "parkeep=0,stages=3", "coltile=16",
            "coltile=8", "colspan=64", "colorder=0", "colsplit=0", "colbar=0", "colblock=256"]


def run(rows: int, hidden: int, dtype, copy_bw: float, iters: int,
        fwd_only: bool = False, copy_dev: float | None = None) -> list[dict]:
    key = jax.random.PRNGKey(0)
    sets = []
    for i in range(2):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        x = jax.random.normal(k1, (rows, hidden), jnp.float32).astype(dtype)
        dz = jax.random.normal(k2, (rows, hidden), jnp.float32).astype(dtype)
        sets.append((x, dz))
    gamma = jnp.ones((hidden,), jnp.float32)
    beta = jnp.zeros((hidden,), jnp.float32)
    scale = jnp.float32(64.0)
    n, es = rows * hidden, jnp.dtype(dtype).itemsize
    gb = 2 * hidden * 4
    cases = [  # name, lowbit fn, jnp fn, inputs, bytes
        ("fwd", lowbit_fwd, jnp_fwd, [(x, gamma, beta) for x, _ in sets], 2 * n * es + gb),
        ("fwd+quant(row+col)", lowbit_fwd_quant, jnp_fwd_quant,
         [(x, gamma, beta, scale) for x, _ in sets], 2 * n * es + 2 * n + gb),
    ]
    bwd = make_lowbit_bwd(sets[0][0], gamma, beta)
    if not fwd_only:
            cases.append(("bwd", bwd, jnp_bwd, [(dz, sets[0][0], gamma, beta) for _, dz in sets],
                      3 * n * es + hidden * 4))
    out = []
    for name, ours, theirs, inputs, nbytes in cases:
        t_ours = common.time_fn(ours, inputs, iters=iters)
        t_xla = common.time_fn(theirs, inputs, iters=iters)
        row = {
            "op": name, "rows": rows, "hidden": hidden, "dtype": jnp.dtype(dtype).name,
            "time_us": t_ours * 1e6, "GB/s": nbytes / t_ours / 1e9,
            "%copy": 100 * nbytes / t_ours / copy_bw, "xla_us": t_xla * 1e6,
            "xla_%copy": 100 * nbytes / t_xla / copy_bw, "speedup": t_xla / t_ours,
        }
        # Kernel time from a profiler trace (no host dispatch gaps), against the copy's.
        d_ours = common.device_time_fn(ours, inputs) if copy_dev else None
        d_xla = common.device_time_fn(theirs, inputs) if d_ours else None
        if d_ours and d_xla:
            row.update({"dev_us": d_ours * 1e6, "%copy_dev": 100 * nbytes / d_ours / copy_dev,
                        "xla_dev_us": d_xla * 1e6, "speedup_dev": d_xla / d_ours})
        out.append(row)
    return out


def run_variants(variants: list[str], iters: int, small: bool) -> None:
    """Each variant in a subprocess (the launcher reads the knob per call; a fresh process
    keeps one variant's compiled programs and allocations out of the next one's timing)."""
    rows = []
    for v in variants:
        env = dict(os.environ, LOWBIT_NORM_FWD_VARIANT=v)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--fwd-json",
                              "--iters", str(iters)] + (["--small"] if small else []),
                             env=env, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"variant {v or 'default'!r} failed:\n{out.stderr[-2000:]}")
            continue
        for r in json.loads(out.stdout.strip().splitlines()[-1]):
            rows.append({"variant": v or "default", **r})
    rows.sort(key=lambda r: (r["hidden"], r["op"], r.get("dev_us", r["time_us"])))
    common.print_table(rows, ["variant", "op", "hidden", "time_us", "%copy", "dev_us",
                              "%copy_dev", "xla_us", "speedup"])
    if not small:
        path = common.write_results("norm_variants", {"rows": rows})
        print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny CPU smoke run")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--variants", nargs="?", const=";".join(VARIANTS), default=None,
                        help="time the forward per LOWBIT_NORM_FWD_VARIANT setting "
                             "(';'-separated; default: the built-in list)")
    parser.add_argument("--fwd-json", action="store_true",
                        help=argparse.SUPPRESS)  # one --variants subprocess
    args = parser.parse_args()
    if args.variants is not None:
        run_variants(args.variants.split(";"), args.iters, args.small)
        return
    shapes = [(64, 256), (32, 512)] if args.small else [(16384, 4096), (16384, 8192)]
    copy_bw = common.copy_bandwidth(1 << 22 if args.small else 1 << 30)
    if args.fwd_json:
        # Kernel time too (dev_us, %copy_dev: the numbers the targets are stated in).
        copy_dev = common.copy_bandwidth(1 << 22 if args.small else 1 << 30, device_time=True)
        rows = []
        for r, h in shapes:
            rows += run(r, h, jnp.bfloat16, copy_bw, args.iters, fwd_only=True, copy_dev=copy_dev)
        print(json.dumps(rows, default=float))
        return
    copy_dev = common.copy_bandwidth(1 << 22 if args.small else 1 << 30, device_time=True)
    print(f"device {common.device_name()}, copy bandwidth {copy_bw / 1e9:.0f} GB/s"
          + (f", {copy_dev / 1e9:.0f} GB/s from kernel time" if copy_dev else ""))
    rows = []
    for r, h in shapes:
        rows += run(r, h, jnp.bfloat16, copy_bw, 3 if args.small else args.iters, copy_dev=copy_dev)
    common.print_table(rows, ["op", "rows", "hidden", "dtype", "time_us", "GB/s", "%copy",
                              "xla_us", "xla_%copy", "speedup"]
                       + (["dev_us", "%copy_dev", "xla_dev_us", "speedup_dev"] if copy_dev else []))
    if not args.small:
        path = common.write_results("norm", {"copy_bandwidth": copy_bw, "copy_bandwidth_kernel_time": copy_dev,
                                             "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
