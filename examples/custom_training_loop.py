"""The TF 2.x mixed-precision custom training loop, on Keras 3.

The loop is the guide's, unchanged but for where `LossScaleOptimizer` comes
from: on Keras 3, `keras.mixed_precision.LossScaleOptimizer` has no
`get_scaled_loss` / `get_unscaled_gradients` (AttributeError);
`mp_callbacks.LossScaleOptimizer` has them, skips non-finite steps and keeps
the dynamic scale.

Runs offline on the built-in digits (or Keras's MNIST when cached).

    python examples/custom_training_loop.py --epochs 2
"""

from __future__ import annotations

import argparse

import keras
import tensorflow as tf

import mp_callbacks as mp
from mp_callbacks import LossScaleOptimizer
from mp_callbacks_bench.data import mnist_or_synthetic


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="auto", choices=("auto",) + mp.POLICIES)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--train-samples", type=int, default=None)
    args = parser.parse_args(argv)

    policy = mp.recommend_policy() if args.policy == "auto" else args.policy
    keras.mixed_precision.set_global_policy(policy)
    data = mnist_or_synthetic().take(train=args.train_samples)
    print(f"policy: {policy}; data: {data.description}")

    model = keras.Sequential(
        [
            keras.layers.Input(shape=data.input_shape, dtype="float32"),
            keras.layers.Flatten(),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10, activation="softmax", dtype="float32"),
        ]
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    if keras.mixed_precision.global_policy().compute_dtype == "float16":
        optimizer = LossScaleOptimizer(keras.optimizers.Adam())  # dynamic scale
    else:
        # bfloat16 and float32 have float32's range: no scaling (a fixed
        # scale of 1, as MixedPrecisionModel's "auto" chooses), but non-finite
        # steps are still skipped.
        optimizer = LossScaleOptimizer(keras.optimizers.Adam(), dynamic=False, initial_scale=1.0)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            # Scale the loss so that small gradients do not underflow in float16.
            scaled_loss = optimizer.get_scaled_loss(loss)
        # Backpropagate the scaled loss, then unscale the gradients.
        scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    dataset = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
    dataset = dataset.shuffle(len(data.x_train), seed=0).batch(args.batch_size)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    for epoch in range(args.epochs):
        mean_loss = keras.metrics.Mean()
        for x, y in dataset:
            mean_loss.update_state(train_step(x, y))
        accuracy.reset_state()
        accuracy.update_state(data.y_test, model.predict(data.x_test, verbose=0))
        print(
            f"epoch {epoch + 1}: loss {float(mean_loss.result()):.4f}, "
            f"test accuracy {float(accuracy.result()):.3f}, "
            f"loss scale {optimizer.get_scale():g}, "
            f"skipped steps {optimizer.scaler.diagnostics()['skipped_steps']}"
        )
    return {"accuracy": float(accuracy.result()), "loss_scale": optimizer.get_scale()}


if __name__ == "__main__":
    main()
