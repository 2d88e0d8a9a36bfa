"""lowbit.quantize.delayed: the delayed-scaling update and the current-scaling scale
(DESIGN §4) against a few-line numpy model: history roll, "max" vs "most_recent", margin,
amax 0 / inf / NaN, infinite scales clamped to FLT_MAX, power-of-two scales, jit, vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.quantize.delayed import FLT_MAX, compute_scale, update_delayed_scaling


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
