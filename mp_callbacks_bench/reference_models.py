"""The two reference models of `mp-callbacks bench` and the benchmarks.

`mlp` is the classic MNIST 784-512-256-10 network; `cnn` a small
convolutional net, where mixed precision pays most. Both end in a float32
softmax, as mixed precision requires.
"""

from __future__ import annotations

from collections.abc import Callable

import keras

import mp_callbacks  # noqa: F401  (checks Keras's backend before Keras loads)
from mp_callbacks import MixedPrecisionModel

__all__ = ["MODELS", "build_cnn", "build_mlp"]


def build_mlp(
    input_shape: tuple[int, ...],
    num_classes: int = 10,
    model_class: type = MixedPrecisionModel,
    **model_kwargs,
) -> keras.Model:
    """The classic MNIST MLP: Flatten, Dense 512, Dense 256, float32 softmax."""
    inputs = keras.Input(shape=input_shape, dtype="float32")
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(512, activation="relu")(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(x)
    return model_class(inputs, outputs, name="mlp", **model_kwargs)


def build_cnn(
    input_shape: tuple[int, ...],
    num_classes: int = 10,
    model_class: type = MixedPrecisionModel,
    **model_kwargs,
) -> keras.Model:
    """Two conv blocks (32 and 64 filters), Dense 128, float32 softmax."""
    if len(input_shape) not in (2, 3):
        raise ValueError(
            "the cnn model needs image samples of shape (height, width) or "
            f"(height, width, channels); got samples of shape {input_shape}."
        )
    inputs = keras.Input(shape=input_shape, dtype="float32")
    x = inputs
    if len(input_shape) == 2:
        x = keras.layers.Reshape((*input_shape, 1))(x)
    x = keras.layers.Conv2D(32, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(128, activation="relu")(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(x)
    return model_class(inputs, outputs, name="cnn", **model_kwargs)


MODELS: dict[str, Callable[..., keras.Model]] = {"mlp": build_mlp, "cnn": build_cnn}
