"""LossScaler: the state machine against a pure-Python reference."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from scale_reference import ReferenceLossScale, configs

from mp_callbacks import LossScaler


def _step(loss_scale, optimizer, variable, finite: bool, loss_finite: bool = True):
    grad = tf.constant([1.0, 2.0]) if finite else tf.constant([1.0, math.inf])
    loss = tf.constant(1.0 if loss_finite else math.nan)
    return bool(loss_scale.apply_gradients(optimizer, [grad], [variable], loss=loss))


# A step: gradients finite, gradients overflowing, or a non-finite loss
# (bad data, whatever the gradients).
_OUTCOMES = st.sampled_from(["finite", "overflow", "bad_loss"])


@settings(max_examples=40, deadline=None)
@given(config=configs(), outcomes=st.lists(_OUTCOMES, min_size=1, max_size=30))
def test_state_machine_matches_reference(config, outcomes):
    loss_scale = LossScaler(**config)
    reference = ReferenceLossScale(**config)
    variable = tf.Variable([0.0, 0.0])
    optimizer = keras.optimizers.SGD(learning_rate=0.5)
    finite_steps = [outcome == "finite" for outcome in outcomes]
    for outcome in outcomes:
        finite, loss_finite = outcome == "finite", outcome != "bad_loss"
        applied = _step(loss_scale, optimizer, variable, finite, loss_finite)
        reference.step(finite, loss_finite)
        assert applied is finite
        state = loss_scale.diagnostics()
        assert state["scale"] == pytest.approx(float(reference.scale), rel=0, abs=0)
        assert state["good_steps"] == reference.good_steps
        assert state["hysteresis_left"] == reference.hysteresis_left
        assert config["min_scale"] <= state["scale"] <= config["max_scale"]
    assert state["skipped_steps"] == reference.skipped
    assert state["step_count"] == len(outcomes)
    assert state["nonfinite_loss_steps"] == outcomes.count("bad_loss")
    # The optimizer only ever saw the applied steps.
    applied_steps = sum(finite_steps)
    assert int(optimizer.iterations.numpy()) == applied_steps
    np.testing.assert_allclose(variable.numpy(), [-0.5 * applied_steps, -1.0 * applied_steps])


def test_grows_exactly_after_growth_interval_clean_steps():
    loss_scale = LossScaler(initial_scale=8.0, growth_interval=3)
    variable = tf.Variable([0.0, 0.0])
    optimizer = keras.optimizers.SGD(0.1)
    scales = []
    for _ in range(7):
        _step(loss_scale, optimizer, variable, True)
        scales.append(loss_scale.get_scale())
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_hysteresis_tolerates_overflows_before_backing_off():
    loss_scale = LossScaler(initial_scale=64.0, hysteresis=3, growth_interval=100)
    variable = tf.Variable([0.0, 0.0])
    optimizer = keras.optimizers.SGD(0.1)
    scales = []
    for _ in range(4):
        _step(loss_scale, optimizer, variable, False)
        scales.append(loss_scale.get_scale())
    # Two overflows tolerated, the third backs off, and so does every later one.
    assert scales == [64.0, 64.0, 32.0, 16.0]
    assert int(optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(variable.numpy(), [0.0, 0.0])


def test_scale_never_leaves_its_bounds():
    loss_scale = LossScaler(initial_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=1)
    variable = tf.Variable([0.0, 0.0])
    optimizer = keras.optimizers.SGD(0.1)
    for _ in range(5):
        _step(loss_scale, optimizer, variable, True)
    assert loss_scale.get_scale() == 8.0
    for _ in range(5):
        _step(loss_scale, optimizer, variable, False)
    assert loss_scale.get_scale() == 2.0


def test_fixed_and_disabled_scales_still_skip_nonfinite_steps():
    for loss_scale, expected in ((LossScaler.fixed(128.0), 128.0), (LossScaler.disabled(), 1.0)):
        variable = tf.Variable([0.0, 0.0])
        optimizer = keras.optimizers.SGD(0.1)
        assert not _step(loss_scale, optimizer, variable, False)
        assert _step(loss_scale, optimizer, variable, True)
        assert loss_scale.get_scale() == expected
        assert not loss_scale.is_dynamic
        np.testing.assert_allclose(variable.numpy(), [-0.1, -0.2])
    assert not LossScaler.disabled().scaling_active
    assert LossScaler.fixed(2.0).scaling_active
    loss = tf.constant(3.0)
    assert LossScaler.disabled().scale(loss) is loss


@settings(max_examples=25, deadline=None)
@given(
    exponent=st.integers(0, 24),
    values=st.lists(
        # TensorFlow flushes float32 subnormals to zero on CPU.
        st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False, width=32),
        min_size=1,
        max_size=8,
    ),
)
def test_unscale_inverts_scale_for_powers_of_two(exponent, values):
    loss_scale = LossScaler(initial_scale=2.0**exponent)
    grads = [tf.constant(values), None]
    scaled = [g * loss_scale.get_scale() if g is not None else None for g in grads]
    unscaled = loss_scale.unscale(scaled)
    assert unscaled[1] is None
    np.testing.assert_array_equal(unscaled[0].numpy(), np.float32(values))
    assert float(loss_scale.scale(tf.constant(1.5))) == 1.5 * 2.0**exponent


def test_unscale_handles_indexed_slices():
    loss_scale = LossScaler(initial_scale=4.0)
    grad = tf.IndexedSlices(tf.constant([[4.0, 8.0]]), tf.constant([1]), tf.constant([3, 2]))
    (unscaled,) = loss_scale.unscale([grad])
    assert isinstance(unscaled, tf.IndexedSlices)
    np.testing.assert_array_equal(unscaled.values.numpy(), [[1.0, 2.0]])
    assert unscaled.indices.numpy().tolist() == [1]
    assert unscaled.dense_shape.numpy().tolist() == [3, 2]


def test_unscale_with_plain_tf_variables_divides_every_gradient():
    """Only variables that say `overwrite_with_gradient` keep their gradient
    as it is; a plain tf.Variable has no such attribute."""
    loss_scale = LossScaler(initial_scale=4.0)
    variables = [tf.Variable([0.0]), tf.Variable([0.0, 0.0])]
    unscaled = loss_scale.unscale([tf.constant([4.0]), tf.constant([8.0, -4.0])], variables)
    assert [g.numpy().tolist() for g in unscaled] == [[1.0], [2.0, -1.0]]


def test_check_gradients_of_no_gradients_is_healthy_and_empty():
    checked = LossScaler().check_gradients([])
    assert checked.flags.dtype == tf.int64 and checked.flags.shape == (0,)
    assert checked.global_norm.dtype == tf.float32 and float(checked.global_norm) == 0.0
    assert bool(checked.all_finite) is True


def test_check_gradients_norm_and_flags_over_dense_sparse_float16_and_missing_gradients():
    """The norm of sparse gradients is over their values, as in TensorFlow's
    global_norm (a repeated row counts twice, never scattered to dense), and
    float16 gradients are squared in float32: 300**2 overflows float16."""
    loss_scale = LossScaler()
    repeated_row = tf.IndexedSlices(
        tf.constant([[1.0, 2.0], [1.0, 2.0]]), tf.constant([1, 1]), tf.constant([3, 2])
    )
    grads = [tf.constant([3.0, 4.0]), repeated_row, tf.constant([300.0], tf.float16), None]
    checked = loss_scale.check_gradients(grads)
    assert checked.flags.numpy().tolist() == [0, 0, 0, 0]
    assert float(checked.global_norm) == pytest.approx(np.sqrt(9 + 16 + 10 + 90000), rel=1e-6)
    poisoned = tf.IndexedSlices(tf.constant([[1.0, np.inf]]), tf.constant([2]), tf.constant([3, 2]))
    checked = loss_scale.check_gradients([grads[0], poisoned, grads[2], None])
    assert checked.flags.numpy().tolist() == [0, 1, 0, 0]


def test_nonfinite_loss_and_floor_overflows_count_as_divergence():
    loss_scale = LossScaler(initial_scale=2.0, min_scale=1.0, growth_interval=100)
    variable = tf.Variable([0.0, 0.0])
    optimizer = keras.optimizers.SGD(0.1)
    _step(loss_scale, optimizer, variable, False)  # 2 -> 1: handled by scaling
    assert loss_scale.diagnostics()["divergent_run"] == 0
    _step(loss_scale, optimizer, variable, False)  # at the floor: divergent
    _step(loss_scale, optimizer, variable, False)
    assert loss_scale.diagnostics()["divergent_run"] == 2
    # A non-finite loss is divergence even when the gradients are finite.
    loss_scale.apply_gradients(optimizer, [tf.constant([1.0, 1.0])], [variable], loss=tf.constant(math.nan))
    state = loss_scale.diagnostics()
    assert state["divergent_run"] == 3 and state["nonfinite_loss_steps"] == 1
    assert state["scale"] == 1.0
    _step(loss_scale, optimizer, variable, True)
    state = loss_scale.diagnostics()
    assert state["divergent_run"] == 0 and state["max_divergent_run"] == 3
    loss_scale.reset_max_divergent_run()
    assert loss_scale.diagnostics()["max_divergent_run"] == 0


def test_a_nonfinite_loss_is_skipped_without_backing_off_the_scale():
    # Bad data over many steps (5 % of the batches) must not collapse the
    # scale: the loss is computed before it is scaled. Overflowing gradients
    # with a finite loss still back it off.
    loss_scale = LossScaler(initial_scale=2.0**15, growth_interval=1000)
    variable = tf.Variable([0.0, 0.0])
    optimizer = keras.optimizers.SGD(0.01)
    for step in range(200):
        _step(loss_scale, optimizer, variable, finite=step % 20 != 0, loss_finite=step % 20 != 0)
    state = loss_scale.diagnostics()
    assert state["scale"] == 2.0**15
    assert state["skipped_steps"] == state["nonfinite_loss_steps"] == 10
    assert state["good_steps"] == 190  # the bad steps neither count nor reset the run
    _step(loss_scale, optimizer, variable, finite=False, loss_finite=True)
    assert loss_scale.diagnostics()["scale"] == 2.0**14


def test_per_variable_counts_name_the_nonfinite_variable():
    loss_scale = LossScaler()
    good, bad = tf.Variable([0.0], name="good"), tf.Variable([0.0], name="bad")
    optimizer = keras.optimizers.SGD(0.1)
    for _ in range(3):
        loss_scale.apply_gradients(optimizer, [tf.constant([1.0]), tf.constant([math.nan])], [good, bad])
    counts = loss_scale.nonfinite_gradient_counts()
    assert list(counts.values()) == [0, 3]
    assert list(counts)[1].startswith("bad")
    # The loss flag is the last one, not a variable's: no loss was given.
    assert loss_scale.diagnostics()["nonfinite_loss_steps"] == 0


def test_a_call_with_more_variables_extends_the_counts_once_per_variable():
    # The counters are built on the first call; a later call that brings a
    # known variable and a new one adds only the new one.
    loss_scale = LossScaler()
    first, second = tf.Variable([0.0], name="first"), tf.Variable([0.0], name="second")
    optimizer = keras.optimizers.SGD(0.1)
    loss_scale.apply_gradients(optimizer, [tf.constant([math.nan])], [first])
    loss_scale.apply_gradients(optimizer, [tf.constant([1.0]), tf.constant([math.nan])], [first, second])
    counts = loss_scale.nonfinite_gradient_counts()
    assert [name.split(":")[0] for name in counts] == ["first", "second"]
    assert list(counts.values()) == [1, 1]


@pytest.mark.parametrize("traced", [False, True], ids=["eager (tf.cond)", "tf.function (gated)"])
def test_restore_on_skip_is_assigned_on_a_skipped_step_only(traced):
    loss_scale = LossScaler(initial_scale=4.0)
    weight = tf.Variable([1.0], name="weight")
    statistic = tf.Variable([7.0], name="statistic")  # changed by a forward pass
    optimizer = keras.optimizers.SGD(0.5)
    optimizer.build([weight])

    def step(grad):
        statistic.assign([9.0])
        return loss_scale.apply_gradients(
            optimizer, [grad], [weight], restore_on_skip=[(statistic, tf.constant([7.0]))]
        )

    step = tf.function(step) if traced else step
    assert not bool(step(tf.constant([math.nan])))
    assert (weight.numpy().tolist(), statistic.numpy().tolist()) == ([1.0], [7.0])
    assert bool(step(tf.constant([1.0])))
    assert (weight.numpy().tolist(), statistic.numpy().tolist()) == ([0.5], [9.0])


def test_calls_with_some_of_the_variables_in_any_order_count_the_right_ones():
    loss_scale = LossScaler()
    a, b, c = (tf.Variable([0.0], name=name) for name in "abc")
    loss_scale.build([a, b, c])
    optimizer = keras.optimizers.SGD(0.1)
    nan, one = tf.constant([math.nan]), tf.constant([1.0])

    def counts():
        return list(loss_scale.nonfinite_gradient_counts().values())

    # A subset, reordered, with a non-finite loss.
    loss_scale.apply_gradients(optimizer, [nan, one], [c, a], loss=math.nan)
    assert counts() == [0, 0, 1]
    assert loss_scale.diagnostics()["nonfinite_loss_steps"] == 1
    # A leading subset.
    loss_scale.apply_gradients(optimizer, [one, nan], [a, b])
    assert counts() == [0, 1, 1]
    # All of them, every one out of place.
    loss_scale.apply_gradients(optimizer, [one, one, nan], [b, c, a])
    assert counts() == [1, 1, 1]
    assert loss_scale.diagnostics()["nonfinite_loss_steps"] == 1


def test_update_counts_a_non_finite_loss_of_any_optimizer():
    # Two optimizers, one update(): the step's loss is non-finite if either
    # optimizer's loss was; their gradients were finite, so nothing is skipped.
    loss_scale = LossScaler()
    a, b, c = (tf.Variable([0.0], name=name) for name in "abc")
    loss_scale.build([a, b, c])
    first, second = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    one = tf.constant([1.0])
    loss_scale.apply_gradients(first, [one, one], [a, b], loss=math.nan, update=False)
    loss_scale.apply_gradients(second, [one], [c], loss=1.0, update=False)
    loss_scale.update()
    state = loss_scale.diagnostics()
    assert (state["nonfinite_loss_steps"], state["skipped_steps"], state["step_count"]) == (1, 0, 1)


def test_a_variable_counts_once_per_step_however_many_replicas_overflowed():
    """Under tf.distribute the flags arrive summed over the replicas: two
    replicas with a non-finite gradient for one variable still make one
    non-finite step for it."""
    loss_scale = LossScaler()
    loss_scale.build([tf.Variable([0.0], name="first"), tf.Variable([0.0], name="second")])
    loss_scale._update_state(tf.constant([2, 0, 0], tf.int64))
    assert list(loss_scale.nonfinite_gradient_counts().values()) == [1, 0]
    assert loss_scale.diagnostics()["skipped_steps"] == 1


def test_works_inside_tf_function():
    loss_scale = LossScaler(initial_scale=2.0**10, growth_interval=2)
    variable = tf.Variable([1.0, 1.0])
    optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def train_step(target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((variable - target) ** 2)
            scaled = loss_scale.scale(loss)
        grads = loss_scale.unscale(tape.gradient(scaled, [variable]))
        return loss_scale.apply_gradients(optimizer, grads, [variable], loss=loss)

    assert bool(train_step(tf.constant([0.0, 0.0])))
    assert bool(train_step(tf.constant([0.0, 0.0])))
    assert not bool(train_step(tf.constant([math.inf, 0.0])))
    np.testing.assert_allclose(variable.numpy(), [0.64, 0.64], rtol=1e-6)
    # Grew to 2**11; the inf target makes the loss itself inf: bad data,
    # skipped without backing off.
    assert loss_scale.get_scale() == 2.0**11


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"initial_scale": 0.0}, "initial_scale"),
        ({"initial_scale": -1.0}, "initial_scale"),
        ({"initial_scale": math.inf}, "initial_scale"),
        ({"initial_scale": math.nan}, "initial_scale"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 1.5}, "growth_interval"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"min_scale": 4.0, "max_scale": 2.0, "initial_scale": 3.0}, "min_scale"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"initial_scale": 2.0**30}, "initial_scale"),
        ({"initial_scale": 0.5}, "initial_scale"),
    ],
)
def test_bad_config_names_argument_and_value(kwargs, argument):
    with pytest.raises((ValueError, TypeError)) as error:
        LossScaler(**kwargs)
    message = str(error.value)
    assert f"`{argument}`" in message
    assert f"{argument}={kwargs[argument]!r}" in message


def test_config_round_trip_and_keras_serialization():
    original = LossScaler(
        initial_scale=256.0,
        growth_interval=7,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=2.0**20,
        hysteresis=2,
    )
    clone = LossScaler.from_config(original.get_config())
    assert clone.get_config() == original.get_config()
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(original))
    assert isinstance(revived, LossScaler)
    assert revived.get_config() == original.get_config()


def test_tf_checkpoint_round_trip(tmp_path):
    loss_scale = LossScaler(initial_scale=1024.0)
    variable = tf.Variable([0.0, 0.0])
    optimizer = keras.optimizers.SGD(0.1)
    _step(loss_scale, optimizer, variable, False)
    _step(loss_scale, optimizer, variable, True)
    path = tf.train.Checkpoint(loss_scale=loss_scale).save(str(tmp_path / "ckpt"))
    restored = LossScaler(initial_scale=1024.0)
    tf.train.Checkpoint(loss_scale=restored).restore(path).assert_existing_objects_matched()
    assert restored.get_scale() == 512.0
    assert restored.diagnostics()["good_steps"] == 1
    assert restored.diagnostics()["skipped_steps"] == 1


@settings(max_examples=12, deadline=None)
@given(
    units=st.integers(1, 4),
    batch=st.integers(1, 6),
    exponent=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_scaled_then_unscaled_gradients_match_float32_gradients(units, batch, exponent, seed):
    """On random small models and inputs: float32 gradients, the same model's
    scaled-then-unscaled gradients, and a mixed_float16 copy's."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, 3)).astype("float32")
    y = rng.normal(size=(batch, 2)).astype("float32")

    def build(policy):
        keras.config.set_dtype_policy(policy)
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(units, activation="tanh")(inputs)
        outputs = keras.layers.Dense(2, dtype="float32")(hidden)
        return keras.Model(inputs, outputs)

    reference, half = build("float32"), build("mixed_float16")
    keras.config.set_dtype_policy("float32")
    half.set_weights(reference.get_weights())
    loss_scale = LossScaler(initial_scale=2.0**exponent)

    def gradients(model, scaled):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            target = loss_scale.scale(loss) if scaled else loss
        grads = tape.gradient(target, model.trainable_variables)
        return loss_scale.unscale(grads) if scaled else grads

    expected = gradients(reference, scaled=False)
    for got, want in zip(gradients(reference, scaled=True), expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
    half_grads = [g.numpy() for g in gradients(half, scaled=True)]
    if not all(np.all(np.isfinite(g)) for g in half_grads):
        # float16 overflowed under a large scale: exactly the step that
        # apply_gradients skips and backs off from.
        assert exponent > 8
        return
    # float16 rounding is relative to the terms a gradient sums, not to the
    # sum: a small bias gradient that is a difference of large terms can be
    # 5 % off alone. So the tolerance is 2 % of the model's largest gradient.
    scale = max(float(np.abs(want.numpy()).max()) for want in expected) + 1e-3
    for got, want in zip(half_grads, expected):
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-2 * scale)
