"""Small models and data used by several test modules."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import mp_callbacks as mp


def overflowing_classifier(loss_scale="auto", seed: int = 0):
    """tiny_classifier's layers with NaN zeroed after the hidden Dense, so
    that a NaN input row gives a finite loss and NaN gradients: an overflow,
    which the scale backs off for, on every CPU. Through TensorFlow's plain
    ReLU the loss itself is NaN on some CPUs (an AMD EPYC without AVX-512)
    and finite on others, and a NaN loss is bad data, which keeps the scale."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    hidden = keras.layers.Lambda(lambda h: keras.ops.relu(keras.ops.where(keras.ops.isnan(h), 0.0, h)))(
        hidden
    )
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32", name="head")(hidden)
    return mp.MixedPrecisionModel(inputs, outputs, loss_scale=loss_scale)


def tiny_classifier(
    units: int = 4,
    features: int = 6,
    classes: int = 3,
    loss_scale="auto",
    seed: int = 0,
    cls=None,
):
    """A functional MixedPrecisionModel small enough for float16 on CPU."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(units, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(classes, activation="softmax", dtype="float32", name="head")(hidden)
    if cls is None:
        return mp.MixedPrecisionModel(inputs, outputs, loss_scale=loss_scale)
    return cls(inputs, outputs)


def classification_data(n: int = 64, features: int = 6, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x[:, :classes].argmax(axis=1)).astype("int64")
    return x, y


@keras.saving.register_keras_serializable(package="mp_callbacks_tests")
class NaNGradientDense(keras.layers.Layer):
    """A Dense layer whose kernel gradient is NaN; its inputs' gradient is fine.

    Used to check that diagnostics name this layer's kernel and nothing else.
    """

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], self.units), initializer="glorot_uniform", name="kernel"
        )

    def call(self, inputs):
        @tf.custom_gradient
        def poisoned_matmul(x, kernel):
            def grad(upstream):
                grad_x = tf.matmul(upstream, tf.transpose(kernel))
                grad_kernel = tf.fill(tf.shape(kernel), tf.constant(np.nan, kernel.dtype))
                return grad_x, grad_kernel

            return tf.matmul(x, kernel), grad

        kernel = tf.cast(self.kernel, self.compute_dtype)
        return poisoned_matmul(tf.cast(inputs, self.compute_dtype), kernel)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def poisoned_model(loss_scale=None):
    """clean -> poisoned -> head, compiled: only poisoned/kernel gets NaN gradients."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, activation="relu", name="clean")(inputs)
    hidden = NaNGradientDense(4, name="poisoned")(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=loss_scale)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
