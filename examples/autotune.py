"""A measured precision plan for a model with two precision traps.

The model has a softmax written by hand (`exp(x) / sum(exp(x))`, which
overflows float16 once x passes 11) and a variance written by hand
(`E[x^2] - E[x]^2`, which bfloat16's 8-bit mantissa cancels to noise on
features with a large mean). `mp.autotune` finds, on the model's own data,
which layer each policy needs in float32, then trains the candidate plans
and float32 side by side (each in its own process, from the same weights,
on the same batches) and keeps the fastest plan that is clearly faster
and as accurate; on a machine where no mixed policy is faster, that is
float32, with the reasons.

`--policies mixed_float16 mixed_bfloat16` makes the plan for those
policies on any machine (to prepare a GPU run on a laptop): the speed
measured here is reported beside it without deciding. Offline; about a
minute on 2 CPU cores.

    python examples/autotune.py --policies mixed_float16 mixed_bfloat16
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


@keras.saving.register_keras_serializable(package="autotune_example")
class NaiveSoftmax(keras.layers.Layer):
    """exp(x) / sum(exp(x)) over the last axis, without the max shift."""

    def call(self, inputs):
        exponentials = keras.ops.exp(inputs)
        return exponentials / keras.ops.sum(exponentials, axis=-1, keepdims=True)


@keras.saving.register_keras_serializable(package="autotune_example")
class Variance(keras.layers.Layer):
    """E[x^2] - E[x]^2 over the last axis, written by hand."""

    def call(self, x):
        mean = keras.ops.mean(x, axis=-1, keepdims=True)
        return keras.ops.mean(x * x, axis=-1, keepdims=True) - mean * mean


def build_model() -> keras.Model:
    """Called once per candidate, after its dtype policy is set."""
    inputs = keras.Input((FEATURES,), name="readings")
    spread = Variance(name="variance")(inputs)
    centred = keras.layers.Normalization(mean=1000.0, variance=100.0, name="centre")(inputs)
    scores = keras.layers.Dense(32, name="scores")(centred)
    scores = keras.layers.Rescaling(6.0, name="sharpen")(scores)  # attention logits of about 20
    attention = NaiveSoftmax(name="naive_softmax")(scores)
    hidden = keras.layers.Dense(32, activation="relu", name="dense")(
        keras.layers.Concatenate(name="features")([attention, centred, spread])
    )
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32", name="head")(hidden)
    model = keras.Model(inputs, outputs, name="two_traps")
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def make_data(samples: int, seed: int = 0):
    """Readings around 1000 whose class is the largest of the first four."""
    rng = np.random.default_rng(seed)
    x = (1000.0 + rng.normal(0.0, 10.0, size=(samples, FEATURES))).astype("float32")
    return x, np.argmax(x[:, :CLASSES], axis=1).astype("int64")


def main(argv=None) -> mp.PrecisionPlan:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=None, choices=mp.POLICIES)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", default=None, help="write the plan here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("mp_callbacks.autotune").setLevel(logging.INFO)
    warnings.simplefilter("ignore", mp.MixedPrecisionWarning)

    x, y = make_data(args.samples)
    plan = mp.autotune(build_model, x, y, policies=args.policies, steps=args.steps, batch_size=64)
    print(plan)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(plan.to_json())
    return plan


if __name__ == "__main__":
    main()
