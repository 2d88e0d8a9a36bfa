"""ScaledTensorFactory (TE's constructors of quantized tensors): rebuilding each scaling mode's
copies from their raw data and scales with TE's arguments gives the quantizer's own tensors
bit for bit (same pytree, same dequantized values), through create_1x, create_2x and create
for every q_layout, with negative and positive flatten_axis; a 3-D tensor split after its first
dim checks that flatten_axis is the logical split. Bad input raises naming the argument.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from pytree_bits import assert_same_bits

from lowbit.quantize import QuantizeLayout, QuantizerFactory, ScaledTensor2x, ScaledTensorFactory, ScalingMode

MODES = [ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING,
         ScalingMode.MXFP8_1D_SCALING, ScalingMode.FP8_BLOCK_1x128, ScalingMode.FP8_BLOCK_128x128]




def layout_of(t) -> str:
    return t.data_layout


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("shape, flatten_axis", [((96, 160), -1), ((3, 64, 160), 1), ((3, 64, 160), -1)])
def test_rebuilds_the_quantizers_tensors(mode, shape, flatten_axis, rng):
    x = jnp.asarray(rng.standard_normal(shape) * 3, jnp.bfloat16)
    q = QuantizerFactory.create(mode, jnp.float8_e4m3fn)
    both, _ = q.quantize(x, is_rowwise=True, is_colwise=True, flatten_axis=flatten_axis % x.ndim)
    row, col = both.rowwise_tensor, both.colwise_tensor
    layouts = layout_of(row) + layout_of(col)
    assert layouts == ("NT" if mode.colwise_is_transposed else "NN")

    made = ScaledTensorFactory.create_2x(row.data, row.scale_inv, col.data, col.scale_inv, amax=row.amax,
                                         scaling_mode=mode, dq_dtype=jnp.bfloat16, data_layout=layouts,
                                         flatten_axis=flatten_axis)
    assert isinstance(made, ScaledTensor2x) and made.shape == shape
    assert_same_bits(made, both)
    np.testing.assert_array_equal(made.colwise_tensor.dequantize(), col.dequantize())
    kw = dict(amax=row.amax, scaling_mode=mode, dq_dtype=jnp.bfloat16, data_layout=layouts,
              flatten_axis=flatten_axis)
    assert_same_bits(ScaledTensorFactory.create(row.data, row.scale_inv, col.data, col.scale_inv,
                                           q_layout=QuantizeLayout.ROWWISE_COLWISE, **kw), both)
    assert_same_bits(ScaledTensorFactory.create(row.data, row.scale_inv, None, None,
                                           q_layout=QuantizeLayout.ROWWISE, **kw), row)
    kw["data_layout"] = layouts[1] + "N"  # TE's create takes the single copy's layout first
    assert_same_bits(ScaledTensorFactory.create(None, None, col.data, col.scale_inv,
                                           q_layout=QuantizeLayout.COLWISE, **kw), col)
    assert_same_bits(ScaledTensorFactory.create_1x(col.data, col.scale_inv, row.amax, mode, jnp.bfloat16,
                                              is_colwise=True, data_layout=layouts[1],
                                              flatten_axis=flatten_axis), col)


def test_bad_input(rng):
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    mode = ScalingMode.CURRENT_TENSOR_SCALING
    both, _ = QuantizerFactory.create(mode, jnp.float8_e4m3fn).quantize(x, is_rowwise=True, is_colwise=True)
    row, col = both.rowwise_tensor, both.colwise_tensor
    cases = [
        (ValueError, "create_1x: data_layout: lowbit stores a colwise CURRENT_TENSOR_SCALING copy as 'T'",
         lambda: ScaledTensorFactory.create_1x(col.data, col.scale_inv, scaling_mode=mode, is_colwise=True)),
        (NotImplementedError, "create_1x: group_sizes",
         lambda: ScaledTensorFactory.create_1x(row.data, row.scale_inv, scaling_mode=mode,
                                               group_sizes=jnp.array([64]))),
        (NotImplementedError, "create_1x: scaling_mode: NVFP4",
         lambda: ScaledTensorFactory.create_1x(row.data, row.scale_inv, scaling_mode=ScalingMode.NVFP4_1D_SCALING)),
        (NotImplementedError, "create_1x: has_rht_applied",
         lambda: ScaledTensorFactory.create_1x(row.data, row.scale_inv, scaling_mode=mode, has_rht_applied=True)),
        (ValueError, "create_1x: flatten_axis: expected -2 <= flatten_axis < 2",
         lambda: ScaledTensorFactory.create_1x(row.data, row.scale_inv, scaling_mode=mode, flatten_axis=2)),
        (ValueError, "create_1x: flatten_axis: 0 leaves the tensor no rows",
         lambda: ScaledTensorFactory.create_1x(row.data, row.scale_inv, scaling_mode=mode, flatten_axis=0)),
        (TypeError, "create_1x: scaling_mode: expected a lowbit.quantize.ScalingMode",
         lambda: ScaledTensorFactory.create_1x(row.data, row.scale_inv, scaling_mode="current")),
        (ValueError, "create_2x: data_layout: expected two letters",
         lambda: ScaledTensorFactory.create_2x(row.data, row.scale_inv, col.data, col.scale_inv,
                                               scaling_mode=mode, data_layout="N")),
        (ValueError, "create_2x: colwise_data: its logical shape \\(64, 64\\)",
         lambda: ScaledTensorFactory.create_2x(row.data, row.scale_inv, col.data[:64], col.scale_inv,
                                               scaling_mode=mode, data_layout="NT")),
        (TypeError, "create: q_layout: expected a QuantizeLayout",
         lambda: ScaledTensorFactory.create(row.data, row.scale_inv, q_layout="rowwise", scaling_mode=mode)),
    ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match="ScaledTensorFactory." + pattern):
            call()
