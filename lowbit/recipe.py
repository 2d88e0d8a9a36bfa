"""lowbit.recipe: the quantization recipes, as in TransformerEngine's `common.recipe`.

A recipe is static configuration: a frozen, hashable dataclass that can be a `jit` static
argument or a Flax module field. It says which number formats the forward tensors (x,
kernel) and the gradients use and how their scales are made; `lowbit.quantize` turns a
recipe into quantizers. Every recipe validates its fields on construction and raises
`ValueError` naming the field. Every recipe also takes TE's `fp8_dpa` and `fp8_mha` (False
only: lowbit has no FP8 attention) and DelayedScaling TE's `scaling_factor_compute_algo` (None
only, as on TE's JAX side), MXFP8BlockScaling TE's `margin` (0 only), and Float8BlockScaling
TE's `use_f32_scales` and `x/w/grad_block_scaling_dim`, so that TE code that spells them out
ports unchanged; `Recipe.float8_per_tensor_scaling()` and the current and block recipes'
`fp8_quant_fwd_inp` / `fp8_quant_fwd_weight` / `fp8_quant_bwd_grad` (QParams) read as in TE.

`Format` keeps TE's shape: `Format.HYBRID.value.max_fwd == 448`, `.max_bwd == 57344`; the
dtypes are `Format.HYBRID.fwd_dtype` (float8_e4m3fn) and `.bwd_dtype` (float8_e5m2).

The per-tensor FP8 recipes (DelayedScaling, Float8CurrentScaling) also say how each of a
layer's three GEMMs accumulates, with TE's `MMParams` fields `fp8_gemm_fprop`,
`fp8_gemm_dgrad` and `fp8_gemm_wgrad`: split accumulation (Hopper's FP8 tensor cores promote
their partial sums to fp32 every few K steps, the precise choice) or fast accumulation (fewer
promotions: faster, less precise). The defaults, fast for the forward GEMM and split for the
two backward GEMMs, are TE PyTorch's and Flax FP8's (its backward dots run at
Precision.HIGHEST), and what TE's JAX side declares (its DelayedScaling config sets
FP8_2X_ACC_DGRAD / _WGRAD). TE JAX 2.12 does not act on that: its `gemm` falls back to
FP8_2X_ACC_FPROP (False) for every GEMM its `dense`, `layernorm_dense` and `layernorm_mlp` call
(a TODO in its gemm.py), so it runs all three at fast accumulation; `fp8_gemm_dgrad=
MMParams(False), fp8_gemm_wgrad=MMParams(False)` reproduces that here. They reach the GEMMs
through the quantizer set
(`QuantizerSet.accumulation`); on the CPU the GEMM reference has one accumulation and the
choice changes nothing. Float8BlockScaling takes the same fields but only split (its GEMMs
have no other accumulation); the MXFP8 and NVFP4 recipes do not have them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = [
    "Format",
    "MMParams",
    "QParams",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "AMAX_COMPUTE_ALGOS",
]

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# 2**margin must stay a finite fp32 power of two.
MAX_MARGIN = 127
# Float8BlockScaling's tiles by TE's block_scaling_dim: 1 -> 1x128, 2 -> 128x128.
FP8_BLOCKS = ((1, 128), (128, 128))
_BLOCK_DIM_FIELDS = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")


class FormatMaxima(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """Number formats: forward (x, kernel) and backward (gradients) maxima."""

    E4M3 = FormatMaxima(max_fwd=448.0, max_bwd=448.0)
    E5M2 = FormatMaxima(max_fwd=57344.0, max_bwd=57344.0)
    HYBRID = FormatMaxima(max_fwd=448.0, max_bwd=57344.0)  # E4M3 forward, E5M2 gradients
    E2M1 = FormatMaxima(max_fwd=6.0, max_bwd=6.0)

    @property
    def max_fwd(self) -> float:
        return self.value.max_fwd

    @property
    def max_bwd(self) -> float:
        return self.value.max_bwd

    @property
    def fwd_dtype(self):
        return _FWD_DTYPE[self]

    @property
    def bwd_dtype(self):
        return _BWD_DTYPE[self]


_FWD_DTYPE = {
    Format.E4M3: jnp.float8_e4m3fn,
    Format.E5M2: jnp.float8_e5m2,
    Format.HYBRID: jnp.float8_e4m3fn,
    Format.E2M1: jnp.float4_e2m1fn,
}
_BWD_DTYPE = {
    Format.E4M3: jnp.float8_e4m3fn,
    Format.E5M2: jnp.float8_e5m2,
    Format.HYBRID: jnp.float8_e5m2,
    Format.E2M1: jnp.float4_e2m1fn,
}
# E5M2 has too few mantissa bits for activations and weights; TE rejects it as well.
FP8_TRAINING_FORMATS = (Format.E4M3, Format.HYBRID)


def _fail(recipe: str, field: str, expected: str, got) -> None:
    raise ValueError(f"lowbit.recipe.{recipe}: {field}: expected {expected}, got {got!r}")


def _check_bool(recipe: str, field: str, value) -> None:
    if not isinstance(value, bool):
        _fail(recipe, field, "a bool", value)


def _check_fp8_format(recipe: str, value) -> None:
    if value not in FP8_TRAINING_FORMATS:
        _fail(
            recipe,
            "fp8_format",
            "Format.E4M3 or Format.HYBRID (pure E5M2 is not a forward format)",
            value,
        )


@dataclasses.dataclass(frozen=True)
class MMParams:
    """How one FP8 GEMM accumulates (TE's name): use_split_accumulator=True promotes the
    tensor cores' partial sums to fp32 often (precise), False is Hopper's fast accumulation."""

    use_split_accumulator: bool = True

    def __post_init__(self):
        _check_bool("MMParams", "use_split_accumulator", self.use_split_accumulator)


@dataclasses.dataclass(frozen=True)
class QParams:
    """How a tensor's scale is made (TE's name, read-only here): `power_2_scale` rounds it down
    to a power of two; `amax_epsilon` is a floor on the amax (0: none; lowbit has no other);
    NVFP4's `random_hadamard_transform`, `stochastic_rounding` and `fp4_2d_quantization`.
    Float8CurrentScaling and Float8BlockScaling report theirs as `fp8_quant_fwd_inp`,
    `fp8_quant_fwd_weight` and `fp8_quant_bwd_grad`, NVFP4BlockScaling as `fp4_quant_*`, from
    their own fields."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class _ScaleQParams:
    """TE's per-tensor-kind scale parameters of a recipe with one scale rule for x, the kernel
    and the gradient (its `use_power_2_scales`), read-only."""

    @property
    def fp8_quant_fwd_inp(self) -> QParams:
        return QParams(power_2_scale=self.use_power_2_scales)

    @property
    def fp8_quant_fwd_weight(self) -> QParams:
        return QParams(power_2_scale=self.use_power_2_scales)

    @property
    def fp8_quant_bwd_grad(self) -> QParams:
        return QParams(power_2_scale=self.use_power_2_scales)


# TE's defaults: fast accumulation in the forward GEMM, split in dgrad and wgrad.
_FPROP_DEFAULT = MMParams(use_split_accumulator=False)
_BACKWARD_DEFAULT = MMParams(use_split_accumulator=True)
_MM_FIELDS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


def _check_mm_params(recipe) -> None:
    name = type(recipe).__name__
    for field in _MM_FIELDS:
        if not isinstance(getattr(recipe, field), MMParams):
            _fail(name, field, "a lowbit.recipe.MMParams", getattr(recipe, field))


def _check_attention_fields(recipe) -> None:
    """TE's fp8_dpa / fp8_mha (FP8 in fused attention): accepted so that TE code ports
    unchanged, and False only: lowbit's softmax and attention run in the input's precision."""
    name = type(recipe).__name__
    for field in ("fp8_dpa", "fp8_mha"):
        if getattr(recipe, field) is not False:
            _fail(name, field, "False (lowbit has no FP8 attention: softmax and attention run in the "
                  "input's precision)", getattr(recipe, field))


class Recipe:
    """Base class of the recipes: the dtypes of the forward tensors and of the gradients."""

    fp8_format: Format

    @property
    def fwd_dtype(self):
        """The quantized dtype of x and kernel."""
        return self.fp8_format.fwd_dtype

    @property
    def bwd_dtype(self):
        """The quantized dtype of the gradients."""
        return self.fp8_format.bwd_dtype

    @property
    def is_stateful(self) -> bool:
        """True when quantizers carry state between steps (scales, amax histories)."""
        return False

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def custom(self) -> bool:
        """TE's CustomRecipe test: lowbit has none, so False."""
        return False


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scales from an amax history: step t casts with the scale made at step
    t-1 (`lowbit.quantize.delayed.update_delayed_scaling` has the exact rule).

    margin: the scale is divided by 2**margin. amax_history_len: the history length L.
    amax_compute_algo: "max" over the history or "most_recent". reduce_amax: True (TE's
    default) only: under jit a sharded tensor's amax is always reduced over the mesh axes
    that shard it (one scale per tensor on every device), inside shard_map it is the
    caller's to pmax (lowbit.sharding); False is an error, not a silent no-op.
    fp8_gemm_fprop / fp8_gemm_dgrad / fp8_gemm_wgrad: each GEMM's accumulation (MMParams;
    the module docstring).
    """

    # TE's fields in TE's order (positional calls port), then lowbit's, by keyword only.
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    _: dataclasses.KW_ONLY
    fp8_gemm_fprop: MMParams = _FPROP_DEFAULT
    fp8_gemm_dgrad: MMParams = _BACKWARD_DEFAULT
    fp8_gemm_wgrad: MMParams = _BACKWARD_DEFAULT

    def __post_init__(self):
        name = "DelayedScaling"
        if self.scaling_factor_compute_algo is not None:  # TE's JAX side refuses it too
            _fail(name, "scaling_factor_compute_algo", "None (the scale rule is fixed: "
                  "lowbit.quantize.delayed.update_delayed_scaling)", self.scaling_factor_compute_algo)
        _check_attention_fields(self)
        whole = isinstance(self.margin, (float, np.floating)) and float(self.margin).is_integer()
        if isinstance(self.margin, bool) or not (isinstance(self.margin, (int, np.integer)) or whole):
            _fail(name, "margin", "a whole number (an int, or a float such as TE's 5.0)", self.margin)
        if not 0 <= self.margin <= MAX_MARGIN:
            _fail(name, "margin", f"0 <= margin <= {MAX_MARGIN}", self.margin)
        object.__setattr__(self, "margin", int(self.margin))
        _check_fp8_format(name, self.fp8_format)
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            _fail(name, "amax_history_len", "an int", self.amax_history_len)
        if self.amax_history_len < 1:
            _fail(name, "amax_history_len", ">= 1", self.amax_history_len)
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            _fail(name, "amax_compute_algo", f"one of {AMAX_COMPUTE_ALGOS}", self.amax_compute_algo)
        _check_bool(name, "reduce_amax", self.reduce_amax)
        if not self.reduce_amax:  # lowbit.sharding: the reduction cannot be switched off
            _fail(name, "reduce_amax", "True (under jit a sharded tensor's amax is always reduced "
                  "over the mesh axes that shard it; inside shard_map never: see lowbit.sharding)",
                  self.reduce_amax)
        _check_mm_params(self)

    @property
    def is_stateful(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(_ScaleQParams, Recipe):
    """Per-tensor scales from each tensor's own amax (`scale = max_fp8 / amax`), optionally
    rounded down to a power of two. fp8_gemm_fprop / fp8_gemm_dgrad / fp8_gemm_wgrad: each
    GEMM's accumulation (MMParams; the module docstring)."""

    use_power_2_scales: bool = False  # TE's order: positional calls port
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = _FPROP_DEFAULT
    fp8_gemm_dgrad: MMParams = _BACKWARD_DEFAULT
    fp8_gemm_wgrad: MMParams = _BACKWARD_DEFAULT
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_attention_fields(self)
        _check_fp8_format("Float8CurrentScaling", self.fp8_format)
        _check_bool("Float8CurrentScaling", "use_power_2_scales", self.use_power_2_scales)
        _check_mm_params(self)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: 32-element blocks along the contracting dim with E8M0 (power-of-two) scales.
    `margin`: TE's field, 0 only (the E8M0 scale rule of DESIGN.md section 4 has no margin)."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin != 0:
            _fail("MXFP8BlockScaling", "margin", "0 (the E8M0 block scale is the block amax's "
                  "exponent rounded up; it has no margin)", self.margin)
        _check_fp8_format("MXFP8BlockScaling", self.fp8_format)
        _check_attention_fields(self)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(_ScaleQParams, Recipe):
    """FP8 with fp32 block scales (DeepSeek-V3 style, runs on Hopper), TE's fields and
    defaults: `x_block_scaling_dim`, `w_block_scaling_dim`, `grad_block_scaling_dim` say
    which tiles x, the kernel and the output gradient are scaled in: 1 = 1x128 (one scale per
    128 values along a row, in each copy's own orientation), 2 = 128x128; defaults 1, 2, 1.
    `use_f32_scales`: False (the default) rounds every block scale down to a power of two.
    fp8_gemm_fprop / fp8_gemm_dgrad / fp8_gemm_wgrad: TE's fields, which must say split
    accumulation: block-scaled GEMMs promote every 128-value block (the only accumulation they
    have), so fast accumulation is refused rather than ignored.

    Where TE refuses two 2-D operands in one GEMM (x and w, x and grad, or w and grad both 2),
    lowbit runs that GEMM exactly through its emulation (cuBLASLt has no 128x128 x 128x128
    kernel; a one-time notice says so) and the other two on cuBLASLt. The tile shapes are
    also readable as `x_block`, `w_block`, `grad_block` ((1, 128) or (128, 128)) and the scale
    rule as `use_power_2_scales`."""

    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = _BACKWARD_DEFAULT
    fp8_gemm_dgrad: MMParams = _BACKWARD_DEFAULT
    fp8_gemm_wgrad: MMParams = _BACKWARD_DEFAULT
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        name = "Float8BlockScaling"
        _check_attention_fields(self)
        _check_fp8_format(name, self.fp8_format)
        _check_bool(name, "use_f32_scales", self.use_f32_scales)
        for field in _BLOCK_DIM_FIELDS:
            dim = getattr(self, field)
            if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)) or dim not in (1, 2):
                _fail(name, field, "1 (1x128 blocks) or 2 (128x128 blocks)", dim)
            object.__setattr__(self, field, int(dim))  # a NumPy int hashes and compares as the int
        _check_mm_params(self)
        for field in _MM_FIELDS:
            if not getattr(self, field).use_split_accumulator:
                _fail(name, field, "MMParams(use_split_accumulator=True) (block-scaled GEMMs have "
                      "only the split accumulation)", getattr(self, field))

    @property
    def use_power_2_scales(self) -> bool:
        return not self.use_f32_scales

    @property
    def x_block(self) -> tuple[int, int]:
        return FP8_BLOCKS[self.x_block_scaling_dim - 1]

    @property
    def w_block(self) -> tuple[int, int]:
        return FP8_BLOCKS[self.w_block_scaling_dim - 1]

    @property
    def grad_block(self) -> tuple[int, int]:
        return FP8_BLOCKS[self.grad_block_scaling_dim - 1]


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 data in 16-value blocks with E4M3 block scales under a per-tensor fp32
    scale; 16x16 2-D blocks for weights, stochastic rounding of gradients and a random
    Hadamard transform on the copies that feed wgrad, each of which can be turned off."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: Format = Format.E2M1  # TE's fields, E2M1 and E4M3 (the block scales') only
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_attention_fields(self)
        for field in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _check_bool("NVFP4BlockScaling", field, getattr(self, field))
        if self.fp4_format is not Format.E2M1:
            _fail("NVFP4BlockScaling", "fp4_format", "Format.E2M1 (NVFP4's data)", self.fp4_format)
        if self.fp8_format is not Format.E4M3:
            _fail("NVFP4BlockScaling", "fp8_format", "Format.E4M3 (NVFP4's block scales)", self.fp8_format)

    @property
    def fp4_quant_fwd_inp(self) -> QParams:
        """TE's: x's colwise (wgrad) copy takes the RHT unless disabled."""
        return QParams(random_hadamard_transform=not self.disable_rht)

    @property
    def fp4_quant_fwd_weight(self) -> QParams:
        """TE's: the kernel in 16x16 blocks unless disabled."""
        return QParams(fp4_2d_quantization=not self.disable_2d_quantization)

    @property
    def fp4_quant_bwd_grad(self) -> QParams:
        """TE's: the gradient with the RHT and stochastic rounding unless disabled."""
        return QParams(random_hadamard_transform=not self.disable_rht,
                       stochastic_rounding=not self.disable_stochastic_rounding)

    @property
    def fwd_dtype(self):
        return Format.E2M1.fwd_dtype

    @property
    def bwd_dtype(self):
        return Format.E2M1.bwd_dtype
