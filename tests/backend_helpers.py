"""Models, data and state reads the JAX and torch suites share (no
TensorFlow here: `helpers.py` imports it). Not collected (no test_ prefix)."""

from __future__ import annotations

import keras
import numpy as np

#: The prefix of the loss scale's own variables.
OURS = "mp_loss_scale_"


def data(n=32, features=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, features)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def functional(cls=keras.Model, batch_norm=True, dropout=True, **kwargs):
    """Dense, BatchNormalization, Dropout, a float32 head; seeded."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8)(inputs)
    if batch_norm:
        h = keras.layers.BatchNormalization()(h)
    if dropout:
        h = keras.layers.Dropout(0.2)(h)
    outputs = keras.layers.Dense(1, dtype="float32")(h)
    return cls(inputs, outputs, **kwargs)


def state(model):
    """Every variable of the model and its optimizer but the scale's own,
    by path, as NumPy values."""
    variables = list(model.variables) + list(model.optimizer.variables)
    return {v.path: np.array(v.numpy()) for v in variables if OURS not in v.path}


def values(model):
    """The same, in order (paths differ between two models' names)."""
    return list(state(model).values())


def float8_model(cls=keras.Model):
    """Dense "f8" made float8 (`quantize("float8")`), a float32 head; seeded."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    dense = keras.layers.Dense(8, name="f8")
    outputs = keras.layers.Dense(2, dtype="float32", name="head")(dense(inputs))
    model = cls(inputs, outputs)
    dense.quantize("float8")
    return model


def float8_state(model):
    """A float8 layer's scales and amax histories, by path, in NumPy."""
    return {
        v.path: np.array(v.numpy())
        for v in model.trainable_variables
        if getattr(v, "overwrite_with_gradient", False)
    }
