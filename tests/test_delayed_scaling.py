"""lowbit.quantize.delayed: the delayed-scaling update and the current-scaling scale
(DESIGN §4) against a few-line numpy model: history roll, "max" vs "most_recent", margin,
amax 0 / inf / NaN, infinite scales clamped to FLT_MAX, power-of-two scales, jit, vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.quantize.delayed import FLT_MAX, compute_scale, update_delayed_scaling
from lowbit.quantize.quantizer import DelayedScaleQuantizer


def update_ref(history, scale, new_amax, fp8_max, margin, algo):
    h = np.array(history, np.float32)
    h[0] = new_amax
    a = h.max() if algo == "max" else h[0]
    with np.errstate(all="ignore"):
        s = np.float32(fp8_max) / np.float32(a) / np.float32(2.0**margin)
    s = np.float32(FLT_MAX) if np.isinf(s) else s
    s = s if (a > 0 and np.isfinite(a)) else np.float32(np.asarray(scale).reshape(()))
    h = np.roll(h, -1)
    h[0] = 0
    return h, np.float32(s)


def run(history, scale, amaxes, *, fp8_max=448.0, margin=0, algo="max"):
    """Runs the update over `amaxes` with jax and with the model; returns jax's scales."""
    step = jax.jit(lambda h, s, a: update_delayed_scaling(
        h, s, a, fp8_max=fp8_max, margin=margin, amax_compute_algo=algo))
    h, s = jnp.asarray(history, jnp.float32), jnp.asarray(scale, jnp.float32)
    h_ref, s_ref = np.asarray(history, np.float32), np.float32(np.asarray(scale).reshape(()))
    scales = []
    for a in amaxes:
        h, s = step(h, s, jnp.float32(a))
        h_ref, s_ref = update_ref(h_ref, s_ref, a, fp8_max, margin, algo)
        np.testing.assert_array_equal(np.asarray(h), h_ref)
        assert s.shape == (1,) and s.dtype == jnp.float32
        assert np.asarray(s)[0].tobytes() == s_ref.tobytes()
        scales.append(float(s[0]))
    return scales, np.asarray(h)


def test_history_rolls_and_max_covers_the_last_L_amaxes():
    amaxes = [1.0, 4.0, 2.0, 0.5, 0.25, 3.0, 0.125]
    scales, history = run(np.zeros(3), [1.0], amaxes)
    window_max = [max(amaxes[max(0, t - 2): t + 1]) for t in range(len(amaxes))]
    assert scales == [float(np.float32(448) / np.float32(m)) for m in window_max]
    # The newest amax sits in h[L-1]; h[0] is the fresh slot the next step writes into.
    np.testing.assert_array_equal(history, [0.0, 3.0, 0.125])


def test_history_of_length_one():
    scales, history = run(np.zeros(1), [1.0], [2.0, 8.0, 1.0])
    assert scales == [224.0, 56.0, 448.0]
    np.testing.assert_array_equal(history, [0.0])


def test_most_recent_ignores_the_history():
    amaxes = [4.0, 1.0, 2.0]
    scales, _ = run(np.zeros(4), [1.0], amaxes, algo="most_recent")
    assert scales == [112.0, 448.0, 224.0]
    scales, _ = run(np.zeros(4), [1.0], amaxes, algo="max")
    assert scales == [112.0, 112.0, 112.0]


@pytest.mark.parametrize("margin", [0, 1, 3, 20])
def test_margin(margin):
    scales, _ = run(np.zeros(2), [1.0], [3.0, 7.0], margin=margin)
    assert scales[0] == float(np.float32(448) / np.float32(3) / np.float32(2**margin))


@pytest.mark.parametrize("bad", [0.0, np.inf, -np.inf, np.nan])
def test_unusable_amax_keeps_the_old_scale(bad):
    scales, _ = run(np.zeros(4), [5.0], [bad], algo="most_recent")
    assert scales == [5.0]
    scales, _ = run(np.zeros(1), [5.0], [bad], algo="max")
    assert scales == [5.0]


def test_nan_in_the_history_holds_the_scale_for_L_steps():
    scales, _ = run(np.zeros(3), [1.0], [2.0, np.nan, 1.0, 1.0, 1.0])
    assert scales == [224.0, 224.0, 224.0, 224.0, 448.0]


def test_infinite_scale_is_clamped_to_flt_max():
    tiny = np.float32(1e-40)  # a denormal: 448 / tiny overflows fp32
    scales, _ = run(np.zeros(2), [1.0], [tiny], algo="most_recent")
    assert scales == [FLT_MAX]
    scales, _ = run(np.zeros(2), [1.0], [tiny], margin=2, algo="most_recent")
    assert scales == [FLT_MAX]


def test_e5m2_maximum():
    scales, _ = run(np.zeros(2), [1.0], [7.0], fp8_max=57344.0)
    assert scales == [float(np.float32(57344) / np.float32(7))]


def test_random_sequences_match_the_model(rng):
    amaxes = np.abs(rng.standard_normal(40) * 10).astype(np.float32)
    amaxes[[3, 17]] = 0.0
    amaxes[25] = np.inf
    for algo in ("max", "most_recent"):
        run(np.zeros(8), [1.0], amaxes, margin=1, algo=algo)


def test_new_amax_may_be_a_scalar_or_shape_1():
    h = jnp.zeros(4)
    s = jnp.ones(1)
    a = update_delayed_scaling(h, s, jnp.float32(2.0), fp8_max=448.0)
    b = update_delayed_scaling(h, s, jnp.full((1,), 2.0), fp8_max=448.0)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_vmap_over_a_batch_of_histories():
    hs = jnp.zeros((3, 4))
    ss = jnp.ones((3, 1))
    amaxes = jnp.array([1.0, 2.0, 0.0])
    update = jax.vmap(lambda h, s, a: update_delayed_scaling(h, s, a, fp8_max=448.0))
    new_h, new_s = update(hs, ss, amaxes)
    np.testing.assert_array_equal(new_s[:, 0], [448.0, 224.0, 1.0])
    np.testing.assert_array_equal(new_h[:, -1], amaxes)


def test_bad_arguments():
    with pytest.raises(ValueError, match="amax_compute_algo"):
        update_delayed_scaling(
            jnp.zeros(2), jnp.ones(1), 1.0, fp8_max=448.0, amax_compute_algo="avg")
    with pytest.raises(ValueError, match="amax_history"):
        update_delayed_scaling(jnp.zeros((2, 2)), jnp.ones(1), 1.0, fp8_max=448.0)
    with pytest.raises(ValueError, match="new_amax"):
        update_delayed_scaling(jnp.zeros(2), jnp.ones(1), jnp.ones(2), fp8_max=448.0)
    # A fraction, a negative, a bool or too large a margin would be truncated or overflow.
    for margin in (0.5, -1, True, 2**40):
        with pytest.raises(ValueError, match="update_delayed_scaling: margin: expected a whole number in \\[0, 2\\*\\*31\\)"):
            update_delayed_scaling(jnp.zeros(2), jnp.ones(1), 1.0, fp8_max=448.0, margin=margin)
    # A whole float (TE's quantizers default to margin=0.0) is that int.
    history = jnp.asarray([3.0, 7.5])
    for a, b in zip(update_delayed_scaling(history, jnp.ones(1), 2.0, fp8_max=448.0, margin=2.0),
                    update_delayed_scaling(history, jnp.ones(1), 2.0, fp8_max=448.0, margin=2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for fp8_max in (-448.0, 0.0, float("inf"), "448"):
        with pytest.raises(ValueError, match="fp8_max: expected a finite positive number"):
            update_delayed_scaling(jnp.zeros(2), jnp.ones(1), 1.0, fp8_max=fp8_max)
        with pytest.raises(ValueError, match="compute_scale: fp8_max: expected a finite positive number"):
            lowbit.ops.compute_scale(jnp.ones(1), fp8_max=fp8_max)
    with pytest.raises(ValueError, match="DelayedScaleQuantizer: margin"):
        DelayedScaleQuantizer(q_dtype=jnp.float8_e4m3fn, margin=0.5)


def current_scale_ref(amax, fp8_max, pow2):
    amax = np.float32(amax)
    with np.errstate(all="ignore"):
        s = np.float32(fp8_max) / amax
    s = np.float32(FLT_MAX) if np.isinf(s) else s
    s = s if (amax > 0 and np.isfinite(amax)) else np.float32(1.0)
    if pow2:
        s = (np.array(s).view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return np.float32(s)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_compute_scale(pow2, fp8_max, rng):
    amaxes = np.concatenate([
        np.abs(rng.standard_normal(64) * 100),
        [0.0, -0.0, np.inf, np.nan, 1e-40, 1e-45, 1.0, 3.0, 448.0, 1e30, FLT_MAX],
    ]).astype(np.float32)
    scales = jax.jit(lambda a: compute_scale(a, fp8_max=fp8_max, use_power_2_scales=pow2))
    got = np.asarray(scales(amaxes))
    want = np.array([current_scale_ref(a, fp8_max, pow2) for a in amaxes])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_compute_scale_special_cases():
    def scale(amax, pow2=False):
        return float(compute_scale(jnp.float32(amax), fp8_max=448.0, use_power_2_scales=pow2))

    assert scale(0.0) == scale(np.inf) == scale(np.nan) == 1.0
    assert scale(1e-40) == FLT_MAX
    assert scale(1e-40, pow2=True) == 2.0**127
    assert scale(3.0, pow2=True) == 128.0  # 149.33 rounded down
    assert scale(448.0, pow2=True) == 1.0
    assert compute_scale(jnp.ones((1,)), fp8_max=448.0).shape == (1,)


# ---------------------------------------------------------------- the scale FFI ops
# The pure-jnp formulas lowbit used before the scale ops (kept as a second reference: on
# the CPU they agree with the ops except where XLA:CPU flushes denormals).

POSITIVE_INFINITY_BITS = np.uint32(0x7F800000)


def _usable_amax_jnp(amax):
    bits = jax.lax.bitcast_convert_type(amax, jnp.uint32)
    return (bits != 0) & (bits < POSITIVE_INFINITY_BITS)


def _clamp_infinite_jnp(scale):
    return jnp.where(jnp.isinf(scale), jnp.float32(FLT_MAX), scale)


def compute_scale_jnp(amax, fp8_max, pow2):
    amax = jnp.asarray(amax, jnp.float32)
    scale = _clamp_infinite_jnp(jnp.float32(fp8_max) / amax)
    scale = jnp.where(_usable_amax_jnp(amax), scale, jnp.float32(1.0))
    if pow2:
        bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) & np.uint32(0xFF800000)
        scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return scale


def update_jnp(history, scale, new_amax, fp8_max, margin, algo):
    history = jnp.asarray(history, jnp.float32).at[0].set(jnp.float32(new_amax))
    a = jnp.max(history) if algo == "max" else history[0]
    s = jnp.float32(fp8_max) / a / jnp.float32(2.0**margin)
    s = jnp.where(_usable_amax_jnp(a), _clamp_infinite_jnp(s), jnp.asarray(scale, jnp.float32))
    return jnp.roll(history, -1).at[0].set(0.0), s


def special_amaxes(rng, n=4000):
    """Random fp32 bit patterns (every class: NaN of both signs, inf, denormals, negative)
    plus normal magnitudes over the whole range and the edge cases."""
    raw = rng.integers(0, 1 << 32, n, dtype=np.uint32).view(np.float32)
    mags = (np.exp2(rng.uniform(-149, 127, n)) * rng.uniform(1, 2, n)).astype(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, 1e-40, 1.1754942e-38,
                      1.17549435e-38, 1.0, 3.0, 7.0, 448.0, 57344.0, 1e30, FLT_MAX, -1.0],
                     np.float32)
    return np.concatenate([raw, mags, edges])


def inverse_ref(s):
    with np.errstate(all="ignore"):
        inv = np.float32(1.0) / np.float32(s)
    if np.isnan(inv):  # the ops' NaN: canonical, with the NaN operand's sign
        return np.uint32(0x7FC00000 | (np.array(s, np.float32).view(np.uint32) & 0x80000000))
    return np.array(inv, np.float32).view(np.uint32)


def u32(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_compute_scale_op_equals_numpy_bit_for_bit(pow2, fp8_max, rng):
    from lowbit.ops import compute_scale as compute_scale_op

    amaxes = special_amaxes(rng)
    scale, scale_inv = jax.jit(lambda a: compute_scale_op(
        a, fp8_max=fp8_max, use_power_2_scales=pow2))(amaxes)
    want = np.array([current_scale_ref(a, fp8_max, pow2) for a in amaxes], np.float32)
    np.testing.assert_array_equal(u32(scale), u32(want))
    np.testing.assert_array_equal(u32(scale_inv), [inverse_ref(s) for s in want])
    # The old jnp formula agrees wherever the quotient is normal (XLA:CPU may flush the rest).
    normal = (np.abs(want) >= np.finfo(np.float32).tiny) & ~np.isnan(amaxes) & (
        np.abs(amaxes) >= np.finfo(np.float32).tiny)
    if jax.default_backend() == "cpu":  # XLA's GPU fp32 division is not correctly rounded
        jnp_scale = np.asarray(jax.jit(lambda a: compute_scale_jnp(a, fp8_max, pow2))(amaxes))
        np.testing.assert_array_equal(u32(jnp_scale)[normal], u32(want)[normal])


def test_scale_inverse_op(rng):
    from lowbit.ops import scale_inverse

    s = special_amaxes(rng)
    got = jax.jit(scale_inverse)(s)
    np.testing.assert_array_equal(u32(got), [inverse_ref(v) for v in s])


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 7, 140])
def test_update_op_equals_numpy_bit_for_bit(algo, margin, rng):
    from lowbit.ops import update_delayed_scaling as update_op

    amaxes = special_amaxes(rng, 300)
    step = jax.jit(lambda h, s, a: update_op(h, s, a, fp8_max=448.0, margin=margin,
                                             most_recent=algo == "most_recent"))
    for L in (1, 5):
        h = np.abs(special_amaxes(rng, L)[:L])
        s = np.float32(rng.uniform(0.5, 2))
        h_ref, s_ref = h.copy(), s
        for a in amaxes[rng.permutation(len(amaxes))[:120]]:
            h, s, inv = step(h, np.float32(s).reshape(1), a)
            h_ref, s_ref = update_ref(h_ref, s_ref, a, 448.0, margin, algo)
            np.testing.assert_array_equal(u32(h), u32(h_ref))
            # inf / inf (margin >= 128 makes 2^margin infinite): the ops' NaN is positive.
            want = np.uint32(0x7FC00000) if np.isnan(s_ref) else u32(s_ref)
            assert u32(s)[0] == want, (a, s, s_ref)
            assert u32(inv)[0] == inverse_ref(np.asarray(s)[0])
            h, s = np.asarray(h), np.asarray(s)[0]


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="XLA's GPU fp32 division is not correctly rounded: the jnp formula differs by 1 ulp there")
def test_update_op_matches_the_old_jnp_formula_on_normal_values(rng):
    amaxes = np.abs(rng.standard_normal(50) * 10).astype(np.float32)
    amaxes[[3, 17]] = 0.0
    amaxes[25] = np.inf
    for algo in ("max", "most_recent"):
        h, s = jnp.zeros(6), jnp.ones(1)
        hj, sj = jnp.zeros(6), jnp.ones(1)
        for a in amaxes:
            h, s = update_delayed_scaling(h, s, a, fp8_max=448.0, margin=1, amax_compute_algo=algo)
            hj, sj = update_jnp(hj, sj, a, 448.0, 1, algo)
            np.testing.assert_array_equal(u32(h), u32(hj))
            np.testing.assert_array_equal(u32(s), u32(sj))


def test_scale_ops_under_scan_grad_and_vmap():
    from lowbit.ops import compute_scale as compute_scale_op

    def body(carry, a):
        h, s = carry
        h, s = update_delayed_scaling(h, s, a, fp8_max=448.0)
        return (h, s), s[0]

    amaxes = jnp.array([1.0, 4.0, 2.0, 0.5], jnp.float32)
    (_, _), scales = jax.lax.scan(body, (jnp.zeros(2), jnp.ones(1)), amaxes)
    np.testing.assert_array_equal(scales, [448.0, 112.0, 112.0, 224.0])
    g = jax.grad(lambda a: compute_scale(a, fp8_max=448.0).sum() * a.sum())(jnp.full((1,), 2.0))
    np.testing.assert_array_equal(g, [224.0])  # the scale is a constant to autodiff
    s, inv = jax.vmap(lambda a: compute_scale_op(a, fp8_max=448.0))(jnp.array([[1.0], [4.0]]))
    np.testing.assert_array_equal(s, [[448.0], [112.0]])
    np.testing.assert_array_equal(inv, [[np.float32(1) / np.float32(448)], [np.float32(1) / np.float32(112)]])
    # vmap with an unbatched history (broadcast inside the batching rule).
    new_h, new_s = jax.vmap(lambda a: update_delayed_scaling(jnp.zeros(3), jnp.ones(1), a, fp8_max=448.0))(
        jnp.array([2.0, 8.0]))
    np.testing.assert_array_equal(new_s[:, 0], [224.0, 56.0])
    np.testing.assert_array_equal(new_h[:, -1], [2.0, 8.0])


@pytest.mark.gpu
def test_cuda_scale_ops_equal_cpu(rng, cpu, gpu):
    from conftest import run_on

    from lowbit.ops import compute_scale as compute_scale_op
    from lowbit.ops import scale_inverse
    from lowbit.ops import update_delayed_scaling as update_op

    amaxes = special_amaxes(rng, 20000)
    for fp8_max in (448.0, 57344.0):
        for pow2 in (False, True):
            f = lambda a: compute_scale_op(a, fp8_max=fp8_max, use_power_2_scales=pow2)  # noqa: B023,E731
            a, b = run_on(gpu, f, amaxes), run_on(cpu, f, amaxes)
            jax.tree.map(lambda x, y: np.testing.assert_array_equal(u32(x), u32(y)), a, b)
    a, b = run_on(gpu, scale_inverse, amaxes), run_on(cpu, scale_inverse, amaxes)
    np.testing.assert_array_equal(u32(a), u32(b))
    for algo in ("max", "most_recent"):
        for margin in (0, 3, 140):
            f = lambda h, s, x: update_op(h, s, x, fp8_max=448.0, margin=margin,  # noqa: B023,E731
                                          most_recent=algo == "most_recent")
            for L, signed in ((1, False), (7, False), (300, True), (1024, False)):
                h = special_amaxes(rng, L)[:L].astype(np.float32)  # the kernel reduces in parallel
                # signed: negative entries and no NaN, so the max over the history is exercised
                h = np.where(np.isnan(h), np.float32(-2.0), h) if signed else np.abs(h)
                for x in amaxes[:60]:
                    s = np.float32(rng.uniform(0.1, 10)).reshape(1)
                    a, b = run_on(gpu, f, h, s, x), run_on(cpu, f, h, s, x)
                    for p, q in zip(a, b):
                        np.testing.assert_array_equal(u32(p), u32(q))
