"""Pieces every op's custom_partitioning rule uses: a sharding's spec padded to the rank,
the mesh axes a spec (or part of it) shards over, the cross-shard max of an amax, and the
block scale layouts' sharding helpers (which shards keep whole tiles, Shardy factors tying
scale dims to their data)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def named_shardings(partition):
    """A custom_partitioning `partition` callback that sees NamedShardings over a concrete mesh.

    JAX hands the callback the legacy context mesh (`with mesh:`); under `jax.set_mesh`, JAX's
    current API, that one is empty and the operands' shardings arrive as GSPMDShardings. Then
    the mesh set by jax.set_mesh (jax.sharding.get_mesh(), current while the program compiles)
    stands in, and each operand's and result's sharding is read back as a PartitionSpec over
    it (JAX's own conversion, which custom_partitioning applies when it has a mesh). Without
    any mesh the shardings pass through: replicated ones read as (), others are an error
    (partition_spec)."""
    def to_named(shape, mesh):
        sharding = getattr(shape, "sharding", None)
        if sharding is None or isinstance(sharding, jax.sharding.NamedSharding):
            return shape
        from jax._src.sharding_impls import parse_flatten_op_sharding

        spec = parse_flatten_op_sharding(sharding._to_xla_hlo_sharding(len(shape.shape)), mesh)[0]
        named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=named)

    @functools.wraps(partition)
    def wrapped(*args):
        *static, mesh, arg_shapes, result_shape = args
        if mesh.empty:
            context = jax.sharding.get_mesh()
            if context.empty:
                return partition(*args)
            mesh = context
        is_shape = lambda a: hasattr(a, "shape") and hasattr(a, "dtype")  # noqa: E731
        arg_shapes, result_shape = jax.tree.map(lambda a: to_named(a, mesh), (arg_shapes, result_shape),
                                                is_leaf=is_shape)
        return partition(*static, mesh, arg_shapes, result_shape)

    return wrapped


def partition_spec(sharding) -> tuple:
    """The PartitionSpec entries of an operand's sharding as a partitioning rule receives it:
    a NamedSharding's spec; () for a replicated sharding of another kind (under
    `jax.set_mesh` an unsharded operand arrives as GSPMDSharding({replicated}), which has no
    spec); anything else is an error naming what arrived, not a guess."""
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        return tuple(spec)
    if sharding.is_fully_replicated:
        return ()
    raise NotImplementedError(
        f"lowbit: a lowbit op's partitioning rule got an operand sharding it cannot read: "
        f"{sharding!r} ({type(sharding).__name__}); shard lowbit's inputs with "
        "jax.sharding.NamedSharding (or leave them replicated)")


def spec_entries(sharding, ndim: int) -> tuple:
    """The sharding's PartitionSpec entries, padded with None (or cut) to `ndim`."""
    spec = partition_spec(sharding)
    return (spec + (None,) * (ndim - len(spec)))[:ndim]


def mesh_axes(entries) -> tuple[str, ...]:
    """Every mesh axis named in these PartitionSpec entries, in order."""
    out: list[str] = []
    for e in entries:
        if e is not None:
            out.extend(e if isinstance(e, tuple) else (e,))
    return tuple(out)


def axes_entry(axes: tuple[str, ...]):
    """The PartitionSpec entry that shards a dim over `axes`: None, one name, or the tuple."""
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def pmax_nonnegative(v, axes):
    """Max over mesh `axes` of non-negative floats (amaxes), comparing their bit patterns so
    that NaN beats inf as in the kernels (a float pmax may drop NaN)."""
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    return jax.lax.bitcast_convert_type(jax.lax.pmax(bits, axes), jnp.float32)


# ---------------------------------------------------------------- block scale layouts
#
# A block-scaled operand is viewed as R x C (R: its flattened row dims, C: the flattened
# rest, K for a GEMM operand); each dim of its 2-D scale array counts the tiles along R or
# along C, padded: size = roundup(ceil(extent / tile), pad). Per layout, (group, tile, pad)
# of scale dims 0 and 1 (csrc/gemm/gemm.h, csrc/quantize/quantize_block.h, quantize_mxfp8.h):
ROWS, COLS = 0, 1
SCALE_DIMS = {
    "1x128": ((COLS, 128, 1), (ROWS, 1, 4)),          # (ceil(C/128), roundup(R, 4))
    "128x128": ((ROWS, 128, 1), (COLS, 128, 4)),      # (ceil(R/128), roundup(ceil(C/128), 4))
    "mxfp8": ((ROWS, 1, 128), (COLS, 32, 4)),         # (roundup(R, 128), roundup(ceil(C/32), 4))
    "mxfp8_colwise": ((ROWS, 32, 4), (COLS, 1, 128)),  # (roundup(ceil(R/32), 4), roundup(C, 128))
}


def transposed_layout(layout):
    """The (group, tile, pad) table with R and C swapped (an FP8 block colwise copy is the
    transposed tensor: its rows are x's C)."""
    return tuple((1 - g, t, p) for g, t, p in layout)


def clean_split(extent: int, shards: int, tile: int, pad: int) -> bool:
    """True when `shards` equal slices of a dim of `extent` elements hold whole tiles and
    the tiled scale dim has no padding, so that the shards' scales are the global scale
    dim's equal slices (each shard's own layout then just re-pads them): the one case where
    block scales shard with their data. Otherwise the dim is gathered (exact, not parallel)."""
    if shards <= 1:
        return True
    return extent % shards == 0 and (extent // shards) % tile == 0 and (extent // tile) % pad == 0


def fit_scale(scale, shape):
    """scale zero-padded or cut to `shape` (a shard's slice of a clean scale dim <-> that
    shard's own padded layout; padding entries are 0 in every layout)."""
    cut = tuple(slice(0, min(have, want)) for have, want in zip(scale.shape, shape))
    scale = scale[cut]
    pads = [(0, want - have) for have, want in zip(scale.shape, shape)]
    return jnp.pad(scale, pads) if any(p for _, p in pads) else scale


def tiled_group_rule(name: str, first: int, extent: int, tiles) -> tuple[str, list, dict]:
    """Shardy expressions that tie a group's first data dim (factor `name`, size `first`;
    the group's flattened extent `extent`) to the scale dims that tile it ((tile, pad) each):
    the first dim becomes "(f rest)" and each clean scale dim "(f more)" with a shared major
    factor f, so that propagation shards the scales with their data. Returns (data expr,
    per-tile scale expr or None where not tied, {factor: size} for every factor used)."""
    counts = [extent // t if extent % t == 0 and (extent // t) % p == 0 else 0 for t, p in tiles]
    f = math.gcd(first, *[c for c in counts if c])
    if f <= 1 or not any(counts):
        return name, [None] * len(tiles), {name: first}
    shared = name if f == first else f"{name}_f"
    sizes = {shared: f}
    data = shared
    if f != first:
        data = f"({shared} {name}_r)"
        sizes[f"{name}_r"] = first // f
    exprs = []
    for i, c in enumerate(counts):
        if not c:
            exprs.append(None)
        elif c == f:
            exprs.append(shared)
        else:
            exprs.append(f"({shared} {name}_s{i})")
            sizes[f"{name}_s{i}"] = c // f
    return data, exprs, sizes


def compound_sizes(expressions, sizes: dict) -> dict:
    """The sizes Shardy must be told: those of factors that appear only inside compounds."""
    whole, inner = set(), set()
    for e in expressions:
        for dim in e.replace("(", " ( ").replace(")", " ) ").split(","):
            depth = 0
            for tok in dim.split():
                if tok == "(":
                    depth += 1
                elif tok == ")":
                    depth -= 1
                elif tok != "->":
                    (inner if depth else whole).add(tok)
    return {f: sizes[f] for f in inner - whole}
