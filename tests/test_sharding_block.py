"""Block-scaled FP8 sharded on 8 virtual CPU devices (conftest): the block quantizers and
the block-scaled GEMM keep whole-tile shards sharded (scales sharded with their data) and
give the single-device result; shardings that would split a tile or a padded scale dim
gather instead, with the same result.

dense with Float8BlockScaling on a (dp=2, tp=2) mesh, forward + backward, outputs pinned:
  dp      x, dy (batch@dp), w replicated: the wgrad psum over dp only
  tp_col  w (H, F@tp), dy (.., F@tp): dx's partial sums psum'ed over tp only
  tp_row  x (.., H@tp), w (H@tp, F): y's partial sums psum'ed over tp only
  fsdp    x, dy (batch@dp), w (H@dp, F): the two FP8 weight copies and their two scale
          arrays all-gathered, dw reduce-scattered
H = 1024 so that a shard of the weight holds 4 whole 128-blocks of K (the 128x128 scale
layout pads the K-block count to 4: with fewer per shard, the weight is gathered).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import lowbit
from lowbit.ops.gemm import GemmScaleMode, gemm
from lowbit.ops.quantize_block import quantize_fp8_block, quantize_mxfp8
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import Float8BlockScaling

# The meshes are CPU devices: under a GPU default backend (the suite on CUDA) the single-device
# results they are compared with are computed on the CPU too (conftest's cpu_reference).
pytestmark = pytest.mark.cpu_reference

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
B, S, H, F = 4, 128, 1024, 512


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU emulation notice
        yield


def mesh22():
    return Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("dp", "tp"))


def collectives(text: str) -> dict[str, int]:
    return {c: len(re.findall(rf"\s{c}(?:-start)?\(", text)) for c in COLLECTIVES}


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


LAYOUTS = {  # x, w, y specs; expected (all-gather, all-reduce, reduce-scatter)
    "dp": (P("dp"), P(), P("dp"), (0, 1, 0)),
    "tp_col": (P(), P(None, "tp"), P(None, None, "tp"), (0, 1, 0)),
    "tp_row": (P(None, None, "tp"), P("tp", None), P(), (0, 1, 0)),
    "fsdp": (P("dp"), P("dp", None), P("dp"), (4, 0, 1)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_dense_float8_block_sharded_equals_single_device(layout, rng):
    x = jnp.asarray(rng.standard_normal((B, S, H)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((H, F)) / np.sqrt(H), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((B, S, F)), jnp.bfloat16)
    qs = QuantizerFactory.create_set(Float8BlockScaling())

    def step(w, x, dy):
        y, vjp = jax.vjp(lambda w, x: lowbit.dense(x, w, contracting_dims=((2,), (0,)), quantizer_set=qs), w, x)
        return y, vjp(dy)

    ref = jax.jit(step)(w, x, dy)
    x_spec, w_spec, y_spec, (ag, ar, rs) = LAYOUTS[layout]
    mesh = mesh22()
    ns = lambda s: NamedSharding(mesh, s)  # noqa: E731
    f = jax.jit(step, out_shardings=(ns(y_spec), (ns(w_spec), ns(x_spec))))
    args = (jax.device_put(w, ns(w_spec)), jax.device_put(x, ns(x_spec)), jax.device_put(dy, ns(y_spec)))
    got = f(*args)
    # Same quantized operands; only the fp32 summation order (per-shard partial sums) differs.
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        r = np.asarray(r, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), r, rtol=1e-2, atol=1e-2 * np.abs(r).max())
    counts = collectives(f.lower(*args).compile().as_text())
    assert (counts["all-gather"], counts["all-reduce"], counts["reduce-scatter"]) == (ag, ar, rs), counts
    assert counts["all-to-all"] == counts["collective-permute"] == 0, counts


QUANTIZE_CASES = [  # (kind, tile_2d, x shape, flatten_axis, spec, stays sharded)
    ("fp8_block", False, (4, 128, 256), 2, P("dp"), True),
    ("fp8_block", False, (256, 512), 1, P(None, "tp"), True),
    ("fp8_block", True, (1024, 512), 1, P("dp", "tp"), True),
    ("fp8_block", True, (256, 512), 1, P("dp", None), False),   # 1 K-block per shard: padded to 4
    ("fp8_block", False, (4, 96, 256), 2, P("dp"), False),      # 192 rows per shard: split tile
    ("mxfp8", False, (512, 256), 1, P("dp", "tp"), True),
    ("mxfp8", False, (2, 100, 64), 2, P("dp"), False),          # padded 128-row scale tiles
]


@pytest.mark.parametrize("case", QUANTIZE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[4]}")
def test_block_quantize_sharded_bit_exact(case, rng):
    kind, tile_2d, shape, f, spec, sharded = case
    x = jnp.asarray(rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape)), jnp.float32)
    x = x.at[0, 0].set(0.0)
    if kind == "mxfp8":
        fn = lambda x: tuple(quantize_mxfp8(x, rowwise=True, colwise=True, flatten_axis=f,  # noqa: E731
                                            compute_dbias=True))
    else:
        fn = lambda x: tuple(quantize_fp8_block(x, tile_2d=tile_2d, rowwise=True, colwise=True,  # noqa: E731
                                                flatten_axis=f, compute_dbias=True))
    want = jax.jit(fn)(x)
    xs = jax.device_put(x, NamedSharding(mesh22(), spec))
    got = jax.jit(fn)(xs)
    for g, w in zip(got[:4], want[:4]):
        np.testing.assert_array_equal(bits(g), bits(w))
    # dbias (shape[f:]): rows sharded -> the shards' fp32 sums psum'ed (another fp32 order).
    assert got[4].shape == want[4].shape == x.shape[f:]
    x2 = np.asarray(x, np.float64).reshape(int(np.prod(shape[:f])), -1)
    bound = x2.shape[0] * 2.0**-23 * np.abs(x2).sum(0) + 1e-30
    np.testing.assert_array_less(np.abs(np.asarray(got[4], np.float64).reshape(-1) - x2.sum(0)), bound)
    text = jax.jit(fn).lower(xs).compile().as_text()
    n_gather = collectives(text)["all-gather"]
    assert (n_gather == 0) if sharded else (n_gather >= 1), text.count("all-gather")
    assert all(not g.sharding.is_fully_replicated for g in got[:4]) == sharded


def _block_operands(rng, rows, k, mode):
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    if mode == GemmScaleMode.MXFP8:
        q = quantize_mxfp8(x)
    else:
        q = quantize_fp8_block(x, tile_2d=mode == GemmScaleMode.BLOCK_128x128)
    return q.rowwise, q.rowwise_scale


GEMM_CASES = [  # a mode, b mode, M, N, K, a spec, b spec, expected (all-gather, all-reduce)
    ("1x128", "128x128", 256, 256, 1024, P("dp", "tp"), P(None, "tp"), (0, 1)),  # K@tp: psum
    ("128x128", "1x128", 256, 256, 512, P("dp", None), P("tp", None), (0, 0)),   # M@dp, N@tp
    ("mxfp8", "mxfp8", 256, 256, 512, P("tp", "dp"), P(None, "dp"), (0, 1)),
    ("1x128", "1x128", 256, 256, 384, P(None, "dp"), P(None, "dp"), (2, 0)),     # 192 K per shard
]


@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[5]}-{c[6]}")
def test_block_gemm_sharded_equals_single_device(case, rng):
    names = {"1x128": GemmScaleMode.BLOCK_1x128, "128x128": GemmScaleMode.BLOCK_128x128,
             "mxfp8": GemmScaleMode.MXFP8}
    am, bm, m, n, k, a_spec, b_spec, (ag, ar) = case
    am, bm = names[am], names[bm]
    a, sa = _block_operands(rng, m, k, am)
    b, sb = _block_operands(rng, n, k, bm)
    bias = jnp.asarray(rng.standard_normal(n), jnp.float32)
    fn = jax.jit(lambda a, b, sa, sb, bias: gemm(a, b, sa, sb, bias, out_dtype=jnp.float32,
                                                 a_scale_mode=am, b_scale_mode=bm))
    want = fn(a, b, sa, sb, bias)
    mesh = mesh22()
    ns = lambda s: NamedSharding(mesh, s)  # noqa: E731
    args = (jax.device_put(a, ns(a_spec)), jax.device_put(b, ns(b_spec)), sa, sb, bias)
    got = fn(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    counts = collectives(fn.lower(*args).compile().as_text())
    assert (counts["all-gather"], counts["all-reduce"]) == (ag, ar), counts
