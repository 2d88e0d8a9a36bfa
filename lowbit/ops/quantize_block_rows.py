"""lowbit.ops.quantize_fp8_block_colwise_rows: the colwise (transposed) FP8 block copy of a
band of rows of a 2-D x, read in place (lowbit_quantize_fp8_block_colwise_rows, csrc/ffi/
quantize_block_ffi.cc): equal, data and scale_inv, to lowbit.ops.quantize_fp8_block(
x[row_begin:row_begin + row_count], colwise=True)'s colwise copy, without XLA materializing
the slice first (a custom call's operand is a whole buffer).

row_begin is a multiple of 128, so that the band's blocks (1x128 along the rows in the
colwise copy, or 128x128 tiles) are x's own. lowbit.dense's Float8BlockScaling backward
quantizes dy's colwise copy one band at a time so, each band feeding one wgrad launch
(lowbit.ops.gemm_accumulate), so that only one band's copy is alive. Single device: no
sharding rule; vmap maps it with lax.map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching

from lowbit.ops._primitive import ffi_primitive
from lowbit.ops.quantize import FP8_DTYPES
from lowbit.ops.quantize_block import FP8_BLOCK_LEN, fp8_block_scale_shape

__all__ = ["quantize_fp8_block_colwise_rows"]

OP = "lowbit.ops.quantize_fp8_block_colwise_rows"


def _abstract(x, *, row_begin, row_count, tile_2d, pow2_scales, out_dtype):
    del row_begin, pow2_scales
    cols = x.shape[1]
    return (jax.core.ShapedArray((cols, row_count), out_dtype),
            jax.core.ShapedArray(fp8_block_scale_shape(cols, row_count, tile_2d), jnp.float32))


quantize_fp8_block_colwise_rows_p = ffi_primitive(
    "lowbit_quantize_fp8_block_colwise_rows", "lowbit_quantize_fp8_block_colwise_rows", _abstract,
    multiple_results=True, attrs=("row_begin", "row_count", "tile_2d", "pow2_scales"))


def _batch(args, dims, **params):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    return jax.lax.map(lambda v: tuple(quantize_fp8_block_colwise_rows_p.bind(v, **params)), x), (0, 0)


batching.primitive_batchers[quantize_fp8_block_colwise_rows_p] = _batch


def quantize_fp8_block_colwise_rows(x, row_begin: int, row_count: int, *, out_dtype=jnp.float8_e4m3fn,
                                    tile_2d: bool = False, pow2_scales: bool = False) -> tuple[jax.Array, jax.Array]:
    """(colwise (cols, row_count) fp8, its scale_inv fp8_block_scale_shape(cols, row_count,
    tile_2d) f32) of rows [row_begin, row_begin + row_count) of x (rows, cols) f32/f16/bf16."""
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{OP}: x: expected rank 2 (rows, cols), got shape {x.shape}")
    if x.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"{OP}: x: expected float32, float16 or bfloat16, got {x.dtype}")
    if jnp.dtype(out_dtype) not in FP8_DTYPES:
        raise TypeError(f"{OP}: out_dtype: expected float8_e4m3fn or float8_e5m2, got {out_dtype}")
    row_begin, row_count = int(row_begin), int(row_count)
    if row_begin < 0 or row_begin % FP8_BLOCK_LEN or row_count < 0 or row_begin + row_count > x.shape[0]:
        raise ValueError(f"{OP}: row_begin: expected a multiple of {FP8_BLOCK_LEN} with row_begin + row_count <= "
                         f"{x.shape[0]}, got row_begin {row_begin}, row_count {row_count}")
    col, scale = quantize_fp8_block_colwise_rows_p.bind(
        x, row_begin=np.int64(row_begin), row_count=np.int64(row_count), tile_2d=np.bool_(tile_2d),
        pow2_scales=np.bool_(pow2_scales), out_dtype=jnp.dtype(out_dtype))
    return col, scale
