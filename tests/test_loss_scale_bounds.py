"""LossScaler: bounds, NumPy numbers, corrupted state, example
transitions that the reference test alone would catch."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from scale_cases import LOSS_SCALE_REFUSALS, REFUSALS, UNREPRESENTABLE

import mp_callbacks as mp
from mp_callbacks import LossScaler


def _step(loss_scale, finite=True, optimizer=None, variable=None):
    variable = variable if variable is not None else tf.Variable([1.0])
    optimizer = optimizer or keras.optimizers.SGD(0.1)
    grad = tf.constant([1.0]) if finite else tf.constant([np.inf])
    return bool(loss_scale.apply_gradients(optimizer, [grad], [variable]))


@pytest.mark.parametrize("kwargs, argument", UNREPRESENTABLE)
def test_unrepresentable_values_are_refused_at_construction(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        LossScaler(**kwargs)


def test_fixed_scale_out_of_float32_is_refused_by_the_model():
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    for value in (1e39, 2.0**-130):
        with pytest.raises(ValueError, match="loss_scale"):
            mp.MixedPrecisionModel(inputs, outputs, loss_scale=value)


def test_scales_whose_gradients_underflow_are_refused_and_the_floor_trains():
    """At float32's smallest normal, a fixed scale was accepted and its
    gradients were flushed to zero: the model silently never changed."""
    from mp_callbacks.loss_scale import MIN_LOSS_SCALE

    tiny = float(np.finfo(np.float32).tiny)
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    message = r"must be a finite number >= 2\*\*-24 \(5.96e-08\)"
    for argument in ("initial_scale", "min_scale", "max_scale"):
        with pytest.raises(ValueError, match=f"`{argument}` {message}"):
            LossScaler(**{"initial_scale": 1.0, "min_scale": 1.0, argument: tiny})
    fixed = r"must be a number from 2\*\*-24 \(5.96e-08\) to 2\*\*64 \(1.84e\+19\) when it is a fixed"
    with pytest.raises(ValueError, match=f"`loss_scale` {fixed}"):
        mp.MixedPrecisionModel(inputs, outputs, loss_scale=MIN_LOSS_SCALE / 2)
    with pytest.raises(ValueError, match=f"`initial_scale` {fixed}"):
        mp.LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False, initial_scale=tiny)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=MIN_LOSS_SCALE)
    model.compile(keras.optimizers.SGD(0.1), "mse", run_eagerly=True)
    before = model.get_weights()
    model.fit(np.ones((4, 2), "float32"), np.full((4, 1), 3.0, "float32"), epochs=1, verbose=0)
    assert model.get_scale() == MIN_LOSS_SCALE
    assert all(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_a_fixed_scale_that_overflows_every_step_is_refused_unless_asked_for_in_full():
    """A plain-number fixed scale of 2**126 was accepted and skipped every
    step; it cannot back off. LossScaler still takes it (tests use it
    to provoke overflows), and 2**64 itself trains."""
    from mp_callbacks.loss_scale import MAX_FIXED_LOSS_SCALE

    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    fixed = r"must be a number from 2\*\*-24 \(5.96e-08\) to 2\*\*64 \(1.84e\+19\) when it is a fixed"
    for value in (2.0**126, np.float32(2.0**65)):
        with pytest.raises(ValueError, match=f"`loss_scale` {fixed} scale; received loss_scale="):
            mp.MixedPrecisionModel(inputs, outputs, loss_scale=value)
        with pytest.raises(ValueError, match=f"`loss_scale` {fixed}"):
            mp.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=value)
        with pytest.raises(ValueError, match=f"`initial_scale` {fixed}"):
            mp.LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False, initial_scale=value)
    assert LossScaler.fixed(2.0**126).get_scale() == 2.0**126
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=MAX_FIXED_LOSS_SCALE)
    model.compile(keras.optimizers.SGD(0.1), "mse", run_eagerly=True)
    before = model.get_weights()
    history = model.fit(np.ones((4, 2), "float32"), np.full((4, 1), 3.0, "float32"), epochs=1, verbose=0)
    assert history.history["skipped_steps"] == [0.0]
    assert all(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


@pytest.mark.parametrize("kwargs, message", REFUSALS)
def test_refusals_name_the_class_the_argument_the_rule_and_the_value(kwargs, message):
    with pytest.raises((ValueError, TypeError)) as caught:
        LossScaler(**kwargs)
    assert str(caught.value) == f"LossScaler: {message}"


def test_a_bad_model_loss_scale_is_reported_as_the_models():
    from mp_callbacks.loss_scale import loss_scale_from_argument

    with pytest.raises(ValueError) as caught:
        loss_scale_from_argument("dynamic")
    assert str(caught.value).startswith("MixedPrecisionModel: `loss_scale` must be 'auto', ")


def test_restored_counters_may_be_zero_large_or_float32():
    loss_scale = LossScaler()
    loss_scale.set_state({"skipped_steps": 0.0, "step_count": 200.0, "good_steps": np.float32(7.0)})
    state = loss_scale.diagnostics()
    assert (state["skipped_steps"], state["step_count"], state["good_steps"]) == (0, 200, 7)


def test_largest_int64_interval_trains():
    loss_scale = LossScaler(growth_interval=2**63 - 1, hysteresis=2**63 - 1)
    assert _step(loss_scale) and loss_scale.diagnostics()["good_steps"] == 1


def test_numpy_numbers_are_accepted():
    loss_scale = LossScaler(
        initial_scale=np.float32(1024),
        growth_interval=np.int64(3),
        growth_factor=np.float64(2.0),
        hysteresis=np.int32(2),
    )
    assert loss_scale.initial_scale == 1024.0 and loss_scale.growth_interval == 3
    assert type(loss_scale.growth_interval) is int and type(loss_scale.initial_scale) is float
    inputs = keras.Input((2,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs), loss_scale=np.float32(128))
    model.compile("sgd", "mse")
    assert model.get_scale() == 128.0


@pytest.mark.parametrize("value", [True, np.bool_(False), "8", None, [2.0]])
def test_non_numbers_are_type_errors_naming_the_argument(value):
    with pytest.raises(TypeError, match="`initial_scale`"):
        LossScaler(initial_scale=value)


def test_hysteresis_is_refilled_by_growth():
    loss_scale = LossScaler(initial_scale=8.0, growth_interval=2, hysteresis=3)
    _step(loss_scale, finite=False)
    _step(loss_scale, finite=False)
    assert loss_scale.diagnostics()["hysteresis_left"] == 1
    _step(loss_scale)
    assert loss_scale.diagnostics()["hysteresis_left"] == 1  # not refilled by a finite step
    _step(loss_scale)  # second finite step in a row: growth refills the budget
    state = loss_scale.diagnostics()
    assert state["scale"] == 16.0 and state["hysteresis_left"] == 3 and state["good_steps"] == 0


def test_overflow_resets_good_steps():
    loss_scale = LossScaler(initial_scale=8.0, growth_interval=3, hysteresis=2)
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
    loss_scale = LossScaler(initial_scale=64.0)
    _step(loss_scale)
    before = loss_scale.diagnostics()
    with pytest.raises(ValueError, match="loss scale"):
        loss_scale.set_state({"good_steps": np.int64(7), "scale": np.float32(bad)})
    assert loss_scale.diagnostics() == before


def test_set_state_refuses_negative_counters():
    loss_scale = LossScaler()
    with pytest.raises(ValueError, match="skipped_steps"):
        loss_scale.set_state({"skipped_steps": np.int64(-1)})


@pytest.mark.parametrize("written", [np.nan, np.inf, 0.0, -4.0])
def test_a_scale_that_is_not_positive_and_finite_written_at_run_time_recovers(written):
    loss_scale = LossScaler(initial_scale=256.0, growth_interval=1000)
    loss_scale._state["scale"].assign(written)
    applied = [_step(loss_scale) for _ in range(4)]
    assert applied == [True] * 4
    assert loss_scale.get_scale() == 256.0
    assert math.isfinite(loss_scale.diagnostics()["scale"])


def test_lowest_scale_latch_keeps_a_collapse_that_recovered():
    loss_scale = LossScaler(initial_scale=4.0, growth_interval=1, min_scale=1.0)
    _step(loss_scale, finite=False)
    _step(loss_scale, finite=False)  # at the floor: 1.0
    for _ in range(4):
        _step(loss_scale)
    state = loss_scale.diagnostics()
    assert state["scale"] == 16.0 and state["lowest_scale"] == 1.0
    loss_scale.reset_lowest_scale()
    assert loss_scale.diagnostics()["lowest_scale"] is None  # no step since the reset
    _step(loss_scale)
    assert loss_scale.diagnostics()["lowest_scale"] == 32.0


def test_one_table_names_every_state_key():
    names = [spec.name for spec in mp.loss_scale.STATE_VARIABLES]
    loss_scale = LossScaler()
    assert list(loss_scale.diagnostics()) == names
    assert list(loss_scale.get_state()) == names


def test_one_pass_check_is_exact_for_huge_finite_and_non_finite_gradients():
    loss_scale = LossScaler()
    grads = [
        tf.constant([3.0, 4.0]),
        tf.constant([1e20, 1.0]),
        None,
        tf.constant([np.nan]),
        tf.constant([1.0], tf.float16),
    ]
    checked = loss_scale.check_gradients(grads)
    # 1e20 squared overflows float32, yet that gradient is finite.
    assert checked.flags.numpy().tolist() == [0, 0, 0, 1, 0]
    assert not bool(checked.all_finite)
    huge = loss_scale.check_gradients([tf.constant([1e20, 1.0]), tf.constant([3.0])])
    assert huge.flags.numpy().tolist() == [0, 0] and bool(huge.all_finite)
    healthy = loss_scale.check_gradients([tf.constant([3.0, 4.0]), tf.constant([12.0], tf.float16)])
    assert healthy.flags.numpy().tolist() == [0, 0] and bool(healthy.all_finite)
    assert float(healthy.global_norm) == pytest.approx(13.0)
    variable = tf.Variable([1.0, 1.0])
    optimizer = keras.optimizers.SGD(1e-20)
    assert bool(loss_scale.apply_gradients(optimizer, [tf.constant([1e20, 0.0])], [variable]))
    np.testing.assert_allclose(variable.numpy(), [0.0, 1.0])
    # Traced, the update is gated on the check's decision: the same holds.
    step = tf.function(lambda grad: loss_scale.apply_gradients(optimizer, [grad], [variable]))
    assert bool(step(tf.constant([1e20, 0.0])))
    np.testing.assert_allclose(variable.numpy(), [-1.0, 1.0])
    assert not bool(step(tf.constant([1e20, np.inf])))
    np.testing.assert_allclose(variable.numpy(), [-1.0, 1.0])
    assert loss_scale.diagnostics()["skipped_steps"] == 1


def test_reset_divergence_latches_and_repr():
    loss_scale = LossScaler(initial_scale=1.0, min_scale=1.0, max_scale=4.0)
    _step(loss_scale, finite=False)
    _step(loss_scale, finite=False)
    state = loss_scale.diagnostics()
    assert state["divergent_run"] == 2 and state["max_divergent_run"] == 2
    loss_scale.reset_divergence_latches()
    state = loss_scale.diagnostics()
    assert state["divergent_run"] == 0 and state["max_divergent_run"] == 0
    assert state["divergent_steps"] == 2  # the total stays
    assert repr(LossScaler.fixed(8.0)) == "LossScaler.fixed(8.0)"
    assert repr(LossScaler(initial_scale=4.0, growth_interval=7, hysteresis=2)) == (
        "LossScaler(initial_scale=4.0, growth_interval=7, hysteresis=2)"
    )


def test_loss_scale_from_argument_every_branch():
    from mp_callbacks.loss_scale import loss_scale_from_argument

    assert loss_scale_from_argument("auto") is None
    given = LossScaler(initial_scale=8.0)
    assert loss_scale_from_argument(given) is given
    disabled = loss_scale_from_argument(None)
    assert not disabled.scaling_active and disabled.get_scale() == 1.0
    fixed = loss_scale_from_argument(np.float32(64))
    assert not fixed.is_dynamic and fixed.get_scale() == 64.0 and fixed.min_scale == 64.0
    revived = loss_scale_from_argument(keras.saving.serialize_keras_object(given))
    assert isinstance(revived, LossScaler) and revived.get_config() == given.get_config()
    for value, error in (
        ("dynamic", ValueError),
        (0, ValueError),
        (-2.0, ValueError),
        (1e39, ValueError),
        (True, TypeError),
        ([], TypeError),
        ({}, TypeError),
        (object(), TypeError),
    ):
        with pytest.raises(error, match=r"^Owner: `loss_scale` must be") as caught:
            loss_scale_from_argument(value, owner="Owner")
        assert "loss_scale=" in str(caught.value)


def test_fixed_and_disabled_scales():
    fixed = LossScaler.fixed(8.0)
    assert fixed.name == "fixed_loss_scale" and (fixed.min_scale, fixed.max_scale) == (8.0, 8.0)
    assert not fixed.is_dynamic and fixed.scaling_active
    disabled = LossScaler.disabled()
    assert disabled.name == "no_loss_scale" and disabled.initial_scale == 1.0
    assert not disabled.scaling_active and not disabled.is_dynamic
    assert LossScaler.fixed(2.0, name="mine").name == "mine"
    loss = tf.constant(3.0)
    assert disabled.scale(loss) is loss and float(fixed.scale(loss)) == 24.0


def test_state_round_trip_types_and_partial_restores():
    loss_scale = LossScaler(initial_scale=4.0)
    state = loss_scale.diagnostics()
    assert all(type(state[name]) is int for name in ("step_count", "skipped_steps", "good_steps"))
    assert type(state["scale"]) is float and type(state["lowest_scale"]) is float
    assert "nonfinite_counts" not in loss_scale.get_state()
    loss_scale.set_state(loss_scale.get_state())  # zeros are valid counters
    variable = tf.Variable([1.0])
    _step(loss_scale, finite=False, variable=variable)
    saved = loss_scale.get_state()
    assert saved["nonfinite_counts"].tolist() == [1]
    other = LossScaler(initial_scale=4.0)
    other.build([tf.Variable([0.0])])
    # A misshapen entry is skipped, and the entries after it still restore.
    other.set_state(
        {
            "scale": np.array([1.0, 2.0], "float32"),
            "good_steps": 3.0,
            "skipped_steps": np.int64(1),
            "nonfinite_counts": saved["nonfinite_counts"],
            "lowest_scale": np.float32(0.5),
        }
    )
    restored = other.diagnostics()
    assert restored["scale"] == 4.0 and restored["good_steps"] == 3 and restored["skipped_steps"] == 1
    assert restored["lowest_scale"] == 0.5
    assert list(other.nonfinite_gradient_counts().values()) == [1]
    other.set_state({"scale": np.float32(0.5)})  # below 1 is a valid scale
    assert other.get_scale() == 0.5
    with pytest.raises(ValueError, match="lowest_scale"):
        other.set_state({"lowest_scale": np.float32(np.inf)})


def test_fused_check_handles_sparse_low_precision_and_missing_gradients():
    loss_scale = LossScaler()
    sparse = tf.IndexedSlices(tf.constant([[3.0, 4.0]]), tf.constant([1]), tf.constant([4, 2]))
    checked = loss_scale.check_gradients([sparse, None, tf.constant([300.0], tf.float16)])
    assert checked.flags.numpy().tolist() == [0, 0, 0]  # 300**2 overflows float16, not float32
    assert float(checked.global_norm) == pytest.approx(float(np.sqrt(25 + 300**2)))
    bad_sparse = tf.IndexedSlices(tf.constant([[np.inf, 0.0]]), tf.constant([0]), tf.constant([4, 2]))
    assert loss_scale.check_gradients([bad_sparse, None]).flags.numpy().tolist() == [1, 0]
    assert loss_scale.check_gradients([]).flags.shape == (0,)


def test_state_variables_are_untrainable_single_copies_with_stable_names():
    loss_scale = LossScaler()
    assert loss_scale.name == "dynamic_loss_scale"
    a, b = tf.Variable([1.0], name="a"), tf.Variable([2.0], name="b")
    loss_scale.build([a, b])
    assert loss_scale.trainable_variables == ()
    names = sorted(v.name.split("/")[-1].split(":")[0] for v in loss_scale.variables)
    assert names == sorted(
        [spec.name for spec in mp.loss_scale.STATE_VARIABLES] + ["nonfinite_gradient_counts"]
    )
    # One value shared by every replica, updated after one all-reduced decision.
    assert {v.aggregation for v in loss_scale.variables} == {tf.VariableAggregation.ONLY_FIRST_REPLICA}
    optimizer = keras.optimizers.SGD(0.1)
    loss_scale.apply_gradients(optimizer, [tf.constant([np.nan]), tf.constant([1.0])], [a, b])
    counters = loss_scale._nonfinite_counts
    loss_scale.build([b, a])  # the same variables in another order: kept
    loss_scale.build([a])  # a subset: kept
    assert loss_scale._nonfinite_counts is counters
    assert list(loss_scale.nonfinite_gradient_counts().values()) == [1, 0]


def test_loss_scale_argument_errors_say_exactly_what_is_accepted():
    from mp_callbacks.loss_scale import loss_scale_from_argument

    for value, error, message in LOSS_SCALE_REFUSALS:
        with pytest.raises(error) as caught:
            loss_scale_from_argument(value, owner="Owner")
        assert str(caught.value) == message
    assert loss_scale_from_argument(0.5).get_scale() == 0.5  # any positive fixed scale


def test_set_state_edges():
    loss_scale = LossScaler(initial_scale=4.0)
    loss_scale.reset_lowest_scale()  # the latch at float32's maximum
    other = LossScaler()
    other.set_state(loss_scale.get_state())  # restores, maximum included
    assert other.get_state()["lowest_scale"] == np.finfo(np.float32).max
    assert other.diagnostics()["lowest_scale"] is None
    with pytest.raises(ValueError, match=r"cannot restore the loss scale: the saved `lowest_scale` is inf"):
        other.set_state({"lowest_scale": np.float32(np.inf)})
    for bad in ("3", 1e30, np.float64(2.0**63), 2.5, np.float32(np.nan)):
        with pytest.raises(ValueError, match=r"counter `skipped_steps`: it must be a non-negative integer"):
            other.set_state({"skipped_steps": bad})
    assert other.diagnostics()["skipped_steps"] == 0
    other.set_state({"skipped_steps": 7.0, "step_count": np.int64(2**63 - 1)})
    assert other.diagnostics()["skipped_steps"] == 7
