"""Seed Dense (x: 8x2048x8192 bf16 -> 32768 features) forward+backward, side by side in one
run: bf16 Flax, Flax's FP8 (`Fp8DirectDotGeneralOp`), and lowbit per recipe (delayed,
current, Float8BlockScaling as `lowbit_block`; `module_block_1d` / `_x2` / `_g2`: its other tile
choices, x/w/grad block_scaling_dim (1,1,1), (2,1,1), (1,1,2), default (1,2,1)), both as the `dot_general` drop-in into Flax's
Dense (`lowbit_*`) and as lowbit's own Dense module (`module_*`, same params; `*_unfused`: the
module with LOWBIT_DENSE_BACKWARD=unfused, dy's FP8 copies in buffers of their own instead of
inside dk's, lowbit.ops.dense_backward, or for `module_block_unfused` dy's colwise block copy
made whole instead of in bands of tokens, lowbit.dense_block_backward; `module_block_bands2` /
`_bands3` / `_bands4`: that backward with 2, 3 or 4 bands (LOWBIT_DENSE_BLOCK_BANDS); `*_fast_bwd`: the module with the recipe's dgrad and
wgrad at fast accumulation, fp8_gemm_dgrad / fp8_gemm_wgrad = MMParams(False), TE JAX 2.12's
numerics, not the default; `module_delayed_fast_dgrad`: the dgrad alone fast, the wgrad, whose
contraction runs over the tokens, split). Prints time
(variants timed round-robin, common.time_steps), speedup over bf16, the compiled step's peak
memory, and the GEMM-only floor: the three lowbit FP8 GEMMs of the step (fwd, dgrad, wgrad)
timed alone, beside the per-tensor FP8 GEMM ceiling and the block-scaled one (1x128 x
128x128, cuBLASLt on Hopper) measured at 8192^3.

    python bench/bench_dense.py            # GPU, seed shape
    python bench/bench_dense.py --small    # CPU smoke run
    python bench/bench_dense.py --block-paths cublaslt,wgmma   # block GEMM floor per kernel
    python bench/bench_dense.py --variants module_delayed --algo fused_dgrad=1
        # each lowbit variant also as <variant>@algo, traced with LOWBIT_GEMM_ALGO=fused_dgrad=1
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import linen as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import common  # noqa: E402
from quickstart_jax_utils import make_step  # noqa: E402

import lowbit  # noqa: E402
from lowbit.dense import DENSE_BACKWARD_ENV  # noqa: E402
from lowbit.dense_block_backward import BANDS_ENV  # noqa: E402
from lowbit.ops.gemm import GemmScaleMode, scale_shape  # noqa: E402
from lowbit.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling  # noqa: E402


class DenseBlock(nn.Module):
    features: int
    dot_general_cls: object = None
    flax_fp8: bool = False

    @nn.compact
    def __call__(self, x):
        if self.flax_fp8:
            return nn.Dense(self.features, dtype=x.dtype, dot_general_cls=nn.Fp8DirectDotGeneralOp)(x)
        dg = self.dot_general_cls() if self.dot_general_cls else None
        return nn.Dense(self.features, dtype=x.dtype, dot_general=dg)(x)


class LowbitDenseBlock(nn.Module):
    """The same layer as lowbit's own Linen module (lowbit.flax.DenseGeneral, named like
    DenseBlock's Dense so the params carry over): the bias rides in the GEMM epilogue and
    dbias in dy's quantize pass, the f32 kernel is quantized as stored (no bf16 copy) and
    wgrad is written in f32, where the drop-in leaves those steps to XLA around the GEMM."""
    features: int
    recipe: object = None

    @nn.compact
    def __call__(self, x):
        return lowbit.flax.DenseGeneral(self.features, quantization_recipe=self.recipe,
                                        name="Dense_0")(x)


def variants():
    return {
        "bf16": DenseBlock,
        "flax_fp8": lambda features: DenseBlock(features, flax_fp8=True),
        "lowbit_delayed": lambda features: DenseBlock(
            features, lowbit.flax.make_dot_general_cls(DelayedScaling())),
        "lowbit_current": lambda features: DenseBlock(
            features, lowbit.flax.make_dot_general_cls(Float8CurrentScaling())),
        "lowbit_block": lambda features: DenseBlock(
            features, lowbit.flax.make_dot_general_cls(Float8BlockScaling())),
        "module_delayed": lambda features: LowbitDenseBlock(features, DelayedScaling()),
        "module_current": lambda features: LowbitDenseBlock(features, Float8CurrentScaling()),
        "module_block": lambda features: LowbitDenseBlock(features, Float8BlockScaling()),
        # TE's other Float8BlockScaling tile choices (x, w, grad block_scaling_dim; 2 = 128x128):
        # every one has a 1x128 x 1x128 GEMM, in another place than the default's wgrad.
        "module_block_1d": lambda features: LowbitDenseBlock(features, Float8BlockScaling(
            x_block_scaling_dim=1, w_block_scaling_dim=1, grad_block_scaling_dim=1)),
        "module_block_x2": lambda features: LowbitDenseBlock(features, Float8BlockScaling(
            x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=1)),
        "module_block_g2": lambda features: LowbitDenseBlock(features, Float8BlockScaling(
            x_block_scaling_dim=1, w_block_scaling_dim=1, grad_block_scaling_dim=2)),
        "module_delayed_unfused": lambda features: LowbitDenseBlock(features, DelayedScaling()),
        "module_current_unfused": lambda features: LowbitDenseBlock(features, Float8CurrentScaling()),
        "module_block_unfused": lambda features: LowbitDenseBlock(features, Float8BlockScaling()),
        "module_block_bands2": lambda features: LowbitDenseBlock(features, Float8BlockScaling()),
        "module_block_bands3": lambda features: LowbitDenseBlock(features, Float8BlockScaling()),
        "module_block_bands4": lambda features: LowbitDenseBlock(features, Float8BlockScaling()),
        "module_delayed_fast_bwd": lambda features: LowbitDenseBlock(features, DelayedScaling(**common.FAST_BWD)),
        "module_current_fast_bwd": lambda features: LowbitDenseBlock(features, Float8CurrentScaling(**common.FAST_BWD)),
        "module_delayed_fast_dgrad": lambda features: LowbitDenseBlock(features, DelayedScaling(
            fp8_gemm_dgrad=common.FAST_BWD["fp8_gemm_dgrad"])),
    }


def gemm_floor(m, k, n, iters, backward_split=True):
    """Seconds of the step's three FP8 GEMMs alone (fwd fast accumulation, bwd split unless
    backward_split=False; the wgrad written in f32, as lowbit's module writes an f32 kernel's
    gradient)."""
    key = jax.random.PRNGKey(3)
    f8 = jnp.float8_e4m3fn
    e5 = jnp.float8_e5m2
    a = jax.random.normal(key, (m, k)).astype(f8)          # x rowwise
    w_t = jax.random.normal(key, (n, k)).astype(f8)        # kernel colwise
    w = jax.random.normal(key, (k, n)).astype(f8)          # kernel rowwise
    dy = jax.random.normal(key, (m, n)).astype(e5)         # dy rowwise
    dy_t = jax.random.normal(key, (n, m)).astype(e5)       # dy colwise
    a_t = jax.random.normal(key, (k, m)).astype(f8)        # x colwise
    one = jnp.ones((1,), jnp.float32)
    g = lowbit.ops.gemm
    t_fwd = common.time_fn(lambda a, b: g(a, b, one, one, out_dtype=jnp.bfloat16, use_split_accumulator=False), [(a, w_t)], iters)
    split = backward_split
    t_dgrad = common.time_fn(lambda a, b: g(a, b, one, one, out_dtype=jnp.bfloat16, use_split_accumulator=split),
                             [(dy, w)], iters)
    t_wgrad = common.time_fn(lambda a, b: g(a, b, one, one, out_dtype=jnp.float32, use_split_accumulator=split),
                             [(a_t, dy_t)], iters)
    return t_fwd, t_dgrad, t_wgrad


def block_gemm_floor(m, k, n, iters):
    """Seconds of Float8BlockScaling's three GEMMs alone at the step's shapes: fwd and dgrad
    1x128 x 128x128 (activation/gradient tiles x weight tiles, bf16 out), wgrad 1x128 x 1x128
    (f32 out, as the module's step writes it)."""
    key = jax.random.PRNGKey(4)
    f8 = jnp.float8_e4m3fn
    B1, B2 = GemmScaleMode.BLOCK_1x128, GemmScaleMode.BLOCK_128x128

    def operand(rows, cols, mode):
        data = jax.random.normal(key, (rows, cols)).astype(f8)
        return data, jnp.ones(scale_shape(mode, rows, cols), jnp.float32)

    def time_pair(a, b, ma, mb, out=jnp.bfloat16):
        return common.time_fn(lambda a, b, sa, sb: lowbit.ops.gemm(
            a, b, sa, sb, out_dtype=out, a_scale_mode=ma, b_scale_mode=mb),
            [(a[0], b[0], a[1], b[1])], iters)

    t_fwd = time_pair(operand(m, k, B1), operand(n, k, B2), B1, B2)      # x rowwise, kernel colwise
    t_dgrad = time_pair(operand(m, n, B1), operand(k, n, B2), B1, B2)    # dy rowwise, kernel rowwise
    t_wgrad = time_pair(operand(k, m, B1), operand(n, m, B1), B1, B1, jnp.float32)  # x colwise, dy colwise
    return t_fwd, t_dgrad, t_wgrad


def block_paths(paths, m, k, n, iters, rounds):
    """The block floor per block GEMM path (cuBLASLt or lowbit's wgmma kernel), the paths
    timed in turn within each round; LOWBIT_BLOCK_GEMM is read at every call. A path
    "wgmma:G" also sets the wgmma kernel's raster order (LOWBIT_BLOCK_GEMM_GROUP=G, e.g. 4 or
    n8: csrc/gemm/block_gemm_sm90.cu), and "wgmma@FILE" runs the kernels of the cubin FILE
    (LOWBIT_BLOCK_GEMM_CUBIN=FILE: tools/sass_control.py)."""
    flops = 3 * 2 * m * k * n
    knobs = ("LOWBIT_BLOCK_GEMM_GROUP", "LOWBIT_BLOCK_GEMM_CUBIN")
    for r in range(rounds):
        for entry in paths:
            rest, _, cubin = entry.partition("@")
            path, _, group = rest.partition(":")
            os.environ["LOWBIT_BLOCK_GEMM"] = path
            for name, value in zip(knobs, (group, cubin)):
                if value:
                    os.environ[name] = value
                else:
                    os.environ.pop(name, None)
            t = block_gemm_floor(m, k, n, iters)
            print(f"round {r} {entry:9s} fwd {t[0]*1e3:.3f} dgrad {t[1]*1e3:.3f} wgrad {t[2]*1e3:.3f} ms; "
                  f"total {sum(t)*1e3:.3f} ms = {flops / sum(t) / 1e12:.0f} TFLOP/s", flush=True)
    for name in ("LOWBIT_BLOCK_GEMM", *knobs):
        os.environ.pop(name, None)


def fp8_ceiling(size, iters):
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size)).astype(jnp.float8_e4m3fn)
    one = jnp.ones((1,), jnp.float32)
    t = common.time_fn(lambda a, b: lowbit.ops.gemm(a, b, one, one, out_dtype=jnp.bfloat16, use_split_accumulator=False), [(a, a)], iters)
    return 2 * size**3 / t / 1e12


def fp8_block_ceiling(size, iters):
    """TFLOP/s of the block-scaled FP8 GEMM (x 1x128 tiles, w 128x128 tiles) at size^3."""
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size)).astype(jnp.float8_e4m3fn)
    sa = jnp.ones(scale_shape(GemmScaleMode.BLOCK_1x128, size, size), jnp.float32)
    sb = jnp.ones(scale_shape(GemmScaleMode.BLOCK_128x128, size, size), jnp.float32)
    t = common.time_fn(lambda a, b, sa, sb: lowbit.ops.gemm(
        a, b, sa, sb, out_dtype=jnp.bfloat16, a_scale_mode=GemmScaleMode.BLOCK_1x128,
        b_scale_mode=GemmScaleMode.BLOCK_128x128), [(a, a, sa, sb)], iters)
    return 2 * size**3 / t / 1e12


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--variants", default=None,
                        help="comma-separated subset of " + ",".join(variants())
                        + " (bf16 always runs: the ratios need it)")
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds (common.time_steps)")
    parser.add_argument("--block-paths", default=None,
                        help="only the Float8BlockScaling GEMM floor, per LOWBIT_BLOCK_GEMM path "
                        "(comma-separated, e.g. cublaslt,wgmma,wgmma:n8; wgmma:G sets the raster order "
                        "LOWBIT_BLOCK_GEMM_GROUP=G, wgmma@FILE the kernels' cubin LOWBIT_BLOCK_GEMM_CUBIN=FILE), "
                        "--rounds rounds round-robin")
    common.add_algo_argument(parser)
    args = parser.parse_args(argv)
    chosen = set(args.variants.split(",")) | {"bf16"} if args.variants else None
    if chosen is not None and chosen - set(variants()):
        parser.error(f"--variants: unknown {sorted(chosen - set(variants()))}")
    b, s, h, f = (2, 64, 256, 512) if args.small else (8, 2048, 8192, 32768)
    iters = args.iters or (2 if args.small else 20)
    if args.block_paths:
        return block_paths(args.block_paths.split(","), b * s, h, f, iters, args.rounds)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (b, s, h), jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(1), (b, s, f), jnp.bfloat16)
    flops = 3 * 2 * b * s * h * f

    def build_step(name, model):
        step = make_step(model.apply, {})
        if "_bands" in name:  # the banded block backward with another band count
            return common.with_env(step, BANDS_ENV, name.rsplit("_bands", 1)[1])
        return common.with_env(step, DENSE_BACKWARD_ENV, "unfused") if name.endswith("_unfused") else step

    cases, models, params = {}, {}, None
    for name, make in variants().items():
        if chosen is not None and name not in chosen:
            continue
        model = models[name] = make(f)
        variables = model.init(key, x)
        if params is None:
            params = variables["params"]
        cases[name] = (build_step(name, model), {**variables, "params": params}, x, dy)
    cases = common.add_algo_twins(cases, args.algo, lambda name: build_step(name, models[name]))
    results = common.time_steps(cases, iters, rounds=1 if args.small else args.rounds)
    for r in results.values():
        r["tflops"] = flops / r["ms"] * 1e3 / 1e12
    rows = common.speedup_table(results)
    for row in rows:
        row["TFLOP/s"] = results[row["variant"]]["tflops"]
    t_fwd, t_dgrad, t_wgrad = gemm_floor(b * s, h, f, iters)
    floor_ms = (t_fwd + t_dgrad + t_wgrad) * 1e3
    fast_bwd = any(name.endswith("_fast_bwd") for name in cases)
    if fast_bwd:
        fast_floor_ms = sum(gemm_floor(b * s, h, f, iters, backward_split=False)) * 1e3
    b_fwd, b_dgrad, b_wgrad = block_gemm_floor(b * s, h, f, iters)
    block_floor_ms = (b_fwd + b_dgrad + b_wgrad) * 1e3
    size = 1024 if args.small else 8192
    ceiling = fp8_ceiling(size, iters)
    block_ceiling = fp8_block_ceiling(size, iters)
    common.print_table(rows, ["variant", "ms", "TFLOP/s", "x bf16", "peak GiB"])
    print(f"FP8 GEMM-only floor of the step: {floor_ms:.3f} ms (fwd {t_fwd*1e3:.3f}, dgrad "
          f"{t_dgrad*1e3:.3f}, wgrad {t_wgrad*1e3:.3f}) = {flops / (floor_ms / 1e3) / 1e12:.0f} TFLOP/s")
    if fast_bwd:
        print(f"FP8 GEMM-only floor, backward at fast accumulation: {fast_floor_ms:.3f} ms = "
              f"{flops / (fast_floor_ms / 1e3) / 1e12:.0f} TFLOP/s")
    print(f"Float8BlockScaling GEMM-only floor: {block_floor_ms:.3f} ms (fwd {b_fwd*1e3:.3f}, dgrad "
          f"{b_dgrad*1e3:.3f}, wgrad {b_wgrad*1e3:.3f}) = {flops / (block_floor_ms / 1e3) / 1e12:.0f} TFLOP/s")
    common.print_table([
        {"GEMM at %d^3" % size: "FP8 per-tensor (fast accum)", "TFLOP/s": ceiling, "x per-tensor": 1.0},
        {"GEMM at %d^3" % size: "FP8 block 1x128 x 128x128", "TFLOP/s": block_ceiling,
         "x per-tensor": block_ceiling / ceiling},
    ], ["GEMM at %d^3" % size, "TFLOP/s", "x per-tensor"])
    path = common.write_results("dense" + ("_small" if args.small else ""), {
        "shape": {"batch": b, "seq": s, "hidden": h, "features": f},
        "variants": results, "algo_twins": args.algo, "gemm_floor_ms": floor_ms,
        "gemm_ms": {"fwd": t_fwd * 1e3, "dgrad": t_dgrad * 1e3, "wgrad": t_wgrad * 1e3},
        "gemm_floor_fast_bwd_ms": fast_floor_ms if fast_bwd else None,
        "block_gemm_floor_ms": block_floor_ms,
        "block_gemm_ms": {"fwd": b_fwd * 1e3, "dgrad": b_dgrad * 1e3, "wgrad": b_wgrad * 1e3},
        "fp8_gemm_ceiling_tflops": ceiling,
        "fp8_block_gemm_ceiling_tflops": block_ceiling,
        "gemm_ceiling_size": size,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
