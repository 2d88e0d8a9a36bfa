"""Activation + quantize forward, dact + dbias + quantize backward (gelu and swiglu) and the
fused softmax forward/backward, lowbit against XLA's jnp version of the same computation, in
one run. Prints time, GB/s (bytes the fused op must read + write), % of the measured copy
bandwidth, and the speedup over XLA; writes bench/results/activation_<device>.json.

    python bench/bench_activation.py            # GPU: 16384 x 16384 bf16, softmax (4, 32, 2048, 2048)
    python bench/bench_activation.py --small    # CPU smoke run
    python bench/bench_activation.py --variants # GPU: lowbit times per kernel geometry variant
    python bench/bench_activation.py --variants 0,3 --ops gelu_fwd,softmax_fwd  # a subset
    python bench/bench_activation.py --dtype float32 --shapes 8192x16384 --no-y --ops gelu_fwd,gelu_bwd
                                                # the seed layer's fp32 MLP activation
    python bench/bench_activation.py --dtype float32 --shapes 8192x16384 --no-y --ops gelu_fwd,gelu_bwd --bias
                                                # the same with layernorm_mlp's wi_bias in the kernel

--variants [LIST] times the lowbit ops once per value (default 0,1,2) of the tuning knobs
LOWBIT_ACT_VARIANT (activation.cu: grid blocks per SM 0 = resident (occupancy), 1 = 4,
2 = 16, 4 = 8, all with the cross-tile prefetch and 64-row tiles; 3 = 8 without it; 5 / 6 =
as 0 with 128- / 256-row tiles (gated backward: 128); 7 / 8 = as 6 / 5 with 2 chunk rows per
thread for fp32 input, 9 = as 6 with 4 (gated backward: 2), for other dtypes 7-9 = 6 / 5 / 6;
unset = 6; softmax knows 0-3 only, so pass 4-9 with activation --ops only) and LOWBIT_SOFTMAX_VARIANT (softmax.cu: 0 = 3 = the
default row-group kernel with forward 32 and backward the fewest elements per thread, 1 / 2 =
forward 16 / 64 and backward 16 / 32), each in a
subprocess (the launchers read the variables at every call; results are identical).
--ops (any mode) runs only the named ops: gelu_fwd, gelu_bwd, swiglu_fwd, swiglu_bwd,
softmax_fwd, softmax_bwd (each subprocess draws only the inputs its ops need).
--dev-time adds each variant's kernel time (profiler trace; % of the kernel-time copy
bandwidth) to the --variants table.
--dtype (bfloat16, float32 or float16) and --shapes ROWSxH ... set the activations' input
(x is ROWS x H, gated ROWS x 2 x H; softmax stays bf16); --no-y / --no-dx leave out the
high-precision y / dx (only the FP8 copies, amax and dbias are written, as the fused
lowbit.layernorm_mlp path asks for them), and the GB/s count what is written.
--bias adds a bias of x's trailing shape to x before the activation: lowbit's `bias` operand
(added in the kernels), XLA's jnp add of the widened values (fused into its kernels); the
bias's own bytes (H or 2H values) are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import lowbit  # noqa: E402
from lowbit.ops.softmax import softmax_backward_reference, softmax_reference  # noqa: E402

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
OPS = ("gelu_fwd", "gelu_bwd", "swiglu_fwd", "swiglu_bwd", "softmax_fwd", "softmax_bwd")


def _act(a, act):
    a = a.astype(jnp.float32)
    if act == "gelu":
        return 0.5 * a * (1 + jnp.tanh(0.7978845608 * a * (1 + 0.044715 * a * a)))
    return a * jax.nn.sigmoid(a)


def _biased(x, bias):
    return x if bias is None else x.astype(jnp.float32) + bias.astype(jnp.float32)


def xla_forward(x, scale, act, gated, return_y=True, bias=None):
    """What XLA fuses from jnp: y (if return_y), rowwise + transposed fp8 copies, amax."""
    dtype, x = x.dtype, _biased(x, bias)
    y = _act(x[..., 0, :], act) * x[..., 1, :].astype(jnp.float32) if gated else _act(x, act)
    q = (y * scale).clip(-448, 448).astype(E4M3)
    return (y.astype(dtype) if return_y else None), q, q.T, jnp.max(jnp.abs(y))


def xla_backward(dz, x, scale, act, gated, return_dx=True, bias=None):
    f = (lambda v: _act(v[..., 0, :], act) * v[..., 1, :]) if gated else (lambda v: _act(v, act))
    _, vjp = jax.vjp(f, _biased(x, bias).astype(jnp.float32))
    (dx,) = vjp(dz.astype(jnp.float32))
    dx2 = dx.reshape(dx.shape[0], -1)
    q = (dx2 * scale).clip(-57344, 57344).astype(E5M2)
    return ((dx.astype(x.dtype) if return_dx else None), q, q.T, jnp.max(jnp.abs(dx2)),
            jnp.sum(dx2, 0).astype(x.dtype))


def lowbit_forward(x, scale, act, gated, return_y=True, bias=None):
    return lowbit.ops.act_forward(x, "silu" if act == "swiglu" else act, gated=gated, quant_scale=scale,
                                  rowwise=True, colwise=True, return_y=return_y, bias=bias)


def lowbit_backward(dz, x, scale, act, gated, return_dx=True, bias=None):
    return lowbit.ops.act_backward(dz, x, "silu" if act == "swiglu" else act, gated=gated,
                                   quant_scale=scale, rowwise=True, colwise=True, compute_dbias=True,
                                   return_dx=return_dx, bias=bias)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_size_args(parser)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"),
                        help="the activations' input dtype")
    parser.add_argument("--no-y", action="store_true", help="forward: no high-precision y")
    parser.add_argument("--no-dx", action="store_true", help="backward: no high-precision dx")
    parser.add_argument("--bias", action="store_true", help="a bias added to x before the activation")
    parser.add_argument("--dev-time", action="store_true",
                        help="--variants: also the kernel time per variant (a profiler trace per op)")
    parser.add_argument("--variants", nargs="?", const="0,1,2", default=None,
                        help="time the lowbit ops per kernel variant, e.g. 0,3 (subprocesses)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ", ".join(OPS))
    parser.add_argument("--lowbit-only", action="store_true", help=argparse.SUPPRESS)  # --variants child
    args = parser.parse_args()
    ops = set(args.ops.split(","))
    if not ops <= set(OPS):
        raise SystemExit(f"--ops: unknown {sorted(ops - set(OPS))}; expected names from {OPS}")
    if args.variants:
        return run_variants(args)
    shapes = common.sizes(args, [(16384, 16384)], [(256, 512)])[0]
    iters = args.iters or (2 if args.small else 20)
    dtype = jnp.dtype(args.dtype)
    esize = dtype.itemsize
    sm_shape = (1, 2, 64, 64) if args.small else (4, 32, 2048, 2048)
    copy_bw = common.copy_bandwidth(1 << 22 if args.small else 1 << 30)
    # Kernel-time copy bandwidth (None without a GPU): lowbit's ops are then also timed from
    # a profiler trace, without the host's dispatch gaps (bench/common.py device_time_fn).
    copy_dev = None if args.lowbit_only and not args.dev_time else common.copy_bandwidth(1 << 22 if args.small else 1 << 30,
                                                                   device_time=True)
    rng = np.random.default_rng(0)
    scale = jnp.ones((1,), jnp.float32)
    rows_out = []

    def time_xla(fn, sets):
        return float("nan") if args.lowbit_only else common.time_fn(fn, sets, iters=iters)

    def record(name, bytes_moved, t_lowbit, t_xla, fn=None, sets=None):
        gbs = bytes_moved / t_lowbit / 1e9
        row = dict(op=name, lowbit_us=t_lowbit * 1e6, xla_us=t_xla * 1e6, GBps=gbs,
                   pct_copy=100 * bytes_moved / t_lowbit / copy_bw, speedup=t_xla / t_lowbit)
        d = common.device_time_fn(fn, sets) if copy_dev and fn is not None else None
        if d:
            row.update(lowbit_dev_us=d * 1e6, pct_copy_dev=100 * bytes_moved / d / copy_dev)
        rows_out.append(row)

    def normal(shape, dt=jnp.bfloat16):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dt)

    for (rows, hidden), (act, gated) in [(sh, ag) for sh in shapes for ag in (("gelu", False), ("swiglu", True))]:
        if not ops & {f"{act}_fwd", f"{act}_bwd"}:
            continue
        suffix = f" {args.dtype} {rows}x{hidden}" if args.shapes or args.dtype != "bfloat16" else ""
        suffix += " +bias" if args.bias else ""
        in_shape = (rows, 2, hidden) if gated else (rows, hidden)
        sets = [(normal(in_shape, dtype), scale, normal(in_shape[1:], dtype) if args.bias else None)
                for _ in range(2)]
        a = "silu" if act == "swiglu" else act
        n_in, n_out = int(np.prod(in_shape)), rows * hidden
        if f"{act}_fwd" in ops:
            fn = lambda x, s, b: lowbit_forward(x, s, act, gated, not args.no_y, b)  # noqa: E731
            t_l = common.time_fn(fn, sets, iters=iters)
            t_x = time_xla(lambda x, s, b: xla_forward(x, s, a, gated, not args.no_y, b), sets)
            nbytes = esize * n_in + (0 if args.no_y else esize * n_out) + 2 * n_out
            record(f"{act} fwd+q{suffix}", nbytes, t_l, t_x, fn, sets)
        if f"{act}_bwd" in ops:
            dsets = [(normal((rows, hidden), dtype), x, s, b) for x, s, b in sets]
            fn = lambda d, x, s, b: lowbit_backward(d, x, s, act, gated, not args.no_dx, b)  # noqa: E731
            t_l = common.time_fn(fn, dsets, iters=iters)
            t_x = time_xla(lambda d, x, s, b: xla_backward(d, x, s, a, gated, not args.no_dx, b), dsets)
            nbytes = esize * n_out + esize * n_in + (0 if args.no_dx else esize * n_in) + 2 * n_in
            record(f"d{act}+dbias+q{suffix}", nbytes, t_l, t_x, fn, dsets)
        del sets

    if ops & {"softmax_fwd", "softmax_bwd"}:
        x = [(normal(sm_shape),) for _ in range(2)]
        n = int(np.prod(sm_shape))
        if "softmax_fwd" in ops:
            fn = lambda v: lowbit.ops.softmax_forward(v, None, 0.125)  # noqa: E731
            t_l = common.time_fn(fn, x, iters=iters)
            t_x = time_xla(lambda v: softmax_reference(v, None, 0.125), x)
            record("softmax fwd", 4 * n, t_l, t_x, fn, x)
        if "softmax_bwd" in ops:
            y = [(v, lowbit.ops.softmax_forward(v, None, 0.125)) for (v,) in x]
            fn = lambda d, yy: lowbit.ops.softmax_backward(d, yy, 0.125)  # noqa: E731
            t_l = common.time_fn(fn, y, iters=iters)
            t_x = time_xla(lambda d, yy: softmax_backward_reference(d, yy, 0.125), y)
            record("softmax bwd", 6 * n, t_l, t_x, fn, y)

    if args.lowbit_only:
        print("VARIANT_RESULT " + json.dumps(dict(copy_GBps=copy_bw / 1e9, results=rows_out)))
        return
    print(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s; activations {shapes} {args.dtype}"
          f"{' (no y)' if args.no_y else ''}{' (no dx)' if args.no_dx else ''}"
          f"{' (bias)' if args.bias else ''}, softmax {sm_shape} bf16")
    if copy_dev:
        print(f"copy bandwidth from kernel time {copy_dev / 1e9:.1f} GB/s")
    common.print_table(rows_out, ["op", "lowbit_us", "xla_us", "GBps", "pct_copy", "speedup"]
                       + (["lowbit_dev_us", "pct_copy_dev"] if copy_dev else []))
    path = common.write_results("activation", dict(copy_GBps=copy_bw / 1e9,
                                                   copy_kernel_time_GBps=copy_dev / 1e9 if copy_dev else None,
                                                   shapes=[list(sh) for sh in shapes], dtype=args.dtype,
                                                   no_y=args.no_y, no_dx=args.no_dx, bias=args.bias,
                                                   softmax_shape=list(sm_shape), results=rows_out))
    print(f"wrote {path}")


def run_variants(args):
    """Times the lowbit ops under each variant in a subprocess; one table, one results file."""
    table, raw = {}, {}
    variants = args.variants.split(",")
    for v in variants:
        env = dict(os.environ, LOWBIT_ACT_VARIANT=v, LOWBIT_SOFTMAX_VARIANT=v)
        cmd = [sys.executable, os.path.abspath(__file__), "--lowbit-only", "--ops", args.ops, "--dtype", args.dtype]
        cmd += ["--iters", str(args.iters)] if args.iters else []
        cmd += ["--shapes", *args.shapes] if args.shapes else []
        cmd += [f for f, on in (("--small", args.small), ("--no-y", args.no_y), ("--no-dx", args.no_dx),
                                ("--dev-time", args.dev_time), ("--bias", args.bias)) if on]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("VARIANT_RESULT ")]
        if out.returncode != 0 or not line:
            raise SystemExit(f"variant {v} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        raw[v] = json.loads(line[0].split(" ", 1)[1])
        for r in raw[v]["results"]:
            row = table.setdefault(r["op"], {"op": r["op"]})
            row[f"v{v}_us"], row[f"v{v}_pct"] = r["lowbit_us"], r["pct_copy"]
            if "lowbit_dev_us" in r:  # --dev-time on a GPU: kernel time, % of the kernel-time copy
                row[f"v{v}_dev_us"], row[f"v{v}_dev_pct"] = r["lowbit_dev_us"], r["pct_copy_dev"]
    print(f"copy bandwidth {raw[variants[0]]['copy_GBps']:.1f} GB/s; "
          f"LOWBIT_ACT_VARIANT / LOWBIT_SOFTMAX_VARIANT = {', '.join(variants)}")
    keys = ("us", "pct", "dev_us", "dev_pct") if any("lowbit_dev_us" in r for d in raw.values()
                                                      for r in d["results"]) else ("us", "pct")
    cols = ["op"] + [f"v{v}_{k}" for v in variants for k in keys]
    common.print_table(list(table.values()), cols)
    path = common.write_results("activation_variants", dict(variants=raw))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
