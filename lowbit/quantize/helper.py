"""autocast, the active recipe, and QuantizerFactory (recipe -> quantizers).

`with lowbit.autocast(enabled=True, recipe=r, mesh_resource=m):` (or TE's older
`lowbit.fp8_autocast(enabled=True, fp8_recipe=r, mesh_resource=m)`) makes `r` the recipe that
`get_global_recipe()` returns and `QuantizerFactory.create_set()` uses. enabled=False (the
default) turns quantization off inside the block whatever `recipe` says; enabled=True with
no recipe means `DelayedScaling()`, as in TE. Blocks nest; the state lives in a
contextvars.ContextVar, so threads do not see each other's blocks.

`mesh_resource` (a `lowbit.sharding.MeshResource`; None keeps the enclosing block's value)
names the mesh axes of each kind of parallelism; `get_global_mesh_resource()` returns it.
`lowbit.sharding.global_shard_guard(resource)` sets it through the same ContextVar
(`mesh_resource_guard` below) without touching the recipe.

The recipe is read when a function is traced: a function jitted outside an autocast block
keeps its traced (unquantized) program inside one. Pass the recipe to functions that jit.

QuantizerSet per recipe (x, kernel, dgrad):
  DelayedScaling        DelayedScaleQuantizer x3 (fwd, fwd, bwd dtype), fresh state
  Float8CurrentScaling  CurrentScaleQuantizer x3
                        (both: accumulation from the recipe's fp8_gemm_* MMParams)
  MXFP8BlockScaling     BlockScaleQuantizer(MXFP8_1D_SCALING) x3
  Float8BlockScaling    BlockScaleQuantizer with the recipe's x / w / grad block modes
  NVFP4BlockScaling     NVFP4Quantizer: 1-D x; 2-D kernel unless disable_2d_quantization;
                        gradients with stochastic rounding; RHT for x and gradients
All quantizers get layout ROWWISE_COLWISE (every operand feeds two GEMMs).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

from lowbit.quantize.quantizer import (
    BlockScaleQuantizer,
    CurrentScaleQuantizer,
    DelayedScaleQuantizer,
    GemmAccumulation,
    NVFP4Quantizer,
    Quantizer,
    QuantizerSet,
)
from lowbit.quantize.scaling_modes import QuantizeLayout, ScalingMode
from lowbit.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

__all__ = [
    "autocast",
    "fp8_autocast",
    "get_global_recipe",
    "get_global_mesh_resource",
    "is_quantization_enabled",
    "mesh_resource_guard",
    "QuantizerFactory",
]


class AutocastState(NamedTuple):
    recipe: Recipe | None
    mesh_resource: Any


_STATE: contextvars.ContextVar[AutocastState] = contextvars.ContextVar(
    "lowbit_autocast", default=AutocastState(recipe=None, mesh_resource=None)
)


@contextlib.contextmanager
def autocast(enabled: bool = False, recipe: Recipe | None = None, mesh_resource: Any = None):
    """Quantize with `recipe` inside the block when `enabled` (see the module docstring)."""
    with _autocast(enabled, recipe, mesh_resource, "lowbit.autocast: recipe"):
        yield


@contextlib.contextmanager
def fp8_autocast(enabled: bool = False, fp8_recipe: Recipe | None = None, mesh_resource: Any = None):
    """TE's older name, with its keyword for the recipe (`fp8_recipe`): the same as autocast."""
    with _autocast(enabled, fp8_recipe, mesh_resource, "lowbit.fp8_autocast: fp8_recipe"):
        yield


@contextlib.contextmanager
def _autocast(enabled: bool, recipe: Recipe | None, mesh_resource: Any, where: str):
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{where}: expected a lowbit.recipe recipe, got {recipe!r}")
    if enabled and recipe is None:
        recipe = DelayedScaling()
    outer = _STATE.get()
    token = _STATE.set(outer._replace(recipe=recipe if enabled else None))
    try:
        if mesh_resource is None:
            yield
        else:
            with mesh_resource_guard(mesh_resource):
                yield
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def mesh_resource_guard(mesh_resource: Any):
    """Makes `mesh_resource` the global one inside the block, keeping the active recipe
    (the mechanism behind autocast(mesh_resource=...) and sharding.global_shard_guard)."""
    token = _STATE.set(_STATE.get()._replace(mesh_resource=mesh_resource))
    try:
        yield
    finally:
        _STATE.reset(token)


def get_global_recipe() -> Recipe | None:
    """The recipe of the innermost enabled autocast block, or None."""
    return _STATE.get().recipe


get_global_quantize_recipe = get_global_recipe  # TE 2.x's name

# TE's names (transformer_engine.jax and .quantize): the collection where lowbit's modules keep
# delayed-scaling state (lowbit's is `_overwrite_with_gradient`, lowbit.flax; code that indexes
# variables by this constant ports), and its dict merge.
NVTE_FP8_COLLECTION_NAME = "_overwrite_with_gradient"


def update_collections(new, original):
    """TE's helper: `original` (a dict or FrozenDict of Flax collections) with the collections
    of `new` put in place of (or beside) its own; the result has original's type."""
    from flax.core.frozen_dict import FrozenDict

    for arg, value in (("new", new), ("original", original)):
        if not isinstance(value, (dict, FrozenDict)):
            raise TypeError(f"lowbit.update_collections: {arg}: expected a dict or FrozenDict, got "
                            f"{type(value).__name__}")
    merged = {**{k: v for k, v in dict(original).items() if k not in new}, **dict(new)}
    return FrozenDict(merged) if isinstance(original, FrozenDict) else merged


def get_global_mesh_resource() -> Any:
    return _STATE.get().mesh_resource


def is_quantization_enabled() -> bool:
    return get_global_recipe() is not None


def _block_mode(block: tuple[int, int]) -> ScalingMode:
    return ScalingMode.FP8_BLOCK_1x128 if block == (1, 128) else ScalingMode.FP8_BLOCK_128x128


def _accumulation(recipe: DelayedScaling | Float8CurrentScaling) -> GemmAccumulation:
    """The set's GemmAccumulation from the recipe's fp8_gemm_* MMParams."""
    return GemmAccumulation(fprop=recipe.fp8_gemm_fprop.use_split_accumulator,
                            dgrad=recipe.fp8_gemm_dgrad.use_split_accumulator,
                            wgrad=recipe.fp8_gemm_wgrad.use_split_accumulator)


def _quantizer_set(recipe: Recipe) -> QuantizerSet:
    layout = QuantizeLayout.ROWWISE_COLWISE
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    if isinstance(recipe, DelayedScaling):

        def delayed(q_dtype):
            return DelayedScaleQuantizer.create(
                q_dtype,
                amax_history_len=recipe.amax_history_len,
                margin=recipe.margin,
                amax_compute_algo=recipe.amax_compute_algo,
                q_layout=layout,
            )

        return QuantizerSet(x=delayed(fwd), kernel=delayed(fwd), dgrad=delayed(bwd),
                            accumulation=_accumulation(recipe))
    if isinstance(recipe, Float8CurrentScaling):

        def current(q_dtype):
            return CurrentScaleQuantizer(
                q_dtype=q_dtype, q_layout=layout, use_power_2_scales=recipe.use_power_2_scales
            )

        return QuantizerSet(x=current(fwd), kernel=current(fwd), dgrad=current(bwd),
                            accumulation=_accumulation(recipe))
    if isinstance(recipe, MXFP8BlockScaling):

        def mxfp8(q_dtype):
            return BlockScaleQuantizer(
                q_dtype=q_dtype, q_layout=layout, mode=ScalingMode.MXFP8_1D_SCALING
            )

        return QuantizerSet(x=mxfp8(fwd), kernel=mxfp8(fwd), dgrad=mxfp8(bwd))
    if isinstance(recipe, Float8BlockScaling):

        def block(q_dtype, tile):
            return BlockScaleQuantizer(
                q_dtype=q_dtype,
                q_layout=layout,
                mode=_block_mode(tile),
                use_power_2_scales=recipe.use_power_2_scales,
            )

        return QuantizerSet(
            x=block(fwd, recipe.x_block),
            kernel=block(fwd, recipe.w_block),
            dgrad=block(bwd, recipe.grad_block),
        )
    if isinstance(recipe, NVFP4BlockScaling):
        use_rht = not recipe.disable_rht
        kernel_mode = (
            ScalingMode.NVFP4_1D_SCALING
            if recipe.disable_2d_quantization
            else ScalingMode.NVFP4_2D_SCALING
        )
        return QuantizerSet(
            x=NVFP4Quantizer(q_layout=layout, use_rht=use_rht),
            kernel=NVFP4Quantizer(q_layout=layout, mode=kernel_mode),
            dgrad=NVFP4Quantizer(
                q_layout=layout,
                use_rht=use_rht,
                stochastic_rounding=not recipe.disable_stochastic_rounding,
            ),
        )
    raise TypeError(f"QuantizerFactory: recipe: unsupported recipe {recipe!r}")


class QuantizerFactory:
    """Makes quantizers from a recipe (or from the active autocast recipe), with TE's
    signatures too: create(n_quantizers, scaling_mode, q_dtype, q_layout, ...) positionally,
    create_set(n_quantizer_sets, scaling_mode, fwd_dtype, bwd_dtype, is_2x2x, ...)."""

    _CREATE_KEYWORDS = ("amax_history_len", "margin", "amax_compute_algo", "use_power_2_scales")

    @staticmethod
    def create(*args, scaling_mode: ScalingMode | None = None, q_dtype=None,
               q_layout: QuantizeLayout | None = None, n_quantizers: int | None = None,
               n_groups: int | None = None, checkpoint_name: str | None = None,
               amax_history_len: int = 1024, margin: int = 0, amax_compute_algo: str = "max",
               use_power_2_scales: bool = False) -> Quantizer | None | tuple:
        """One quantizer for `scaling_mode`; None for NO_SCALING; with n_quantizers > 1 a tuple
        of n equal, independent quantizers. Positional arguments in lowbit's order
        (scaling_mode, q_dtype) or, when the first is an int, TE's (n_quantizers,
        scaling_mode, q_dtype, q_layout, n_groups, checkpoint_name). q_layout defaults to
        ROWWISE_COLWISE. n_groups (grouped quantizers) and checkpoint_name (TE's remat name
        of the quantized copies) other than None are errors naming them."""
        op = "QuantizerFactory.create"
        te_order = bool(args) and isinstance(args[0], int) and not isinstance(args[0], bool)
        names = (("n_quantizers", "scaling_mode", "q_dtype", "q_layout", "n_groups", "checkpoint_name")
                 if te_order else ("scaling_mode", "q_dtype"))
        if len(args) > len(names):
            raise TypeError(f"{op}: takes at most {len(names)} positional arguments ({', '.join(names)}), "
                            f"got {len(args)}")
        given = dict(scaling_mode=scaling_mode, q_dtype=q_dtype, q_layout=q_layout, n_quantizers=n_quantizers,
                     n_groups=n_groups, checkpoint_name=checkpoint_name)
        for name, value in zip(names, args):
            if given[name] is not None:
                raise TypeError(f"{op}: {name}: given both positionally and by keyword")
            given[name] = value
        scaling_mode, q_dtype, q_layout = given["scaling_mode"], given["q_dtype"], given["q_layout"]
        n_quantizers = 1 if given["n_quantizers"] is None else given["n_quantizers"]
        if not isinstance(scaling_mode, ScalingMode):
            raise TypeError(f"{op}: scaling_mode: expected a ScalingMode, got {scaling_mode!r}")
        if given["n_groups"]:
            raise NotImplementedError(f"{op}: n_groups: grouped quantizers land with the grouped GEMM")
        if given["checkpoint_name"] is not None:
            raise ValueError(f"{op}: checkpoint_name: only None (lowbit names its GEMM outputs for "
                             f"remat: lowbit.checkpoint_policies), got {given['checkpoint_name']!r}")
        if q_layout is None:
            q_layout = QuantizeLayout.ROWWISE_COLWISE
        if isinstance(n_quantizers, bool) or not isinstance(n_quantizers, int) or n_quantizers < 1:
            raise ValueError(f"{op}: n_quantizers: expected an int >= 1, got {n_quantizers!r}")
        if n_quantizers > 1:
            one = QuantizerFactory.create(scaling_mode=scaling_mode, q_dtype=q_dtype, q_layout=q_layout,
                                          amax_history_len=amax_history_len, margin=margin,
                                          amax_compute_algo=amax_compute_algo,
                                          use_power_2_scales=use_power_2_scales)
            return (one,) * n_quantizers  # immutable pytrees: sharing one is sharing none
        if scaling_mode == ScalingMode.NO_SCALING:
            return None
        if scaling_mode == ScalingMode.DELAYED_TENSOR_SCALING:
            return DelayedScaleQuantizer.create(
                q_dtype,
                amax_history_len=amax_history_len,
                margin=margin,
                amax_compute_algo=amax_compute_algo,
                q_layout=q_layout,
            )
        if scaling_mode == ScalingMode.CURRENT_TENSOR_SCALING:
            return CurrentScaleQuantizer(
                q_dtype=q_dtype, q_layout=q_layout, use_power_2_scales=use_power_2_scales
            )
        if scaling_mode.is_nvfp4:
            return NVFP4Quantizer(q_dtype=q_dtype, q_layout=q_layout, mode=scaling_mode)
        return BlockScaleQuantizer(
            q_dtype=q_dtype,
            q_layout=q_layout,
            mode=scaling_mode,
            use_power_2_scales=use_power_2_scales,
        )

    @staticmethod
    def create_set(
        recipe: Recipe | int | None = None,
        scaling_mode: ScalingMode | None = None,
        fwd_dtype=None,
        bwd_dtype=None,
        is_2x2x: bool | None = None,
        n_groups: int | None = None,
        checkpoint_name: str | None = None,
        fp8_recipe: Recipe | None = None,
        *,
        n_quantizer_sets: int = 1,
        quantize_meta_set=None,
        **kwargs,
    ) -> QuantizerSet | tuple[QuantizerSet, ...]:
        """The QuantizerSet of `recipe` (TE's keyword `fp8_recipe` works too), else of the
        active autocast recipe; a set of None (no quantization) when there is neither. With
        n_quantizer_sets > 1, a tuple of independent sets. TE's signature works too:
        create_set(n_quantizer_sets, scaling_mode, fwd_dtype, bwd_dtype, is_2x2x, ...) (an int
        first is the count): with a scaling_mode (no recipe) x and the kernel get that mode's
        quantizers of fwd_dtype, the gradient of bwd_dtype, both copies unless is_2x2x is
        False (TE's default: both for FP8 and block modes, on Hopper's TN GEMMs), keyword
        arguments (amax_history_len, margin, amax_compute_algo, use_power_2_scales) going to
        create(). quantize_meta_set (TE's Flax state for a recipe's quantizers) and
        checkpoint_name other than None are errors: lowbit's quantizers carry their state,
        which lowbit.flax binds to module variables."""
        op = "QuantizerFactory.create_set"
        if isinstance(recipe, int) and not isinstance(recipe, bool):
            if n_quantizer_sets != 1:
                raise ValueError(f"{op}: n_quantizer_sets: given twice, as the first argument "
                                 f"({recipe}) and by keyword ({n_quantizer_sets})")
            recipe, n_quantizer_sets = None, recipe
        if recipe is not None and fp8_recipe is not None:
            raise ValueError(f"{op}: pass recipe or fp8_recipe, not both")
        if n_groups is not None:
            raise NotImplementedError(f"{op}: n_groups: grouped quantizers land with the grouped GEMM")
        if checkpoint_name is not None:
            raise ValueError(f"{op}: checkpoint_name: only None (lowbit names its GEMM outputs for "
                             f"remat: lowbit.checkpoint_policies), got {checkpoint_name!r}")
        if quantize_meta_set is not None:
            raise ValueError(f"{op}: quantize_meta_set: only None (lowbit's quantizers carry their "
                             f"own state; lowbit.flax binds it to module variables)")
        unknown = sorted(set(kwargs) - set(QuantizerFactory._CREATE_KEYWORDS))
        if unknown:
            raise TypeError(f"{op}: unexpected keyword {unknown[0]!r}")
        count = n_quantizer_sets
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{op}: n_quantizer_sets: expected an int >= 1, got {count!r}")
        recipe = recipe if recipe is not None else fp8_recipe
        if scaling_mode is not None or fwd_dtype is not None or bwd_dtype is not None:
            if recipe is not None:
                raise ValueError(f"{op}: scaling_mode / fwd_dtype / bwd_dtype: not with a recipe "
                                 f"(the recipe names its modes and dtypes), as in TE")
            return _counted(count, lambda: _mode_set(op, scaling_mode, fwd_dtype, bwd_dtype, is_2x2x, kwargs))
        if kwargs:
            raise TypeError(f"{op}: {sorted(kwargs)[0]}: only with scaling_mode (a recipe has its own)")
        recipe = recipe if recipe is not None else get_global_recipe()
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"{op}: recipe: expected a lowbit.recipe recipe, got {recipe!r}")
        return _counted(count, lambda: QuantizerSet() if recipe is None else _quantizer_set(recipe))


def _counted(count: int, make):
    sets = tuple(make() for _ in range(count))
    return sets[0] if count == 1 else sets


def _mode_set(op, scaling_mode, fwd_dtype, bwd_dtype, is_2x2x, kwargs) -> QuantizerSet:
    """TE's create_set(scaling_mode=, fwd_dtype=, bwd_dtype=, is_2x2x=): one mode for all
    three quantizers."""
    mode = ScalingMode.NO_SCALING if scaling_mode is None else scaling_mode
    if not isinstance(mode, ScalingMode):
        raise TypeError(f"{op}: scaling_mode: expected a ScalingMode, got {scaling_mode!r}")
    if mode == ScalingMode.NO_SCALING:
        return QuantizerSet()
    for name, dtype in (("fwd_dtype", fwd_dtype), ("bwd_dtype", bwd_dtype)):
        if dtype is None:
            raise ValueError(f"{op}: {name}: required with scaling_mode {mode.name}")
    both = True if is_2x2x is None else bool(is_2x2x)
    layout = QuantizeLayout.ROWWISE_COLWISE if both else QuantizeLayout.ROWWISE
    x, kernel, grad = (QuantizerFactory.create(scaling_mode=mode, q_dtype=d, q_layout=layout, **kwargs)
                       for d in (fwd_dtype, fwd_dtype, bwd_dtype))
    return QuantizerSet(x=x, kernel=kernel, dgrad=grad)


# TE's support queries live beside these in its quantize/helper.py (`helper.is_scaling_mode_supported`).
from lowbit.quantize.support import (  # noqa: E402,F401
    get_device_compute_capability,
    get_supported_quantization_recipes,
    get_supported_scaling_modes,
    is_fp8_available,
    is_scaling_mode_supported,
)
