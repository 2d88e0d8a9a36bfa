"""NVFP4's RHT in lowbit.dense: x's and dy's colwise copies (the wgrad's operands) carry ONE
sign vector per GEMM call, so the wgrad multiplies their stored values through nvfp4_gemm.

The RHT T = D H D / 4 runs along the wgrad's contraction dim (tokens) in 16-blocks; with one
D for both copies T^T T = I, and the product of the transformed copies is x^T dy up to their
quantization. Checked here: (a) the two operands' sign vectors are the same (derived as
documented: rht_sign_bits(fold_in(fold_in(key, RHT_KEY_TAG), 0))) and change with the key,
in dense, layernorm_dense and layernorm_mlp, hand-built sets included; (b) the wgrad equals a
numpy reference of the stored values (bit for bit where nvfp4_gemm is the jnp emulation, within
fp32 summation on the C++ handler) and the emulated product of the un-transformed copies within
fp32 rounding; with different signs it would not (a control); (c) its error against the
unquantized wgrad is that of the former path (different signs, transform undone), over seeds;
(d) the CUDA lowering on 10.0 runs every GEMM on lowbit_gemm_nvfp4, except where a hand-built
set mixes use_rht (one transformed operand: emulated_nvfp4_gemm, the one path left)."""

import dataclasses
import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.interpreters import mlir

from lowbit.dense import RHT_KEY_TAG, dense, with_sr_key
from lowbit.layernorm_dense import layernorm_dense
from lowbit.layernorm_mlp import layernorm_mlp
from lowbit.ops.quantize_nvfp4 import rht_sign_bits
from lowbit.quantize import QuantizerFactory
from lowbit.recipe import NVFP4BlockScaling
from conftest import rel_err, run_on

warnings.filterwarnings("ignore", message="lowbit.ops.gemm: NVFP4")
warnings.filterwarnings("ignore", message="lowbit.ops.gemm: no cuBLASLt NVFP4")

dense_mod = importlib.import_module("lowbit.dense")
gemm_mod = importlib.import_module("lowbit.ops.gemm")
nvfp4_mod = importlib.import_module("lowbit.ops.gemm_nvfp4")
ffi_mod = importlib.import_module("lowbit._ffi")

FULL = NVFP4BlockScaling()
RNE_RHT = NVFP4BlockScaling(disable_stochastic_rounding=True)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def stored(t) -> np.ndarray:
    """A copy's stored (rows, K) values, fp32 (e2m1 * e4m3) * global_scale_inv, not transformed back."""
    data = np.asarray(t.data)
    rows, k = data.shape[0], int(np.prod(dense_mod._nvfp4_dims(t)[1]))
    codes = np.stack([data & 15, data >> 4], axis=-1).reshape(rows, -1)[:, :k]
    scales = np.asarray(t.scale_inv).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[:rows, :-(-k // 16)]
    return E2M1[codes] * np.repeat(scales, 16, axis=1)[:, :k] * np.float32(np.asarray(t.global_scale_inv)[0])


def _wgrad_copies(qs, x, dy):
    """(x colwise, dy colwise) as dense quantizes them: x (M, K), dy (M, N)."""
    xq, _ = qs.x.quantize(x, is_rowwise=True, is_colwise=True, flatten_axis=1)
    dyq, _ = qs.dgrad.quantize(dy, is_rowwise=True, is_colwise=True, flatten_axis=1)
    return xq.colwise_tensor, dyq.colwise_tensor


def _data(seed, m=42, k=48, n=40):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, 3] *= 20  # an outlier feature, what the RHT is for
    dy = rng.standard_normal((m, n)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(dy)


class _Recorder:
    """Records the RHT sign bits of both operands of every NVFP4 GEMM dense runs (eagerly)."""

    def __init__(self, monkeypatch):
        self.pairs, original = [], dense_mod._nvfp4_gemm

        def record(a, b, *args):
            self.pairs.append(tuple(None if t.rht_sign_bits is None else int(np.asarray(t.rht_sign_bits)[0])
                                    for t in (a, b)))
            return original(a, b, *args)

        monkeypatch.setattr(dense_mod, "_nvfp4_gemm", record)

    def wgrads(self):
        return [p for p in self.pairs if p != (None, None)]


def _signs(key):
    return int(np.asarray(rht_sign_bits(jax.random.fold_in(key, 0)))[0])


def _dense_grads(qs, key):
    x, dy = _data(0)
    kern = jnp.asarray(np.random.default_rng(1).standard_normal((48, 40)) / 7, jnp.float32)
    y, vjp = jax.vjp(lambda x, k: dense(x, k, None, ((1,), (0,)), qs, sr_key=key), x, kern)
    return vjp(dy)


def test_dense_wgrad_operands_share_the_calls_sign_vector(monkeypatch):
    rec = _Recorder(monkeypatch)
    qs = QuantizerFactory.create_set(FULL)
    keys = [jax.random.PRNGKey(0), jax.random.PRNGKey(1)]
    for key in keys:
        _dense_grads(qs, key)
    (x0, dy0), (x1, dy1) = rec.wgrads()
    assert x0 == dy0 == _signs(jax.random.fold_in(keys[0], RHT_KEY_TAG))
    assert x1 == dy1 == _signs(jax.random.fold_in(keys[1], RHT_KEY_TAG))
    assert x0 != x1 and x0 != 0 and x1 != 0
    assert len(rec.pairs) == 6 and rec.pairs.count((None, None)) == 4  # fwd and dgrad: no RHT
    # The SR streams stay per quantizer: three different keys, none the sign key.
    bound = with_sr_key(qs, keys[0])
    words = {tuple(np.asarray(q.key).ravel()) for q in bound.quantizers}
    assert len(words) == 3 and tuple(np.asarray(bound.x.rht_key).ravel()) not in words
    assert all(q.rht_key is bound.x.rht_key for q in bound.quantizers)


def test_keyless_and_hand_built_sets_share_signs(monkeypatch):
    rec = _Recorder(monkeypatch)
    plain = QuantizerFactory.create_set(RNE_RHT)  # no SR: runs without a key
    _dense_grads(plain, None)
    assert rec.wgrads() == [(0, 0)]  # signs all +: the plain Hadamard transform
    k1, k2 = jax.random.PRNGKey(5), jax.random.PRNGKey(6)
    assert _signs(k1) != _signs(k2)
    hand = plain._replace(x=plain.x.with_key(k1), dgrad=plain.dgrad.with_key(k2))
    _dense_grads(hand, None)
    assert rec.wgrads()[-1] == (_signs(k1), _signs(k1))  # the x quantizer's rht_key wins
    alone, _ = plain.dgrad.with_key(k2).quantize(_data(0)[1], is_rowwise=False, is_colwise=True)
    assert int(np.asarray(alone.rht_sign_bits)[0]) == _signs(k2)  # a quantizer alone: its own key


def test_layernorm_dense_and_mlp_share_signs_per_gemm(monkeypatch):
    rec = _Recorder(monkeypatch)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 14, 48)), jnp.float32)
    gamma, k = jnp.ones(48), jnp.asarray(rng.standard_normal((48, 40)) / 7, jnp.float32)
    wi, wo = (jnp.asarray(rng.standard_normal(s) / 7, jnp.float32) for s in ((48, 64), (64, 48)))
    key = jax.random.PRNGKey(9)
    qs = QuantizerFactory.create_set(FULL)
    jax.grad(lambda x: jnp.sum(jnp.sin(layernorm_dense(x, k, gamma, norm_type="rmsnorm", quantizer_set=qs, sr_key=key))))(x)
    assert rec.wgrads() == [(_signs(jax.random.fold_in(key, RHT_KEY_TAG)),) * 2]
    rec.pairs.clear()
    sets = (qs, QuantizerFactory.create_set(FULL))
    jax.grad(lambda x: jnp.sum(jnp.sin(layernorm_mlp(x, gamma, None, (wi, wo), norm_type="rmsnorm",
                                                     quantizer_sets=sets, sr_key=key))))(x)
    want = [(_signs(jax.random.fold_in(jax.random.fold_in(key, i), RHT_KEY_TAG)),) * 2 for i in (1, 0)]
    assert rec.wgrads() == want and want[0] != want[1]  # GEMM2's wgrad runs first


@pytest.fixture
def jnp_emulation():
    """gemm_nvfp4_p lowered on the CPU as the CUDA lowering does off 10.x (Hopper)."""
    mlir.register_lowering(nvfp4_mod.gemm_nvfp4_p, nvfp4_mod.nvfp4_emulation_lowering, platform="cpu")
    yield
    mlir.register_lowering(nvfp4_mod.gemm_nvfp4_p, nvfp4_mod._nvfp4_cpu_lowering, platform="cpu")


def _packed_wgrad(x_col, dy_col):
    return np.asarray(jax.jit(lambda a, b: dense_mod._nvfp4_gemm(a, b, None, jnp.float32, 1))(x_col, dy_col))


@pytest.mark.parametrize("m", [42, 64, 7])  # a partial 16-group of tokens (not transformed), none, only one
def test_wgrad_is_the_product_of_the_stored_values(m, cpu, jnp_emulation):
    """Where nvfp4_gemm is the jnp emulation (Hopper's lowering, run on the CPU device here on
    every machine, so both sides take XLA:CPU's dot), the bits of the stored values' fp32 dot."""
    qs = with_sr_key(QuantizerFactory.create_set(FULL), jax.random.PRNGKey(m))
    x_col, dy_col = _wgrad_copies(qs, *_data(m, m=m))
    a, b = stored(x_col), stored(dy_col)
    want = run_on(cpu, lambda a, b: jnp.dot(a, b.T, precision="highest", preferred_element_type=jnp.float32), a, b)
    got = run_on(cpu, lambda a, b: dense_mod._nvfp4_gemm(a, b, None, jnp.float32, 1), x_col, dy_col)
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("m", [42, 64, 7])
def test_wgrad_on_the_cpu_handler_and_against_the_undone_transform(m):
    """The C++ handler's k-order fp32 sums within M * 2^-23 * (|a| |b|^T) of the exact product of
    the stored values (measured: within 0.17x that); the former path (emulated_nvfp4_gemm on
    the copies dequantized with T undone) equals it up to T's fp32 rounding (within 2x the
    bound), because both copies carry one sign vector. A control: dy quantized with another
    sign vector does not (relative error > 0.2)."""
    qs = with_sr_key(QuantizerFactory.create_set(FULL), jax.random.PRNGKey(m))
    x, dy = _data(m, m=m)
    x_col, dy_col = _wgrad_copies(qs, x, dy)
    a, b = stored(x_col).astype(np.float64), stored(dy_col).astype(np.float64)
    exact, bound = a @ b.T, m * 2.0**-23 * (np.abs(a) @ np.abs(b).T)
    got = _packed_wgrad(x_col, dy_col)
    assert np.all(np.abs(got - exact) <= bound)
    undone = np.asarray(nvfp4_mod.emulated_nvfp4_gemm(x_col.dequantize(jnp.float32).T, dy_col.dequantize(jnp.float32).T,
                                                     out_dtype=jnp.float32))
    assert np.all(np.abs(undone - exact) <= 2 * bound)  # measured: within 0.13 * bound
    other = dataclasses.replace(qs.dgrad, rht_key=jax.random.PRNGKey(12345))
    dy_other = other.quantize(dy, is_rowwise=False, is_colwise=True, flatten_axis=1)[0]
    if m >= 16:  # with a transformed group, mismatched signs break the packed product
        assert rel_err(_packed_wgrad(x_col, dy_other), exact) > 0.2


def test_wgrad_error_is_that_of_the_former_path():
    """Relative Frobenius error of the wgrad against x^T dy (fp64; M=160 tokens, an outlier
    feature), RNE and SR, 16 seeds: the shared-sign packed product vs the former path
    (independent sign vectors per copy, each transform undone). Measured: RNE 0.113-0.188,
    mean 0.1364 (former 0.109-0.192, mean 0.1376); SR 0.138-0.250, mean 0.1730 (former
    0.134-0.284, mean 0.1703). Asserted: the mean at most 1.05x the former's, every seed
    below 0.2 (RNE) / 0.3 (SR)."""
    for recipe, tol in ((RNE_RHT, 0.2), (FULL, 0.3)):
        new, old = [], []
        for seed in range(16):
            x, dy = _data(100 + seed, m=160)
            exact = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
            qs = with_sr_key(QuantizerFactory.create_set(recipe), jax.random.PRNGKey(seed))
            new.append(rel_err(_packed_wgrad(*_wgrad_copies(qs, x, dy)), exact))
            apart = qs._replace(x=qs.x.with_key(qs.x.key, jax.random.fold_in(qs.x.key, 0)),
                                dgrad=qs.dgrad.with_key(qs.dgrad.key, jax.random.fold_in(qs.dgrad.key, 0)))
            x_col, dy_col = _wgrad_copies(apart, x, dy)
            assert int(np.asarray(x_col.rht_sign_bits)[0]) != int(np.asarray(dy_col.rht_sign_bits)[0])
            old.append(rel_err(x_col.dequantize(jnp.float32).T @ dy_col.dequantize(jnp.float32), exact))
        assert max(new) < tol and np.mean(new) <= 1.05 * np.mean(old)


def _nvfp4_calls(monkeypatch, loss, *args, capability="10.0"):
    monkeypatch.setattr(gemm_mod, "_cuda_capability", lambda: capability)
    monkeypatch.setattr(ffi_mod, "require_platform", lambda op, platform: None)
    text = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    return len(re.findall(r"custom_call @lowbit_gemm_nvfp4\(", text))


def test_sm100_lowering_of_the_layers(monkeypatch):
    """10.0: every GEMM a lowbit_gemm_nvfp4 call (dense 3, layernorm_dense 3, layernorm_mlp 6);
    9.0: none. A set mixing use_rht keeps its wgrad on emulated_nvfp4_gemm (2 calls)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 21, 48)), jnp.float32)
    gamma, k = jnp.ones(48), jnp.asarray(rng.standard_normal((48, 40)) / 7, jnp.float32)
    wi, wo = (jnp.asarray(rng.standard_normal(s) / 7, jnp.float32) for s in ((48, 64), (64, 48)))
    key, qs = jax.random.PRNGKey(0), QuantizerFactory.create_set(FULL)
    cases = [
        (3, lambda x, k: jnp.sum(dense(x, k, None, ((2,), (0,)), qs, sr_key=key) ** 2), (x, k)),
        (3, lambda x, k: jnp.sum(layernorm_dense(x, k, gamma, norm_type="rmsnorm", quantizer_set=qs, sr_key=key) ** 2), (x, k)),
        (6, lambda x: jnp.sum(layernorm_mlp(x, gamma, None, (wi, wo), norm_type="rmsnorm",
                                            quantizer_sets=(qs, qs), sr_key=key) ** 2), (x,)),
    ]
    for calls, loss, args in cases:
        assert _nvfp4_calls(monkeypatch, loss, *args) == calls
        assert _nvfp4_calls(monkeypatch, loss, *args, capability="9.0") == 0
    mixed = qs._replace(dgrad=dataclasses.replace(qs.dgrad, use_rht=False))
    loss = lambda x, k: jnp.sum(dense(x, k, None, ((2,), (0,)), mixed, sr_key=key) ** 2)  # noqa: E731
    assert _nvfp4_calls(monkeypatch, loss, x, k) == 2


def test_mixed_use_rht_set_still_close_to_unquantized():
    """The one emulated path left (one transformed wgrad operand) gives the right wgrad."""
    x, dy = _data(4)
    kern = jnp.asarray(np.random.default_rng(5).standard_normal((48, 40)) / 7, jnp.float32)
    qs = QuantizerFactory.create_set(RNE_RHT)
    mixed = qs._replace(dgrad=dataclasses.replace(qs.dgrad, use_rht=False))
    _, vjp = jax.vjp(lambda x, k: dense(x, k, None, ((1,), (0,)), mixed), x, kern)
    dw = vjp(dy)[1]
    assert 0 < rel_err(dw, np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)) < 0.2
