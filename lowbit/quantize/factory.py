"""ScaledTensorFactory: TE's constructors of quantized tensors (create_1x, create_2x, create),
building lowbit's ScaledTensor1x / ScaledTensor2x from data and scales made elsewhere (an FP8
checkpoint, a quantizer of the caller's own), so that TE code that builds them ports by its
imports.

The arguments are TE's. `data` / `colwise_data` are stored as lowbit.quantize.tensor documents
them (a tensor-scaling or FP8-block colwise copy transposed, data_layout "T"; an MXFP8 one in
the logical layout, "N"), and `flatten_axis` is the split of the logical tensor (rows
shape[:f], columns shape[f:]; negative counts from the end of data's dims), as TE's callers
pass it. Differences from TE:
- data_layout must be the one lowbit stores for that copy and scaling mode: anything else is a
  ValueError (lowbit's GEMMs take one layout per mode; TE takes "N" copies on Blackwell).
- The ScaledTensor1x keeps the logical split in its `flatten_axis`, where TE's transposed copy
  keeps the split of its stored data (ndim - f).
- amax None stays None (TE stores an empty (1,) array).
- group_sizes (TE's grouped tensors) and NVFP4 (whose copies carry a global scale and the
  logical shape: lowbit's NVFP4 quantizer makes them) are errors naming the argument, as is
  has_rht_applied=True.
"""

from __future__ import annotations

import jax.numpy as jnp

from lowbit.quantize.scaling_modes import QuantizeLayout, ScalingMode
from lowbit.quantize.tensor import ScaledTensor1x, ScaledTensor2x

__all__ = ["ScaledTensorFactory"]

_OP = "ScaledTensorFactory.{}"


def _stored_layout(mode: ScalingMode, is_colwise: bool) -> str:
    return "T" if is_colwise and mode.colwise_is_transposed else "N"


class ScaledTensorFactory:
    """TE's factory of quantized tensors (module docstring)."""

    @staticmethod
    def create_1x(data, scale_inv, amax=None, scaling_mode=ScalingMode.NO_SCALING,
                  dq_dtype=jnp.bfloat16, is_colwise=False, data_layout="N", flatten_axis=-1,
                  group_sizes=None, original_shape=None, group_axis=0, has_rht_applied=False):
        """One copy: a ScaledTensor1x of `data` (stored layout) and its `scale_inv`."""
        op = _OP.format("create_1x")
        del original_shape, group_axis  # TE's grouped-tensor arguments: group_sizes decides
        if group_sizes is not None:
            raise NotImplementedError(f"{op}: group_sizes: lowbit has no grouped tensors (its grouped "
                                      f"quantizers return per-group copies: lowbit.ops.quantize_grouped*)")
        if not isinstance(scaling_mode, ScalingMode):
            raise TypeError(f"{op}: scaling_mode: expected a lowbit.quantize.ScalingMode, got {scaling_mode!r}")
        if scaling_mode.is_nvfp4:
            raise NotImplementedError(f"{op}: scaling_mode: NVFP4 copies carry a global scale and the "
                                      f"logical shape; make them with lowbit's NVFP4 quantizer")
        if has_rht_applied:
            raise NotImplementedError(f"{op}: has_rht_applied: only False (the Hadamard transform is "
                                      f"NVFP4's)")
        is_colwise = bool(is_colwise)
        want = _stored_layout(scaling_mode, is_colwise)
        if data_layout != want:
            raise ValueError(f"{op}: data_layout: lowbit stores a {'colwise' if is_colwise else 'rowwise'} "
                             f"{scaling_mode.name} copy as {want!r}, got {data_layout!r}")
        data = jnp.asarray(data)
        if data.ndim < 1:
            raise ValueError(f"{op}: data: expected an array of at least one dim, got shape {data.shape}")
        if not -data.ndim <= flatten_axis < data.ndim:
            raise ValueError(f"{op}: flatten_axis: expected -{data.ndim} <= flatten_axis < {data.ndim} for "
                             f"data of shape {data.shape}, got {flatten_axis}")
        f = flatten_axis % data.ndim
        if data.ndim > 1 and f == 0:
            raise ValueError(f"{op}: flatten_axis: {flatten_axis} leaves the tensor no rows")
        return ScaledTensor1x(data=data, scale_inv=jnp.asarray(scale_inv), amax=amax,
                              scaling_mode=scaling_mode, dq_dtype=jnp.dtype(dq_dtype),
                              is_colwise=is_colwise, flatten_axis=f)

    @staticmethod
    def create_2x(data, scale_inv, colwise_data, colwise_scale_inv, amax=None, colwise_amax=None,
                  scaling_mode=ScalingMode.NO_SCALING, dq_dtype=jnp.bfloat16, data_layout="NN",
                  flatten_axis=-1, group_sizes=None, original_shape=None, group_axis=0,
                  rowwise_has_rht_applied=False, colwise_has_rht_applied=False):
        """Both copies: a ScaledTensor2x; data_layout names the rowwise then the colwise copy's."""
        op = _OP.format("create_2x")
        if not isinstance(data_layout, str) or len(data_layout) != 2:
            raise ValueError(f"{op}: data_layout: expected two letters (rowwise, colwise), got {data_layout!r}")
        if colwise_amax is None:
            colwise_amax = amax
        rowwise = ScaledTensorFactory.create_1x(
            data, scale_inv, amax, scaling_mode, dq_dtype, False, data_layout[0], flatten_axis,
            group_sizes, original_shape, group_axis, rowwise_has_rht_applied)
        # the colwise copy's flatten_axis is the same logical split, counted on its own dims
        f = flatten_axis % jnp.ndim(data)
        colwise = ScaledTensorFactory.create_1x(
            colwise_data, colwise_scale_inv, colwise_amax, scaling_mode, dq_dtype, True, data_layout[1],
            f, group_sizes, original_shape, group_axis, colwise_has_rht_applied)
        if rowwise.shape != colwise.shape:
            raise ValueError(f"{op}: colwise_data: its logical shape {colwise.shape} (stored "
                             f"{tuple(colwise.data.shape)}) is not the rowwise copy's {rowwise.shape}")
        return ScaledTensor2x(rowwise, colwise)

    @staticmethod
    def create(data, scale_inv, colwise_data=None, colwise_scale_inv=None, amax=None, colwise_amax=None,
               scaling_mode=ScalingMode.NO_SCALING, dq_dtype=jnp.bfloat16, data_layout="NN",
               q_layout=QuantizeLayout.ROWWISE, flatten_axis=-1, group_sizes=None, original_shape=None,
               group_axis=0, rowwise_has_rht_applied=False, colwise_has_rht_applied=False):
        """The copies q_layout names: create_2x for ROWWISE_COLWISE, else create_1x of the
        rowwise (data) or colwise (colwise_data) copy, whose layout is data_layout[0] (TE's)."""
        if not isinstance(q_layout, QuantizeLayout):
            raise TypeError(f"{_OP.format('create')}: q_layout: expected a QuantizeLayout, got {q_layout!r}")
        if q_layout == QuantizeLayout.ROWWISE_COLWISE:
            return ScaledTensorFactory.create_2x(
                data, scale_inv, colwise_data, colwise_scale_inv, amax, colwise_amax, scaling_mode, dq_dtype,
                data_layout, flatten_axis, group_sizes, original_shape, group_axis,
                rowwise_has_rht_applied, colwise_has_rht_applied)
        if q_layout == QuantizeLayout.COLWISE:
            return ScaledTensorFactory.create_1x(
                colwise_data, colwise_scale_inv, colwise_amax if colwise_amax is not None else amax,
                scaling_mode, dq_dtype, True, data_layout[0], flatten_axis, group_sizes, original_shape,
                group_axis, colwise_has_rht_applied)
        return ScaledTensorFactory.create_1x(
            data, scale_inv, amax, scaling_mode, dq_dtype, False, data_layout[0], flatten_axis, group_sizes,
            original_shape, group_axis, rowwise_has_rht_applied)
