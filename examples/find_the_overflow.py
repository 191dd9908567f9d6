"""Find the layer where float16 overflows, apply the advice, train on.

A small classifier under `mixed_float16` with a softmax written by hand, as
in many custom attention and pooling layers: `exp(x) / sum(exp(x))`, without
subtracting the maximum first. `exp` leaves float16's range (largest finite
value 65504) once x passes 11.1 (float32 holds up to 88.7), the loss goes
NaN, and `NaNGradientMonitor` stops training with an error that names that
weightless layer: it replays the batch of the last skipped step layer by
layer. `with_float32_layers` then makes a copy that computes that layer in
float32, with the same weights, and the copy trains without a skipped step.

    python examples/find_the_overflow.py
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import mp_callbacks as mp

FEATURES, CLASSES = 16, 4


@keras.saving.register_keras_serializable(package="find_the_overflow")
class NaiveSoftmax(keras.layers.Layer):
    """exp(x) / sum(exp(x)) over the last axis (weightless; no max shift)."""

    def call(self, inputs):
        exponentials = keras.ops.exp(inputs)
        return exponentials / keras.ops.sum(exponentials, axis=-1, keepdims=True)


def make_data(samples: int, seed: int = 0):
    """Features whose class is the largest of the first four."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 5.0, size=(samples, FEATURES)).astype("float32")
    return x, np.argmax(x[:, :CLASSES], axis=1).astype("int64")


def build_model() -> mp.MixedPrecisionModel:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    scores = keras.layers.Dense(32, name="scores")(inputs)
    weights = NaiveSoftmax(name="naive_softmax")(scores)
    hidden = keras.layers.Dense(32, activation="relu", name="dense")(weights)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32", name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.simplefilter("ignore", mp.MixedPrecisionWarning)  # check_model's sizing hints

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = make_data(args.samples)
    model = build_model()
    monitor = mp.NaNGradientMonitor(patience=3, action="raise", check_every=1)
    print("1. training in mixed_float16")
    try:
        model.fit(x, y, batch_size=32, epochs=args.epochs, verbose=0, callbacks=[monitor])
        print("   no divergence: nothing to fix")
        return
    except mp.NonFiniteGradientError as error:
        print(f"   NonFiniteGradientError: {error}")
        print(f"   origin: {error.origin!r}")
        report = error.report
    print("\n2. the replayed batch, layer by layer\n")
    print("   " + str(report).replace("\n", "\n   "))

    print(f"\n3. the fix in one line: mp.with_float32_layers(model, {report.float32_layers!r})")
    fixed = mp.with_float32_layers(model, report.float32_layers)
    history = fixed.fit(
        x, y, batch_size=32, epochs=args.epochs, verbose=0, callbacks=[mp.NaNGradientMonitor(action="raise")]
    )
    print(f"   skipped steps per epoch: {history.history['skipped_steps']}")
    print(f"   accuracy per epoch: {[round(a, 3) for a in history.history['accuracy']]}")
    print(f"   loss scale: {fixed.get_scale():g}")


if __name__ == "__main__":
    main()
