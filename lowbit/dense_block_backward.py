"""lowbit.dense_block_backward: dense's Float8BlockScaling backward with dy's colwise copy made
in bands of tokens, so that a training step keeps at most one band of it alive.

The plain block backward (dense.backward_gemms) quantizes dy once into both copies, rowwise
(M, N) for the dgrad and colwise (N, M) for the wgrad; both are alive together, beside the
kernel's rowwise copy and x's colwise copy that the forward saved. On the seed Dense (x 16384
x 8192 bf16, kernel 8192 x 32768 f32) that put the step's peak at 5.44 GiB against bf16's 5.00
(DESIGN's target: at most bf16's). Here, in this order:

    dy -> rowwise copy (+ dbias)                    quantize_fp8_block, one pass over dy
    dx = gemm(dy rowwise, kernel rowwise)           XLA then frees both copies (placing the
                                                    rowwise copy inside dk's buffer, which is
                                                    not yet written)
    for each band [m0, m1) of dy's M rows (BANDS, edges multiples of 128):
        dy[m0:m1] -> colwise copy (N, m1 - m0)      read in place, quantize_block_rows
        dk (+)= gemm(x colwise[:, m0:m1], band)     the first band writes dk, the next add
                                                    into it in place (gemm_accumulate)

optimization_barriers order the bands after the dgrad and after each other (XLA would
otherwise quantize them all up front). Values: dx, dbias and each copy are exactly the plain
backward's (the bands' blocks are dy's: row bands start at multiples of 128); dk is the sum of
the bands' fp32 GEMMs, one more fp32 rounding per band than one GEMM over all tokens (cuBLASLt
promotes its block sums per 128-K block in fp32 anyway). The cost: dy is read twice (its
rowwise pass, then the bands), and the wgrad runs as BANDS launches.

Where it applies (`applies`; elsewhere dense runs the plain backward): FP8 block quantizers
(Float8BlockScaling, any tile choice), an f32 kernel (dk's partial sums then stay fp32; a
16-bit dk would round each band), at least two bands of 128 tokens, a process with one device
(`single_device`: one of its default platform and one CPU device. Its two ops have no
sharding rules, so under a sharded jit XLA would gather their operands, where the plain
backward's ops partition; a MeshResource with axes needs more than one device anyway), and
LOWBIT_DENSE_BACKWARD not "unfused". Seed Dense on an H200: peak 4.981 GiB (plain 5.442, bf16
5.000), 1.447x over bf16 (plain 1.473x in the same run).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowbit.ops.gemm import GemmScaleMode, gemm
from lowbit.ops.gemm_accumulate import gemm_accumulate
from lowbit.ops.quantize_block import FP8_BLOCK_LEN, fp8_block_scale_shape
from lowbit.ops.quantize_block_rows import quantize_fp8_block_colwise_rows
from lowbit.ops._sharding import fit_scale
from lowbit.quantize.quantizer import BlockScaleQuantizer
from lowbit.quantize.scaling_modes import ScalingMode
from lowbit.quantize.tensor import ScaledTensor1x

# Bands of dy's tokens for the wgrad (LOWBIT_DENSE_BLOCK_BANDS, read at trace time, overrides:
# a benchmark knob). At a band's wgrad the step holds x's colwise copy, the band's slice of it
# (a copy: a custom call's operand is a whole buffer), the band of dy's colwise copy and the
# GEMM's 32 MiB workspace. On the seed Dense (H200, 2026-11-30) two bands first left 524 MiB
# of temporaries, a peak of 5.012 GiB against bf16's 5.000, because XLA cut both bands' slices
# of x's copy up front; with the slices ordered too (below) two bands need ~460 MiB. Each more
# band costs a wgrad launch that reads and rewrites dk (three bands: 1.436x over bf16 against
# 1.456x for two, before that fix; after it two bands peak at 4.981 GiB, 1.447x).
BANDS = 2
BANDS_ENV = "LOWBIT_DENSE_BLOCK_BANDS"


def bands() -> int:
    """BANDS, or LOWBIT_DENSE_BLOCK_BANDS (a positive integer) where set."""
    text = os.environ.get(BANDS_ENV, "")
    if not text:
        return BANDS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"lowbit.dense: {BANDS_ENV}={text!r}: expected a positive integer")
    return int(text)


_MODES = {ScalingMode.FP8_BLOCK_1x128: GemmScaleMode.BLOCK_1x128,
          ScalingMode.FP8_BLOCK_128x128: GemmScaleMode.BLOCK_128x128}


def band_edges(m: int, count: int | None = None) -> list[int]:
    """Edges 0 = e0 < e1 < ... = m of `count` bands (default bands()), inner edges multiples
    of FP8_BLOCK_LEN, as equal as that allows; [0, m] when m has fewer than two blocks."""
    blocks = -(-m // FP8_BLOCK_LEN)
    count = max(1, min(bands() if count is None else count, blocks))
    inner = [round(blocks * i / count) * FP8_BLOCK_LEN for i in range(1, count)]
    return [0, *sorted(set(e for e in inner if 0 < e < m)), m]


def k_band_scale(scale, mode: GemmScaleMode, rows: int, k: int, k0: int, k1: int):
    """The block scale array of columns [k0, k1) (k0 a multiple of 128) of a (rows, k) GEMM
    operand whose scale array for all k columns is `scale` (lowbit.ops.gemm's layouts)."""
    b0, b1 = k0 // FP8_BLOCK_LEN, -(-k1 // FP8_BLOCK_LEN)
    if mode == GemmScaleMode.BLOCK_1x128:  # (ceil(k/128), roundup(rows, 4)): K blocks are rows
        return scale[b0:b1]
    want = fp8_block_scale_shape(rows, k1 - k0, True)  # (ceil(rows/128), roundup(K blocks, 4))
    return fit_scale(scale[:, b0:b1], want)


def single_device() -> bool:
    """Whether this process has one device of its default platform and one CPU device (the
    banded backward's ops run unpartitioned; a computation may be placed on either)."""
    return jax.device_count() == 1 and len(jax.devices("cpu")) == 1


def applies(dgrad_quantizer, x_col: ScaledTensor1x, k_row: ScaledTensor1x, kernel_dtype, m: int) -> bool:
    """Whether dense's backward runs banded (see the module docstring; the caller checks
    LOWBIT_DENSE_BACKWARD, the MeshResource and sequence parallelism)."""
    return (single_device() and isinstance(dgrad_quantizer, BlockScaleQuantizer) and dgrad_quantizer.mode in _MODES
            and x_col.scaling_mode in _MODES and k_row.scaling_mode in _MODES
            and jnp.dtype(kernel_dtype) == jnp.float32 and len(band_edges(m)) > 2)


def banded_block_backward(dy, x_col: ScaledTensor1x, k_row: ScaledTensor1x, dgrad_quantizer: BlockScaleQuantizer,
                          has_bias: bool, x_dtype, x_shape, kernel_shape, n_lead: int, checkpoint: str):
    """(dx x_shape, dw kernel_shape f32, dbias or None) of dense's block backward, banded.
    dy (M..., N...) with n_lead M dims; x_col (K..., M...) and k_row (K..., N...) the
    forward's saved copies; `checkpoint`: the name the GEMM outputs carry for remat policies."""
    m = math.prod(dy.shape[:n_lead])
    n = math.prod(dy.shape[n_lead:])
    k = math.prod(x_shape[n_lead:])
    q = dgrad_quantizer
    dy_row, dbias = q.quantize(dy, is_rowwise=True, is_colwise=False, flatten_axis=n_lead, compute_dbias=has_bias)
    n_out = dy.ndim - n_lead
    dx = gemm(dy_row.data, k_row.data, dy_row.scale_inv, k_row.scale_inv, out_dtype=x_dtype,
              contracting_ndim=n_out, a_scale_mode=_MODES[dy_row.scaling_mode],
              b_scale_mode=_MODES[k_row.scaling_mode])
    dx = checkpoint_name(dx, checkpoint)
    # The bands wait for the dgrad, and each band (its quantize and its slice of x's colwise
    # copy) for the previous band's GEMM: x2 goes through the barriers too, or XLA cuts every
    # band's slice of it in one fusion up front, all alive at once.
    dy2, x2, dx = jax.lax.optimization_barrier((dy.reshape(m, n), x_col.data.reshape(k, m), dx))
    x_mode = _MODES[x_col.scaling_mode]
    edges = band_edges(m)
    dw = None
    for m0, m1 in zip(edges[:-1], edges[1:]):
        if dw is not None:
            dy2, x2, dw = jax.lax.optimization_barrier((dy2, x2, dw))
        band, band_scale = quantize_fp8_block_colwise_rows(
            dy2, m0, m1 - m0, out_dtype=q.q_dtype, tile_2d=q.mode == ScalingMode.FP8_BLOCK_128x128,
            pow2_scales=q.use_power_2_scales)
        xa = x2[:, m0:m1]
        xs = k_band_scale(x_col.scale_inv, x_mode, k, m, m0, m1)
        kw = dict(a_scale_mode=x_mode, b_scale_mode=_MODES[q.mode])
        if dw is None:
            dw = gemm(xa, band, xs, band_scale, out_dtype=jnp.float32, **kw)
        else:
            dw = gemm_accumulate(dw, xa, band, xs, band_scale, **kw)
    dw = checkpoint_name(dw.reshape(kernel_shape), checkpoint)
    return dx, dw, dbias
