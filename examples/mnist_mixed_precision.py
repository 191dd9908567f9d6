"""The classic mixed-precision MNIST example, on Keras 3.

784-512-256-10 MLP, float32 softmax output, dtype policy set globally, and
`MixedPrecisionModel` instead of a hand-wrapped `LossScaleOptimizer`: the
model scales the loss itself and reports `loss_scale`, `grad_norm` and
`skipped_steps` every epoch; the three callbacks add `epoch_time`,
`samples_per_sec` and `skipped_steps`, and watch for trouble.

Runs offline: Keras's MNIST when it is already cached, the built-in
synthetic digits otherwise (it says which).

    python examples/mnist_mixed_precision.py                 # policy for this machine
    python examples/mnist_mixed_precision.py --policy mixed_float16 --epochs 5
"""

from __future__ import annotations

import argparse
import logging

import keras

import mp_callbacks as mp
from mp_callbacks_bench.data import mnist_or_synthetic


def build_model(input_shape) -> mp.MixedPrecisionModel:
    inputs = keras.Input(shape=input_shape, dtype="float32")  # inputs stay float32
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(512, activation="relu")(x)
    x = keras.layers.Dense(256, activation="relu")(x)
    # The output layer computes in float32 so the softmax is stable.
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(x)
    return mp.MixedPrecisionModel(inputs, outputs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--policy",
        default="auto",
        choices=("auto",) + mp.POLICIES,
        help="dtype policy; 'auto' asks mp_callbacks.recommend_policy()",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--train-samples", type=int, default=None, help="use only the first N training samples"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    policy = mp.recommend_policy() if args.policy == "auto" else args.policy
    keras.mixed_precision.set_global_policy(policy)
    print(f"policy: {keras.mixed_precision.global_policy().name}")

    data = mnist_or_synthetic().take(train=args.train_samples)
    print(f"data: {data.description}")

    model = build_model(data.input_shape)
    model.compile(
        optimizer=keras.optimizers.Adam(), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    callbacks = [mp.LossScaleMonitor(), mp.NaNGradientMonitor(), mp.EpochTimer()]
    history = model.fit(
        data.x_train,
        data.y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(data.x_test, data.y_test),
        callbacks=callbacks,
        verbose=2,
    )
    final = {key: values[-1] for key, values in history.history.items()}
    print(
        f"loss scale {final['loss_scale']:g}, skipped steps {final['skipped_steps']:g}, "
        f"validation accuracy {final['val_accuracy']:.3f}"
    )
    return final


if __name__ == "__main__":
    main()
