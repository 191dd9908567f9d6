"""DynamicLossScale: bounds, NumPy numbers, corrupted state, example
transitions that the reference test alone would catch."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import mp_callbacks as mp
from mp_callbacks import DynamicLossScale


def _step(loss_scale, finite=True, optimizer=None, variable=None):
    variable = variable if variable is not None else tf.Variable([1.0])
    optimizer = optimizer or keras.optimizers.SGD(0.1)
    grad = tf.constant([1.0]) if finite else tf.constant([np.inf])
    return bool(loss_scale.apply_gradients(optimizer, [grad], [variable]))


@pytest.mark.parametrize("kwargs, argument", [
    ({"initial_scale": 1e39, "max_scale": 1e39}, "initial_scale"),
    ({"initial_scale": 2.0**-130, "min_scale": 2.0**-130}, "initial_scale"),
    ({"initial_scale": 1e-50, "min_scale": 1e-50}, "initial_scale"),
    ({"max_scale": 2.0**128}, "max_scale"),
    ({"growth_interval": 2**63}, "growth_interval"),
    ({"hysteresis": 2**63}, "hysteresis"),
    ({"growth_factor": 1e39}, "growth_factor"),
    ({"backoff_factor": 1e-50}, "backoff_factor"),
])
def test_unrepresentable_values_are_refused_at_construction(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        DynamicLossScale(**kwargs)


def test_fixed_scale_out_of_float32_is_refused_by_the_model():
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    for value in (1e39, 2.0**-130):
        with pytest.raises(ValueError, match="loss_scale"):
            mp.MixedPrecisionModel(inputs, outputs, loss_scale=value)


def test_largest_int64_interval_trains():
    loss_scale = DynamicLossScale(growth_interval=2**63 - 1, hysteresis=2**63 - 1)
    assert _step(loss_scale) and loss_scale.diagnostics()["good_steps"] == 1


def test_numpy_numbers_are_accepted():
    loss_scale = DynamicLossScale(initial_scale=np.float32(1024), growth_interval=np.int64(3),
                                  growth_factor=np.float64(2.0), hysteresis=np.int32(2))
    assert loss_scale.initial_scale == 1024.0 and loss_scale.growth_interval == 3
    assert type(loss_scale.growth_interval) is int and type(loss_scale.initial_scale) is float
    inputs = keras.Input((2,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs), loss_scale=np.float32(128))
    model.compile("sgd", "mse")
    assert model.get_loss_scale() == 128.0


@pytest.mark.parametrize("value", [True, np.bool_(False), "8", None, [2.0]])
def test_non_numbers_are_type_errors_naming_the_argument(value):
    with pytest.raises(TypeError, match="`initial_scale`"):
        DynamicLossScale(initial_scale=value)


def test_hysteresis_is_refilled_by_growth():
    loss_scale = DynamicLossScale(initial_scale=8.0, growth_interval=2, hysteresis=3)
    _step(loss_scale, finite=False)
    _step(loss_scale, finite=False)
    assert loss_scale.diagnostics()["hysteresis_left"] == 1
    _step(loss_scale)
    assert loss_scale.diagnostics()["hysteresis_left"] == 1  # not refilled by a finite step
    _step(loss_scale)  # second finite step in a row: growth refills the budget
    state = loss_scale.diagnostics()
    assert state["scale"] == 16.0 and state["hysteresis_left"] == 3 and state["good_steps"] == 0


def test_overflow_resets_good_steps():
    loss_scale = DynamicLossScale(initial_scale=8.0, growth_interval=3, hysteresis=2)
    _step(loss_scale)
    _step(loss_scale)
    assert loss_scale.diagnostics()["good_steps"] == 2
    _step(loss_scale, finite=False)  # hysteresis absorbs it: no backoff, but the run restarts
    state = loss_scale.diagnostics()
    assert state["good_steps"] == 0 and state["scale"] == 8.0
    _step(loss_scale)
    _step(loss_scale)
    assert loss_scale.get_scale() == 8.0  # 2 finite steps after the reset: no growth yet
    _step(loss_scale)
    assert loss_scale.get_scale() == 16.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, 0.0, -4.0])
def test_set_state_refuses_a_bad_scale_and_changes_nothing(bad):
    loss_scale = DynamicLossScale(initial_scale=64.0)
    _step(loss_scale)
    before = loss_scale.diagnostics()
    with pytest.raises(ValueError, match="loss scale"):
        loss_scale.set_state({"good_steps": np.int64(7), "scale": np.float32(bad)})
    assert loss_scale.diagnostics() == before


def test_set_state_refuses_negative_counters():
    loss_scale = DynamicLossScale()
    with pytest.raises(ValueError, match="skipped_steps"):
        loss_scale.set_state({"skipped_steps": np.int64(-1)})


def test_a_nan_scale_written_at_run_time_recovers():
    loss_scale = DynamicLossScale(initial_scale=256.0, growth_interval=1000)
    loss_scale._state["scale"].assign(np.nan)
    applied = [_step(loss_scale) for _ in range(4)]
    assert applied == [True] * 4
    assert loss_scale.get_scale() == 256.0
    assert math.isfinite(loss_scale.diagnostics()["scale"])


def test_lowest_scale_latch_keeps_a_collapse_that_recovered():
    loss_scale = DynamicLossScale(initial_scale=4.0, growth_interval=1, min_scale=1.0)
    _step(loss_scale, finite=False)
    _step(loss_scale, finite=False)  # at the floor: 1.0
    for _ in range(4):
        _step(loss_scale)
    state = loss_scale.diagnostics()
    assert state["scale"] == 16.0 and state["lowest_scale"] == 1.0
    loss_scale.reset_lowest_scale()
    assert loss_scale.diagnostics()["lowest_scale"] == 16.0


def test_legacy_state_names_restore():
    loss_scale = DynamicLossScale()
    loss_scale.set_state({"skipped_count": np.int64(5), "divergent_count": np.int64(2)})
    state = loss_scale.diagnostics()
    assert state["skipped_steps"] == 5 and state["divergent_steps"] == 2


def test_one_table_names_every_state_key():
    names = [spec.name for spec in mp.loss_scale.STATE_VARIABLES]
    loss_scale = DynamicLossScale()
    assert list(loss_scale.diagnostics()) == names
    assert list(loss_scale.get_state()) == names


def test_one_pass_check_is_exact_for_huge_finite_and_non_finite_gradients():
    loss_scale = DynamicLossScale()
    grads = [tf.constant([3.0, 4.0]), tf.constant([1e20, 1.0]), None,
             tf.constant([np.nan]), tf.constant([1.0], tf.float16)]
    checked = loss_scale.check_gradients(grads)
    # 1e20 squared overflows float32, yet that gradient is finite.
    assert checked.flags.numpy().tolist() == [0, 0, 0, 1, 0]
    healthy = loss_scale.check_gradients([tf.constant([3.0, 4.0]), tf.constant([12.0], tf.float16)])
    assert healthy.flags.numpy().tolist() == [0, 0]
    assert float(healthy.global_norm) == pytest.approx(13.0)
    variable = tf.Variable([1.0, 1.0])
    optimizer = keras.optimizers.SGD(1e-20)
    assert bool(loss_scale.apply_gradients(optimizer, [tf.constant([1e20, 0.0])], [variable]))
    np.testing.assert_allclose(variable.numpy(), [0.0, 1.0])


def test_reset_divergence_latches_and_repr():
    loss_scale = DynamicLossScale(initial_scale=1.0, min_scale=1.0, max_scale=4.0)
    _step(loss_scale, finite=False)
    _step(loss_scale, finite=False)
    state = loss_scale.diagnostics()
    assert state["divergent_run"] == 2 and state["max_divergent_run"] == 2
    loss_scale.reset_divergence_latches()
    state = loss_scale.diagnostics()
    assert state["divergent_run"] == 0 and state["max_divergent_run"] == 0
    assert state["divergent_steps"] == 2  # the total stays
    assert repr(DynamicLossScale.fixed(8.0)) == "DynamicLossScale.fixed(8.0)"
    assert repr(DynamicLossScale(initial_scale=4.0, growth_interval=7, hysteresis=2)) == (
        "DynamicLossScale(initial_scale=4.0, growth_interval=7, hysteresis=2)")
