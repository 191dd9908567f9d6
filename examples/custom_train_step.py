"""A GAN with its own `train_step`, trained with the model's loss scale.

This is the GAN of Keras's guide "Customizing what happens in `fit()`",
with `keras.Model` replaced by `mp.MixedPrecisionModel` and three lines
changed per optimizer (marked `# mp:`): scale the loss inside the tape,
take the gradients of the scaled loss, and apply them with
`self.scaler.step(...)`, which unscales them and skips the update if
one is not finite. The scale moves once per training step, for both
optimizers together, and every epoch logs `loss_scale`, `grad_norm` and
`skipped_steps` beside the GAN's own losses.

`--poison-step N` puts NaN into the real images of training step N (from
0) to show a skipped step: the weights stay finite and the epoch logs
`skipped_steps: 1`. Offline (built-in data); about a minute on 2 CPU
cores. float16 is emulated on most CPUs, so the models are small.

    python examples/custom_train_step.py --epochs 2 --poison-step 3
"""

from __future__ import annotations

import argparse

import keras
import numpy as np
import tensorflow as tf

import mp_callbacks as mp
from mp_callbacks_bench.data import synthetic_digits

LATENT_DIM = 16


class GAN(mp.MixedPrecisionModel):  # mp: was keras.Model
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)

        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
            scaled_d_loss = self.scaler.scale(d_loss)  # mp: scale the loss
        d_weights = self.discriminator.trainable_weights
        grads = tape.gradient(scaled_d_loss, d_weights)  # mp: of the scaled loss
        self.scaler.step(self.d_optimizer, grads, d_weights, loss=d_loss)  # mp: was apply_gradients

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
            scaled_g_loss = self.scaler.scale(g_loss)  # mp: scale the loss
        g_weights = self.generator.trainable_weights
        grads = tape.gradient(scaled_g_loss, g_weights)  # mp: of the scaled loss
        self.scaler.step(self.g_optimizer, grads, g_weights, loss=g_loss)  # mp: was apply_gradients

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def build_gan(latent_dim: int = LATENT_DIM) -> GAN:
    discriminator = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, strides=2, padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(32, 3, strides=2, padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.GlobalMaxPooling2D(),
            keras.layers.Dense(1, dtype="float32"),  # logits in float32 for the loss
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input((latent_dim,)),
            keras.layers.Dense(7 * 7 * 16),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Reshape((7, 7, 16)),
            keras.layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2DTranspose(16, 4, strides=2, padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(1, 7, padding="same", activation="sigmoid", dtype="float32"),
        ],
        name="generator",
    )
    return GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--policy", default="mixed_float16", choices=mp.POLICIES)
    parser.add_argument(
        "--poison-step",
        type=int,
        default=None,
        help="put NaN into the real images of this training step (from 0)",
    )
    args = parser.parse_args(argv)

    keras.config.set_dtype_policy(args.policy)
    keras.utils.set_random_seed(0)
    images = synthetic_digits(n_train=args.samples, n_test=16).x_train.astype("float32")
    images = images.reshape((-1, 28, 28, 1)) / max(float(images.max()), 1.0)
    if args.poison_step is not None:
        images[args.poison_step * args.batch_size] = np.nan

    gan = build_gan()
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    history = gan.fit(
        images,
        epochs=args.epochs,
        batch_size=args.batch_size,
        shuffle=False,
        verbose=2,
        callbacks=[mp.LossScaleMonitor(), mp.EpochTimer()],
    ).history
    finite = all(np.all(np.isfinite(w)) for w in gan.get_weights())
    print(f"policy: {args.policy}; loss scale {gan.get_scale():g}")
    print(f"skipped steps per epoch: {history['skipped_steps']}")
    print(f"weights finite: {finite}")
    return {"history": history, "weights_finite": finite}


if __name__ == "__main__":
    main()
