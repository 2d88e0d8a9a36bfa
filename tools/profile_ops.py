"""Runs each memory-bound lowbit kernel a few times at a benchmark shape, for Nsight Compute:

    ncu --clock-control none -k regex:'Quantize|Norm|Act|Softmax|Dbias' --launch-skip 0 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section WarpStateStats python tools/profile_ops.py [OPS...]

OPS (default all): quantize norm act softmax. Each op runs twice after compilation (the
profiler then sees two launches of each kernel); nothing is timed here (bench/ does that).
Opt-in: block (the plain FP8 1x128, 128x128 and MXFP8 quantizers, both copies, 16384x8192
bf16, then 1x128 and MXFP8 with dbias; kernels -k regex:TileKernel); grouped_block (quantize_grouped_block, colwise + rowwise, 64 skewed groups, MXFP8 and
FP8 1x128 / 128x128; kernels -k regex:'TileKernel|GroupTable'); fused_block (gelu and layernorm
fused with MXFP8 and FP8 1x128 quantization, beside the plain block quantizers of the same
shape: bench/bench_fused_block.py's cases; kernels -k regex:'TileKernel|Stats'); dense_step (the seed
Dense step, fused backward then LOWBIT_DENSE_BACKWARD=unfused, two steps each, after a bf16
x * 2 over dy's 16384 x 32768 as the copy to compare with: kernels -k regex:'QuantizeTiled|multiply'); block_step
(the same with Float8BlockScaling, two steps after the copy: kernels -k regex:'TileKernel|multiply').
Of the 'multiply' kernels, the bf16 x * 2 reached only 69% of DRAM peak on an H200 (638 us); the
model init's f32 multiply over the 8192 x 32768 kernel (also 2 GiB moved) reached 88% (500 us),
the card's copy speed (bench/results/quantize_kernel_experiments_NVIDIA_H200_2026-11-28.log).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import lowbit
from lowbit.ops import norm_backward, norm_forward, quantize_fp8, quantize_grouped_block


def run(f, *args):
    g = jax.jit(f)
    jax.block_until_ready(g(*args))  # compile + first run
    jax.block_until_ready(g(*args))


def dense_steps(variant: str, copy_input, backward_modes=(None,)):
    """A bf16 x * 2 over copy_input (dy's 16384 x 32768), then two steps of tools/trace_step.py's
    seed Dense `variant` per LOWBIT_DENSE_BACKWARD mode (None: unset), in that order."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import trace_step
    from lowbit.dense import DENSE_BACKWARD_ENV

    run(lambda v: v * 2, copy_input)
    for mode in backward_modes:
        if mode is not None:
            os.environ[DENSE_BACKWARD_ENV] = mode  # read when the step is traced
        step, args = trace_step.build("dense", variant)
        jax.block_until_ready(step(*args))
        jax.block_until_ready(step(*args))
        if mode is not None:
            os.environ.pop(DENSE_BACKWARD_ENV)


def main(ops):
    rng = np.random.default_rng(0)
    scale = jnp.ones((1,), jnp.float32)

    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)

    if "quantize" in ops:
        x = normal((16384, 8192))
        run(lambda v, s: quantize_fp8(v, s, rowwise=True, colwise=False), x, scale)
        run(lambda v, s: quantize_fp8(v, s, rowwise=True, colwise=True), x, scale)
        run(lambda v, s: quantize_fp8(v, s, rowwise=True, colwise=True, compute_dbias=True), x, scale)
    if "norm" in ops:
        x, dz = normal((16384, 4096)), normal((16384, 4096))
        gamma, beta = jnp.ones((4096,), jnp.float32), jnp.zeros((4096,), jnp.float32)
        run(lambda v: norm_forward(v, gamma, beta).y, x)
        run(lambda v, s: norm_forward(v, gamma, beta, quant_scale=s, colwise=True), x, scale)
        o = jax.jit(lambda v: norm_forward(v, gamma, beta))(x)
        run(lambda d, v: norm_backward(d, v, o.mu, o.rsigma, gamma), dz, x)
    if "act" in ops:
        x, dz = normal((8192, 8192)), normal((8192, 8192))
        run(lambda v, s: lowbit.ops.act_forward(v, "gelu", gated=False, quant_scale=s, rowwise=True,
                                                colwise=True), x, scale)
        run(lambda d, v, s: lowbit.ops.act_backward(d, v, "gelu", gated=False, quant_scale=s, rowwise=True,
                                                    colwise=True, compute_dbias=True), dz, x, scale)
        xg = normal((8192, 2, 8192))
        run(lambda v, s: lowbit.ops.act_forward(v, "silu", gated=True, quant_scale=s, rowwise=True,
                                                colwise=True), xg, scale)
    if "grouped_block" in ops:
        x = normal((16384, 8192))
        w = rng.exponential(1.0, 64)
        sizes = jnp.asarray(np.floor(w / w.sum() * 16384 * 0.95).astype(np.int32))  # unaligned, a tail
        for mode, tile_2d in (("mxfp8", False), ("fp8_block", False), ("fp8_block", True)):
            run(lambda v, g, m=mode, t=tile_2d: quantize_grouped_block(v, g, scaling_mode=m, tile_2d=t, colwise=True),
                x, sizes)
    from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8

    if "block" in ops:  # the plain block quantizers, both copies (kernels -k regex:TileKernel)
        x = normal((16384, 8192))
        run(lambda v: quantize_fp8_block(v, rowwise=True, colwise=True), x)
        run(lambda v: quantize_fp8_block(v, tile_2d=True, rowwise=True, colwise=True), x)
        run(lambda v: quantize_mxfp8(v, rowwise=True, colwise=True), x)
        # the dbias forms (a gradient's quantize): their column sums cost registers
        run(lambda v: quantize_fp8_block(v, rowwise=True, colwise=True, compute_dbias=True), x)
        run(lambda v: quantize_mxfp8(v, rowwise=True, colwise=True, compute_dbias=True), x)
    if "fused_block" in ops:
        from lowbit.ops.fused_block import act_quantize_block, norm_quantize_block, norm_stats

        x = normal((16384, 8192))
        gamma = jnp.asarray(rng.standard_normal(8192, np.float32) * 0.5 + 1)
        beta = jnp.asarray(rng.standard_normal(8192, np.float32))
        for mx in (True, False):
            run(lambda v, m=mx: (quantize_mxfp8(v, rowwise=True, colwise=True) if m
                                 else quantize_fp8_block(v, rowwise=True, colwise=True)), x)
            run(lambda v, m=mx: act_quantize_block(v, "gelu", mxfp8=m, colwise=True), x)
            mu, rs = jax.jit(norm_stats)(x, gamma, beta)
            run(lambda v, a, b, m=mx: norm_quantize_block(v, gamma, beta, a, b, mxfp8=m, colwise=True), x, mu, rs)
    if "dense_step" in ops:
        dense_steps("module_delayed", normal((16384, 32768)), backward_modes=("fused", "unfused"))
    if "block_step" in ops:
        dense_steps("module_block", normal((16384, 32768)))
    if "softmax" in ops:
        x = normal((2, 16, 2048, 2048))
        run(lambda v: lowbit.ops.softmax_forward(v, None, 0.125), x)
        y = jax.jit(lambda v: lowbit.ops.softmax_forward(v, None, 0.125))(x)
        run(lambda d, yy: lowbit.ops.softmax_backward(d, yy, 0.125), x, y)


if __name__ == "__main__":
    main(sys.argv[1:] or ["quantize", "norm", "act", "softmax"])
