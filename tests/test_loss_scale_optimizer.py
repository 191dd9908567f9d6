"""LossScaleOptimizer: the seed's section 3.4 loop on Keras 3."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import mp_callbacks as mp
from mp_callbacks import LossScaleOptimizer  # the only change to the seed's loop


def _model(units=2):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, name="dense")])


def _seed_train_step(model, optimizer, loss_fn):
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            # Scale the loss so that small gradients do not underflow in float16.
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    return train_step


def test_seed_loop_applies_the_unscaled_gradient_exactly_once():
    model = _model()
    loss_fn = keras.losses.MeanSquaredError()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1.0), initial_scale=2.0**10)
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    y = np.zeros((8, 2), "float32")
    before = [w.numpy().copy() for w in model.trainable_variables]
    with tf.GradientTape() as tape:
        expected_grads = tape.gradient(loss_fn(y, model(x)), model.trainable_variables)
    _seed_train_step(model, optimizer, loss_fn)(x, y)
    for variable, start, grad in zip(model.trainable_variables, before, expected_grads):
        np.testing.assert_allclose(variable.numpy(), start - grad.numpy(), rtol=1e-6, atol=1e-7)
    assert int(optimizer.iterations.numpy()) == 1
    assert optimizer.get_scale() == 2.0**10


def test_seed_loop_under_mixed_float16_skips_overflow_and_learns():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _model()
    loss_fn = keras.losses.MeanSquaredError()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.05), initial_scale=2.0**15, growth_interval=100)
    step = _seed_train_step(model, optimizer, loss_fn)
    x = np.ones((8, 4), "float32")
    y = np.full((8, 2), 0.5, "float32")
    losses = [float(step(x, y)) for _ in range(20)]
    assert losses[-1] < losses[0]
    assert model.layers[0].compute_dtype == "float16"
    # An infinite input makes every gradient non-finite: skipped, scale halved.
    iterations = int(optimizer.iterations.numpy())
    weights = [w.numpy().copy() for w in model.trainable_variables]
    step(np.full((8, 4), math.inf, "float32"), y)
    assert int(optimizer.iterations.numpy()) == iterations
    assert optimizer.get_scale() == 2.0**14
    for variable, before in zip(model.trainable_variables, weights):
        np.testing.assert_array_equal(variable.numpy(), before)


def test_serializes_and_saves_its_scale_with_a_stock_model(tmp_path):
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=512.0, hysteresis=2)
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert isinstance(revived, LossScaleOptimizer)
    assert revived.scaler.get_config() == optimizer.scaler.get_config()
    assert revived.inner_optimizer.get_config() == optimizer.inner_optimizer.get_config()

    model = _model()
    model.compile(optimizer, "mse")
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")
    model.fit(x, y, epochs=1, batch_size=4, verbose=0)
    model.fit(np.full((4, 4), math.inf, "float32"), y[:4], epochs=1, batch_size=4, verbose=0)
    model.fit(np.full((4, 4), math.inf, "float32"), y[:4], epochs=1, batch_size=4, verbose=0)
    assert optimizer.get_scale() == 256.0  # hysteresis 2: the second overflow backs off
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert loaded.optimizer.get_scale() == 256.0
    assert loaded.optimizer.scaler.diagnostics() == optimizer.scaler.diagnostics()


def test_stock_fit_does_not_scale_twice():
    x = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
    y = np.zeros((16, 2), "float32")
    plain, wrapped = _model(), _model()
    plain.compile(keras.optimizers.SGD(0.1), "mse")
    wrapped.compile(LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12), "mse")
    plain.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    wrapped.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), wrapped.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_mixed_precision_model_adopts_its_loss_scale():
    inputs = keras.Input((4,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(2)(inputs))
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    model.compile(optimizer, "mse")
    assert model.scaler is optimizer.scaler
    assert model.optimizer is optimizer  # adopted, so the model trains through it


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="inner_optimizer"):
        LossScaleOptimizer("adam")
    with pytest.raises(TypeError, match="cannot wrap another LossScaleOptimizer"):
        LossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="growth_interval"):
        LossScaleOptimizer(keras.optimizers.SGD(), growth_interval=0)
    with pytest.raises(ValueError, match="clipnorm"):
        LossScaleOptimizer(keras.optimizers.SGD(), clipnorm=1.0)
