"""MixedPrecisionModel on Keras's JAX and torch backends: the scale, the
exact skip and the logs, in an install without TensorFlow; the same tests
on both backends (each backend's own step in `on_jax`, `on_torch`)."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from backend_helpers import data as _data
from backend_helpers import functional as _functional
from backend_helpers import state as _state
from backend_helpers import values as _values
from hypothesis import given, settings
from hypothesis import strategies as st
from scale_reference import ReferenceLossScale, configs

import mp_callbacks as mp
from mp_callbacks import _scale_state
from mp_callbacks.backends.common import step as common_step

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)


def test_a_keras_loss_scale_optimizer_is_unwrapped_and_its_scale_adopted():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(mp.MixedPrecisionModel)
    inner = keras.optimizers.SGD(0.01)
    model.compile(keras.optimizers.LossScaleOptimizer(inner, initial_scale=256.0), "mse")
    assert model.optimizer is inner
    assert model.get_scale() == 256.0


_OUTCOMES = st.sampled_from(["finite", "overflow", "bad_loss"])


@settings(max_examples=30, deadline=None)
@given(config=configs(), outcomes=st.lists(_OUTCOMES, min_size=1, max_size=20))
def test_the_shared_state_machine_matches_the_reference_on_this_backend(config, outcomes):
    settings_ = _scale_state.ScaleSettings.checked(**config)
    reference = ReferenceLossScale(**config)
    state = {
        name: keras.ops.convert_to_tensor(value, spec.dtype)
        for spec in _scale_state.STATE_VARIABLES
        for name, value in [(spec.name, _scale_state.initial_values(settings_)[spec.name])]
    }
    for outcome in outcomes:
        grads = [keras.ops.convert_to_tensor([1.0, math.inf if outcome == "overflow" else 2.0])]
        loss = keras.ops.convert_to_tensor(math.nan if outcome == "bad_loss" else 1.0)
        if outcome == "bad_loss":
            grads = [keras.ops.convert_to_tensor([math.nan, 1.0])]
        checked = common_step.check(grads, loss)
        assert bool(checked.applied) is (outcome == "finite")
        new = _scale_state.transition(settings_, state, checked.flags, checked.applied)
        state = {name: new[name] for name in state}
        reference.step(outcome == "finite", outcome != "bad_loss")
        assert float(state["scale"]) == float(reference.scale)
        assert int(state["good_steps"]) == reference.good_steps
        assert int(state["hysteresis_left"]) == reference.hysteresis_left
    assert int(state["skipped_steps"]) == reference.skipped
    assert int(state["step_count"]) == len(outcomes)


def _optimizer_classes():
    """Every optimizer Keras offers, but the wrappers of other optimizers
    (the loss-scaling one, and MultiOptimizer where Keras has it)."""
    wrappers = {"Optimizer", "LossScaleOptimizer", "MultiOptimizer"}
    classes = []
    for name in dir(keras.optimizers):
        cls = getattr(keras.optimizers, name)
        if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer) and name not in wrappers:
            classes.append(cls)
    return classes


_OPTIMIZERS = _optimizer_classes()


def test_the_sweep_covers_every_optimizer_keras_offers():
    names = {cls.__name__ for cls in _OPTIMIZERS}
    assert {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Lion", "Nadam", "Ftrl"} <= names
    assert len(names) >= 13


@pytest.mark.parametrize("optimizer_class", _OPTIMIZERS, ids=lambda cls: cls.__name__)
def test_every_optimizer_trains_as_stock_in_float32_and_skips_exactly(optimizer_class):
    x, y = _data(16)
    trained = []
    for cls in (keras.Model, mp.MixedPrecisionModel):
        model = _functional(cls)
        model.compile(optimizer_class(learning_rate=0.01), "mse")
        keras.utils.set_random_seed(5)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        trained.append(model)
    stock, ours = (_values(m) for m in trained)
    assert len(ours) == len(stock)
    if optimizer_class.__name__ == "Adagrad":
        # XLA compiles Adagrad's g * g differently once the check reads the
        # gradients too: its accumulators land an ulp off stock, and a
        # bias whose gradient is rounding noise (BatchNormalization removes
        # the mean) follows. Known, and in the backends page.
        for a, b in zip(ours, stock):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    else:
        for a, b in zip(ours, stock):
            np.testing.assert_array_equal(a, b)
    before = _state(trained[1])
    bad = x[:8].copy()
    bad[0, 0] = np.inf
    history = trained[1].fit(bad, y[:8], batch_size=8, epochs=1, verbose=0).history
    after = _state(trained[1])
    assert [p for p in before if not np.array_equal(before[p], after[p])] == []
    assert history["skipped_steps"] == [1.0]


def _conv_model(cls):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.RandomFlip()(inputs)
    h = keras.layers.Conv2D(4, 3)(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.LayerNormalization()(h)
    return cls(inputs, keras.layers.Dense(1, dtype="float32")(h))


def _text_model(cls):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(11, 4)(inputs)
    h = keras.layers.GRU(4, dropout=0.1)(h)
    return cls(inputs, keras.layers.Dense(1, dtype="float32")(h))


@pytest.mark.parametrize("build", [_conv_model, _text_model], ids=["conv", "text"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_layers_with_state_of_their_own_skip_exactly_and_float32_equals_stock(build, policy):
    keras.mixed_precision.set_global_policy(policy)
    rng = np.random.default_rng(1)
    if build is _conv_model:
        x = rng.normal(size=(16, 6, 6, 2)).astype("float32")
    else:
        x = rng.integers(0, 11, size=(16, 5)).astype("int32")
    y = rng.normal(size=(16, 1)).astype("float32")
    models = []
    for cls in (keras.Model, mp.MixedPrecisionModel):
        model = build(cls)
        model.compile(keras.optimizers.Adam(0.01), "mse")
        keras.utils.set_random_seed(9)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        models.append(model)
    if policy == "float32":
        for a, b in zip(_values(models[0]), _values(models[1])):
            np.testing.assert_array_equal(a, b)
    ours = models[1]
    before = _state(ours)
    # A non-finite target: the loss and every gradient are NaN.
    history = ours.fit(x[:8], np.full((8, 1), np.nan, "float32"), batch_size=8, verbose=0).history
    after = _state(ours)
    assert [p for p in before if not np.array_equal(before[p], after[p])] == []
    assert history["skipped_steps"] == [1.0]
    assert ours.loss_scale_state()["nonfinite_loss_steps"] == 1
