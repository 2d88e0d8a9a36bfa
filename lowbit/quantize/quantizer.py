"""Quantizers: immutable pytrees that turn a high-precision tensor into a ScaledTensor.

`quantizer.quantize(x, ...) -> (ScaledTensor, dbias | None)` never changes the quantizer;
`quantizer.update(amax) -> Quantizer` returns the next step's quantizer. State (delayed
scaling's scale and amax history) is made of pytree leaves; the configuration (q_dtype,
layout, margin, ...) is static metadata. A training step therefore reads

    tensor, _ = q.quantize(x, is_colwise=True)
    q = q.update(tensor.amax)          # delayed: the scale for the next step

and carries `q` through jit, lax.scan or a Flax variable collection.

Tensor scaling calls `lowbit.ops.quantize.quantize_fp8` (one fused pass: cast, the
transposed colwise copy, amax, optionally dbias):
  - DelayedScaleQuantizer casts with its stored scale (made from earlier steps' amaxes);
  - CurrentScaleQuantizer needs this tensor's amax before the cast. It runs two kernels
    on the device, with no host round trip: amax = lowbit.ops.amax(x), then
    (scale, scale_inv) = delayed.compute_scale_and_inverse(amax) (lowbit's scale op), then
    quantize_fp8(x, scale).
`scale_inv = 1 / scale`, correctly rounded by lowbit's scale ops (lowbit/ops/scale.py), not
by XLA's division, so that the CPU and CUDA backends agree bit for bit.
BlockScaleQuantizer (MXFP8, FP8 block 1x128 / 128x128) calls lowbit.ops.quantize_block
(one pass per tensor: the requested copies and their per-block scales). NVFP4Quantizer calls
lowbit.ops.quantize_nvfp4 (the C++ reference on the CPU, CUDA kernels on the GPU).

Gradients: quantization is piecewise constant, so its derivative is zero almost
everywhere, and that is what `jax.grad` sees: x and the scale enter the kernels through
`lax.stop_gradient`. A straight-through estimator is not offered here because JAX's
cotangent of an fp8 array is itself fp8 (it would quantize the gradient). The gradients of
quantized computations are defined by the custom_vjp functions (dense, layernorm_dense,
...) that own the forward and backward dataflow; lowbit.activation and lowbit.layernorm with a
quantizer return the dequantized values in x's dtype and pass the gradient straight through
(as TE's do), their quantizer getting `no_gradient`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops.amax import amax, check_high_precision
from lowbit.ops.quantize import quantize_fp8
from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8
from lowbit.ops.scale import check_margin
from lowbit.quantize.delayed import (
    compute_scale_and_inverse,
    scale_inverse,
    update_delayed_scaling,
)
from lowbit.quantize.scaling_modes import QuantizeLayout, ScalingMode
from lowbit.quantize.tensor import NVFP4Tensor1x, ScaledTensor, ScaledTensor1x, ScaledTensor2x
from lowbit.recipe import AMAX_COMPUTE_ALGOS

__all__ = [
    "Quantizer",
    "DelayedScaleQuantizer",
    "CurrentScaleQuantizer",
    "BlockScaleQuantizer",
    "NVFP4Quantizer",
    "GemmAccumulation",
    "QuantizerSet",
    "noop_quantizer_set",
    "check_quantizer",
    "no_gradient",
    "KERNELS_PENDING",
]

KERNELS_PENDING = "{mode} quantization kernels land with issue Quantization II"


def check_quantizer(op: str, quantizer) -> None:
    """TypeError naming `op` unless `quantizer` is one of lowbit's quantizers."""
    if not isinstance(quantizer, Quantizer):
        raise TypeError(f"{op}: quantizer: expected a lowbit.quantize Quantizer, got "
                        f"{type(quantizer).__name__}")


def no_gradient(tree):
    """A zero cotangent for a quantizer (or any pytree) passed to a custom_vjp function: zeros
    for its float leaves, float0 zeros for the others (PRNG keys, integers)."""
    def zero(a):
        a = jnp.asarray(a)
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.zeros_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)

    return jax.tree.map(zero, tree)


def _normalize_flatten_axis(op: str, x: jax.Array, flatten_axis: int) -> int:
    axis = flatten_axis + x.ndim if flatten_axis < 0 else flatten_axis
    if x.ndim == 0 or not 0 <= axis < x.ndim:
        raise ValueError(f"{op}: flatten_axis: expected an axis of x {x.shape}, got {flatten_axis}")
    return axis


def row_sums(x, axis: int, dtype=None):
    """The fp32 sums of x over its rows x.shape[:axis] (axis >= 0), in `dtype` (x's by
    default): a bias gradient where no kernel computes it."""
    return jnp.sum(x.astype(jnp.float32), axis=tuple(range(axis))).astype(dtype or x.dtype)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Quantizer:
    """Base class: q_dtype is the quantized dtype, q_layout the copies the recipe wants
    (callers read `q_layout.has_colwise`; `quantize` makes the copies it is asked for)."""

    q_dtype: np.dtype
    q_layout: QuantizeLayout = QuantizeLayout.ROWWISE_COLWISE

    def __post_init__(self):
        # Runs on pytree unflattening too, so it may touch static fields only.
        object.__setattr__(self, "q_dtype", jnp.dtype(self.q_dtype))
        allowed = [jnp.dtype(d) for d in self.scaling_mode.data_dtypes]
        if self.q_dtype not in allowed:
            raise ValueError(
                f"{type(self).__name__}: q_dtype: expected one of "
                f"{[d.name for d in allowed]} for {self.scaling_mode.name}, got {self.q_dtype}"
            )

    @property
    def scaling_mode(self) -> ScalingMode:
        raise NotImplementedError

    def is_2x2x(self) -> bool:
        return self.q_layout == QuantizeLayout.ROWWISE_COLWISE

    def get_scale_dtype(self):
        """TE's query: the dtype of this quantizer's scale arrays, scaling_mode.get_scale_dtype()."""
        return self.scaling_mode.get_scale_dtype()

    def get_scale_shapes(self, data_shape, is_padded=True, flatten_axis=-1, **kwargs):
        """TE's query: (rowwise, colwise) scale shapes of data_shape,
        scaling_mode.get_scale_shape_2x(data_shape, is_padded, flatten_axis). As in TE both
        are given whatever q_layout is, NVFP4_2D's as 16x16 tiles (not the 1x16 rows its scale
        arrays hold) and other keywords (a grouped quantizer's group_sizes) are ignored; how
        lowbit's own scale arrays relate to these shapes is in lowbit/quantize/scale_shapes.py."""
        del kwargs
        return self.scaling_mode.get_scale_shape_2x(data_shape, is_padded, flatten_axis)

    def update(self, new_amax) -> Quantizer:
        """The quantizer for the next step; stateless quantizers return themselves."""
        del new_amax
        return self

    def _checked_input(self, x, is_rowwise: bool, is_colwise: bool, flatten_axis: int, dq_dtype):
        """The checks every quantize starts with: (op name for messages, x as an array with
        its gradient stopped, flatten_axis normalized, the dequantized dtype)."""
        op = f"{type(self).__name__}.quantize"
        x = jnp.asarray(x)
        check_high_precision(op, "x", x)
        axis = _normalize_flatten_axis(op, x, flatten_axis)
        QuantizeLayout.of(is_rowwise, is_colwise)
        dq_dtype = jnp.dtype(x.dtype if dq_dtype is None else dq_dtype)
        check_high_precision(op, "dq_dtype", dq_dtype)
        return op, jax.lax.stop_gradient(x), axis, dq_dtype

    def quantize(
        self,
        x,
        *,
        is_rowwise: bool = True,
        is_colwise: bool = False,
        flatten_axis: int = -1,
        dq_dtype=None,
        compute_dbias: bool = False,
    ) -> tuple[ScaledTensor, jax.Array | None]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class _TensorScaleQuantizer(Quantizer):
    """Shared cast path of the two per-tensor fp32-scale quantizers."""

    def _scale(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(scale, scale_inv) for casting x."""
        raise NotImplementedError

    def scale_and_inverse(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(scale, scale_inv), each f32 (1,), that `quantize` casts x with (gradient stopped);
        lowbit.dense's fused backward quantizes dy with them."""
        scale, scale_inv = jax.lax.stop_gradient(self._scale(x))
        return scale.reshape(1), scale_inv.reshape(1)

    @property
    def fp8_max(self) -> float:
        return float(jnp.finfo(self.q_dtype).max)

    def quantize(
        self,
        x,
        *,
        is_rowwise: bool = True,
        is_colwise: bool = False,
        flatten_axis: int = -1,
        dq_dtype=None,
        compute_dbias: bool = False,
    ) -> tuple[ScaledTensor, jax.Array | None]:
        """Returns (ScaledTensor1x, or ScaledTensor2x when both copies are asked for; dbias,
        the sums of x over its rows, or None)."""
        _, x, axis, dq_dtype = self._checked_input(x, is_rowwise, is_colwise, flatten_axis, dq_dtype)
        scale, scale_inv = self.scale_and_inverse(x)
        out = quantize_fp8(
            x,
            scale,
            out_dtype=self.q_dtype,
            rowwise=is_rowwise,
            colwise=is_colwise,
            flatten_axis=axis,
            compute_dbias=compute_dbias,
        )
        x_amax = jnp.asarray(out.amax, jnp.float32).reshape(1)

        def copy(data, colwise: bool) -> ScaledTensor1x:
            return ScaledTensor1x(
                data=data,
                scale_inv=scale_inv,
                amax=x_amax,
                scaling_mode=self.scaling_mode,
                dq_dtype=dq_dtype,
                is_colwise=colwise,
                flatten_axis=axis,
            )

        if is_rowwise and is_colwise:
            tensor = ScaledTensor2x(copy(out.rowwise, False), copy(out.colwise, True))
        elif is_colwise:
            tensor = copy(out.colwise, True)
        else:
            tensor = copy(out.rowwise, False)
        return tensor, (out.dbias if compute_dbias else None)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class DelayedScaleQuantizer(_TensorScaleQuantizer):
    """Casts with `scale` (1,), made by `update` from the amax history (L,)."""

    margin: int = 0
    amax_compute_algo: str = "max"
    scale: jax.Array = dataclasses.field(default_factory=lambda: jnp.ones((1,), jnp.float32))
    amax_history: jax.Array = dataclasses.field(
        default_factory=lambda: jnp.zeros((1024,), jnp.float32)
    )

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "margin", check_margin("DelayedScaleQuantizer", self.margin))
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"DelayedScaleQuantizer: amax_compute_algo: expected one of {AMAX_COMPUTE_ALGOS}, "
                f"got {self.amax_compute_algo!r}"
            )

    @classmethod
    def create(
        cls,
        q_dtype,
        *,
        amax_history_len: int = 1024,
        margin: int = 0,
        amax_compute_algo: str = "max",
        q_layout: QuantizeLayout = QuantizeLayout.ROWWISE_COLWISE,
    ) -> DelayedScaleQuantizer:
        """A fresh quantizer: scale 1, a zero history of length amax_history_len."""
        return cls(
            q_dtype=q_dtype,
            q_layout=q_layout,
            margin=margin,
            amax_compute_algo=amax_compute_algo,
            scale=jnp.ones((1,), jnp.float32),
            amax_history=jnp.zeros((amax_history_len,), jnp.float32),
        )

    @property
    def scaling_mode(self) -> ScalingMode:
        return ScalingMode.DELAYED_TENSOR_SCALING

    def _scale(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.scale, scale_inverse(self.scale)

    def update(self, new_amax) -> DelayedScaleQuantizer:
        """Records `new_amax` (this step's globally reduced max|x|) and makes the next scale."""
        history, scale = update_delayed_scaling(
            self.amax_history,
            self.scale,
            new_amax,
            fp8_max=self.fp8_max,
            margin=self.margin,
            amax_compute_algo=self.amax_compute_algo,
        )
        return dataclasses.replace(self, scale=scale.reshape(1), amax_history=history)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class CurrentScaleQuantizer(_TensorScaleQuantizer):
    """Stateless: the scale comes from the tensor's own amax (`delayed.compute_scale_and_inverse`)."""

    use_power_2_scales: bool = False

    @property
    def scaling_mode(self) -> ScalingMode:
        return ScalingMode.CURRENT_TENSOR_SCALING

    def _scale(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return compute_scale_and_inverse(
            amax(x), fp8_max=self.fp8_max, use_power_2_scales=self.use_power_2_scales
        )


_BLOCK_MODES = (ScalingMode.MXFP8_1D_SCALING, ScalingMode.FP8_BLOCK_1x128, ScalingMode.FP8_BLOCK_128x128)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class BlockScaleQuantizer(Quantizer):
    """MXFP8 (32-value blocks, E8M0 scales) and FP8 block scaling (1x128 or 128x128 tiles,
    fp32 scales, optionally powers of two). Stateless: every block's scale comes from its
    own amax, inside lowbit.ops.quantize_block's one-pass kernels. The ScaledTensors carry
    the 2-D GEMM-ready scale arrays as scale_inv and no amax."""

    mode: ScalingMode = ScalingMode.MXFP8_1D_SCALING
    use_power_2_scales: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in _BLOCK_MODES:
            raise ValueError(f"BlockScaleQuantizer: mode: expected one of {[m.name for m in _BLOCK_MODES]}, "
                             f"got {self.mode}")

    @property
    def scaling_mode(self) -> ScalingMode:
        return self.mode

    def quantize(
        self,
        x,
        *,
        is_rowwise: bool = True,
        is_colwise: bool = False,
        flatten_axis: int = -1,
        dq_dtype=None,
        compute_dbias: bool = False,
    ) -> tuple[ScaledTensor, jax.Array | None]:
        """Returns (ScaledTensor1x, or ScaledTensor2x for both copies; dbias, the sums of x
        over its rows, or None). dbias comes out of the quantize kernel's pass over x (fp32
        sums in the fixed per-tile order of csrc/quantize/block_dbias.h, rounded once to x's
        dtype): it differs from jnp.sum(x.astype(f32), rows) only by fp32 summation order,
        deterministic and the same bits on CPU and CUDA."""
        _, x, axis, dq_dtype = self._checked_input(x, is_rowwise, is_colwise, flatten_axis, dq_dtype)
        if self.mode == ScalingMode.MXFP8_1D_SCALING:
            out = quantize_mxfp8(x, out_dtype=self.q_dtype, rowwise=is_rowwise, colwise=is_colwise,
                                 flatten_axis=axis, compute_dbias=compute_dbias)
        else:
            out = quantize_fp8_block(x, out_dtype=self.q_dtype,
                                     tile_2d=self.mode == ScalingMode.FP8_BLOCK_128x128,
                                     pow2_scales=self.use_power_2_scales, rowwise=is_rowwise,
                                     colwise=is_colwise, flatten_axis=axis, compute_dbias=compute_dbias)

        def copy(data, scale, colwise: bool) -> ScaledTensor1x:
            return ScaledTensor1x(data=data, scale_inv=scale, amax=None, scaling_mode=self.mode,
                                  dq_dtype=dq_dtype, is_colwise=colwise, flatten_axis=axis)

        if is_rowwise and is_colwise:
            tensor = ScaledTensor2x(copy(out.rowwise, out.rowwise_scale, False),
                                    copy(out.colwise, out.colwise_scale, True))
        elif is_colwise:
            tensor = copy(out.colwise, out.colwise_scale, True)
        else:
            tensor = copy(out.rowwise, out.rowwise_scale, False)
        return tensor, (out.dbias if compute_dbias else None)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 (lowbit.ops.quantize_nvfp4): 16-value blocks (or 16x16 tiles for weights) with
    E4M3 scales under a per-copy fp32 global scale; stochastic rounding and the RHT of the
    colwise copy as configured. Stateless: every scale comes from the tensor itself; the
    ScaledTensors carry no amax.

    Two PRNG key leaves (or None): `key` feeds the SR words, sr_random_bits(fold_in(key, 1))
    (SR without a key is an error); `rht_key` the RHT sign vector,
    rht_sign_bits(fold_in(rht_key, 0)) (signs all + without one: a plain Hadamard transform).
    `with_key(key)` sets both to `key` (a quantizer on its own: signs from fold_in(key, 0), SR
    words from fold_in(key, 1)); `with_key(key, rht_key=r)` keeps them apart. lowbit.dense
    (with_sr_key) gives the x, kernel and dgrad quantizers of one GEMM their own SR keys and
    ONE rht_key, so that the wgrad's two RHT copies (x's and dy's colwise) carry the same
    sign vector and their stored values multiply to the wanted product."""

    q_dtype: np.dtype = jnp.float4_e2m1fn
    mode: ScalingMode = ScalingMode.NVFP4_1D_SCALING
    stochastic_rounding: bool = False
    use_rht: bool = False
    key: jax.Array | None = None
    rht_key: jax.Array | None = None

    @property
    def scaling_mode(self) -> ScalingMode:
        return self.mode

    def with_key(self, key, rht_key=None) -> NVFP4Quantizer:
        """The quantizer with SR key `key` and RHT sign key `rht_key` (`key` when None)."""
        return dataclasses.replace(self, key=key, rht_key=key if rht_key is None else rht_key)

    def rht_signs(self) -> jax.Array:
        """The RHT sign vector of this quantizer's colwise copies, uint32 (1,) (low 16 bits;
        0 = all +, the plain Hadamard transform, without an rht_key)."""
        from lowbit.ops.quantize_nvfp4 import rht_sign_bits

        if self.rht_key is None:
            return jnp.zeros((1,), jnp.uint32)
        return rht_sign_bits(jax.random.fold_in(self.rht_key, 0))

    def quantize(
        self,
        x,
        *,
        is_rowwise: bool = True,
        is_colwise: bool = False,
        flatten_axis: int = -1,
        dq_dtype=None,
        compute_dbias: bool = False,
    ) -> tuple[ScaledTensor, jax.Array | None]:
        """Returns (NVFP4Tensor1x, or ScaledTensor2x of two; dbias or None)."""
        from lowbit.ops.quantize_nvfp4 import quantize_nvfp4, sr_random_bits

        op, x, axis, dq_dtype = self._checked_input(x, is_rowwise, is_colwise, flatten_axis, dq_dtype)
        if self.stochastic_rounding and self.key is None:
            raise ValueError(f"{op}: key: stochastic rounding needs a PRNG key (with_key, the dense "
                             "functions' sr_key, or the Flax RNG stream 'sr_rng')")
        random = sr_random_bits(jax.random.fold_in(self.key, 1), x.shape) if self.stochastic_rounding else None
        signs = self.rht_signs() if self.use_rht and is_colwise else None
        out = quantize_nvfp4(x, random=random, rht_sign_bits=signs,
                             tile_2d=self.mode == ScalingMode.NVFP4_2D_SCALING,
                             rowwise=is_rowwise, colwise=is_colwise, flatten_axis=axis)

        def copy(data, scale, global_scale_inv, colwise: bool) -> NVFP4Tensor1x:
            return NVFP4Tensor1x(data=data, scale_inv=scale, amax=None, scaling_mode=self.mode,
                                 dq_dtype=dq_dtype, is_colwise=colwise, flatten_axis=axis,
                                 global_scale_inv=global_scale_inv,
                                 rht_sign_bits=signs if colwise else None, logical_shape=tuple(x.shape))

        row = copy(out.rowwise, out.rowwise_scale, out.rowwise_global_scale_inv, False) if is_rowwise else None
        col = copy(out.colwise, out.colwise_scale, out.colwise_global_scale_inv, True) if is_colwise else None
        tensor = ScaledTensor2x(row, col) if row is not None and col is not None else (row or col)
        dbias = None
        if compute_dbias:
            dbias = row_sums(x, axis)
        return tensor, dbias


for _cls, _leaves in (
    (DelayedScaleQuantizer, ["scale", "amax_history"]),
    (CurrentScaleQuantizer, []),
    (BlockScaleQuantizer, []),
    (NVFP4Quantizer, ["key", "rht_key"]),
):
    _static = [f.name for f in dataclasses.fields(_cls) if f.name not in _leaves]
    jax.tree_util.register_dataclass(_cls, data_fields=_leaves, meta_fields=_static)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class GemmAccumulation:
    """Split (True) or fast (False) accumulation of a quantized layer's three FP8 GEMMs: the
    forward GEMM, dgrad and wgrad (the recipe's fp8_gemm_* MMParams, lowbit.recipe). Static:
    part of the set's pytree structure, no leaves. It matters to per-tensor FP8 GEMMs on the
    GPU only (lowbit.ops.gemm's use_split_accumulator)."""

    fprop: bool = False
    dgrad: bool = True
    wgrad: bool = True

    def __post_init__(self):
        for field in ("fprop", "dgrad", "wgrad"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"lowbit.quantize.GemmAccumulation: {field}: expected a bool, "
                                 f"got {getattr(self, field)!r}")


class QuantizerSet(NamedTuple):
    """The quantizers of one GEMM: its input x, its kernel and the incoming gradient.
    None entries mean no quantization. `accumulation`: how the layer's GEMMs accumulate
    (rebuild a set with `_replace` so that it carries over)."""

    x: Quantizer | None = None
    kernel: Quantizer | None = None
    dgrad: Quantizer | None = None
    accumulation: GemmAccumulation = GemmAccumulation()

    @property
    def quantizers(self) -> tuple[Quantizer | None, Quantizer | None, Quantizer | None]:
        """(x, kernel, dgrad): the set without its accumulation."""
        return self.x, self.kernel, self.dgrad


noop_quantizer_set = QuantizerSet()
