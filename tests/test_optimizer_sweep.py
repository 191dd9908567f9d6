"""Every optimizer Keras offers, and every optimizer feature, in a
`MixedPrecisionModel`: float32 training equal to stock Keras to the last
digit, and under float16 a poisoned batch skipped with every variable (the
model's and the optimizer's: slots, iterations, accumulators, EMA copies)
left as it was. A class that is neither swept nor listed fails the test."""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest

import mp_callbacks as mp

# A sweep of what the installed Keras offers: CI runs it on the oldest Keras too.
pytestmark = [pytest.mark.slow, pytest.mark.sweep]

#: Constructor arguments where the defaults do not fit a tiny model.
_ARGUMENTS: dict[str, dict] = {
    "SGD": {"learning_rate": 0.05, "momentum": 0.9},
    "Muon": {"learning_rate": 0.01},
}

NOT_SWEPT = {
    "Optimizer": "the base class",
    "LossScaleOptimizer": "the loss-scale wrapper itself (tests/test_loss_scale_optimizer.py)",
    "MultiOptimizer": "takes (optimizer, layers) pairs: swept through the optimizers it holds",
}

_OFFERED = sorted(
    name
    for name, cls in inspect.getmembers(keras.optimizers, inspect.isclass)
    if issubclass(cls, keras.optimizers.Optimizer)
)
_SWEEP = [name for name in _OFFERED if name not in NOT_SWEPT]

#: (optimizer, its arguments, compile's arguments) for each feature.
_FEATURES = {
    "gradient_accumulation_steps": ("Adam", {"gradient_accumulation_steps": 2}, {}),
    "use_ema": ("Adam", {"use_ema": True, "ema_overwrite_frequency": 3}, {}),
    "clipnorm": ("Adam", {"clipnorm": 0.1}, {}),
    "global_clipnorm": ("AdamW", {"global_clipnorm": 0.1}, {}),
    "clipvalue": ("SGD", {"clipvalue": 0.01}, {}),
    "loss_scale_factor": ("Adam", {"loss_scale_factor": 128.0}, {}),
    "steps_per_execution": ("Adam", {}, {"steps_per_execution": 2}),
    "jit_compile": ("Adam", {}, {"jit_compile": True}),
}


def test_every_optimizer_keras_offers_is_swept_or_said_why_not():
    assert [name for name in _OFFERED if name not in _SWEEP and name not in NOT_SWEPT] == []


def _build(cls, optimizer: str, arguments: dict, compile_arguments: dict, batch_norm: bool = True):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(2, dtype="float32")(h)
    model = cls(inputs, outputs)
    options = {**_ARGUMENTS.get(optimizer, {}), **arguments}
    model.compile(getattr(keras.optimizers, optimizer)(**options), "mse", **compile_arguments)
    # Built from the initial weights, as MixedPrecisionModel.compile builds
    # it: built inside fit, stock Keras 3.15's ScheduleFreeAdamW copies
    # zeros for the weights into its momentum and loses them.
    model.optimizer.build(model.trainable_variables)
    return model


_X = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
_Y = np.random.default_rng(1).normal(size=(32, 2)).astype("float32")


def _equal_to_stock(optimizer, arguments=None, compile_arguments=None, batch_norm=False):
    keras.mixed_precision.set_global_policy("float32")
    arguments, compile_arguments = arguments or {}, compile_arguments or {}
    ours = _build(mp.MixedPrecisionModel, optimizer, arguments, compile_arguments, batch_norm)
    stock = _build(keras.Model, optimizer, arguments, compile_arguments, batch_norm)
    try:
        stock.fit(_X, _Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    except Exception as error:
        # Stock Keras cannot train with it (Keras 3.10's Muon reads a
        # TensorFlow variable's .path): neither can we, no worse.
        with pytest.raises(type(error)):
            ours.fit(_X, _Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return
    ours.fit(_X, _Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(ours.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)
    inner = ours.optimizer.inner_optimizer if hasattr(ours.optimizer, "inner_optimizer") else ours.optimizer
    for a, b in zip(inner.variables, stock.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _safe_under_float16(optimizer, arguments=None, compile_arguments=None):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _build(mp.MixedPrecisionModel, optimizer, arguments or {}, compile_arguments or {})
    try:
        model.fit(_X, _Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    except Exception as error:  # only where stock Keras fails the same way
        stock = _build(keras.Model, optimizer, arguments or {}, compile_arguments or {})
        with pytest.raises(type(error)):
            stock.fit(_X, _Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return
    before = [v.numpy() for v in model.variables + model.optimizer.variables]
    bad_y = _Y[:16].copy()
    bad_y[3] = np.nan
    # Two steps, both poisoned (steps_per_execution runs them in one call).
    history = model.fit(_X[:16], np.concatenate([bad_y[:8], bad_y[:8]]), batch_size=8, verbose=0).history
    assert history["skipped_steps"] == [2.0]
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer", _SWEEP)
def test_every_optimizer_trains_as_stock_in_float32(optimizer):
    _equal_to_stock(optimizer)


@pytest.mark.parametrize("optimizer", _SWEEP)
def test_every_optimizer_skips_a_poisoned_step_with_all_state_kept(optimizer):
    _safe_under_float16(optimizer)


@pytest.mark.parametrize("feature", sorted(_FEATURES))
def test_every_optimizer_feature_trains_as_stock_in_float32(feature):
    _equal_to_stock(*_FEATURES[feature])


@pytest.mark.parametrize("feature", sorted(_FEATURES))
def test_every_optimizer_feature_skips_a_poisoned_step_with_all_state_kept(feature):
    _safe_under_float16(*_FEATURES[feature])


@pytest.mark.xfail(
    strict=True,
    reason="open: with BatchNormalization, TensorFlow's Grappler arithmetic optimizer rewrites "
    "gamma's gradient differently once the gradients have a second consumer (our one-pass check): "
    "one ulp, which SGD shows (Adam's first steps hide it). A stock loop that adds tf.nn.l2_loss of "
    "its gradients differs from stock the same way; equal with arithmetic_optimization off.",
)
def test_sgd_with_batch_normalization_trains_as_stock_to_the_last_digit():
    _equal_to_stock("SGD", batch_norm=True)
