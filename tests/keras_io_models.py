"""The keras-io examples that write their own `train_step`, adopted as the
README says (lines marked `# mp:`), with tiny layers for float16 on CPU.

* `GuideModel`: "Customizing what happens in fit()", the first custom
  model, unchanged but for its base class (it never scales its loss).
* `GAN`: that guide's GAN: two optimizers, `self.scaler.step`.
* `VAE`: keras-io's VAE: one optimizer, a KL term, a `Sampling` layer
  with a `SeedGenerator`; Keras 3's `self.optimizer.scale_loss`.
* `WGANGP`: keras-io's WGAN-GP: several critic updates per training step
  and a gradient penalty.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

import mp_callbacks as mp


class GuideModel(mp.MixedPrecisionModel):  # mp: was keras.Model
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def guide_model(base=GuideModel, features=4):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32")(hidden)
    return base(inputs, outputs)


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
            scaled_d_loss = self.scaler.scale(d_loss)  # mp
        d_weights = self.discriminator.trainable_weights
        grads = tape.gradient(scaled_d_loss, d_weights)  # mp
        self.scaler.step(self.d_optimizer, grads, d_weights, loss=d_loss)  # mp

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
            scaled_g_loss = self.scaler.scale(g_loss)  # mp
        g_weights = self.generator.trainable_weights
        grads = tape.gradient(scaled_g_loss, g_weights)  # mp
        self.scaler.step(self.g_optimizer, grads, g_weights, loss=g_loss)  # mp
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def gan(features=4, latent_dim=3):
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(4),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(1, dtype="float32"),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input((latent_dim,)),
            keras.layers.Dense(4),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(features, activation="tanh", dtype="float32"),
        ],
        name="generator",
    )
    model = GAN(discriminator, generator, latent_dim)
    model.compile(
        d_optimizer=keras.optimizers.Adam(0.001),
        g_optimizer=keras.optimizers.Adam(0.001),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return model


class Sampling(keras.layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(mp.MixedPrecisionModel):  # mp: was keras.Model
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=-1)
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
            scaled_loss = self.optimizer.scale_loss(total_loss)  # mp
        grads = tape.gradient(scaled_loss, self.trainable_weights)  # mp
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def vae(features=6, latent_dim=2, optimizer=None):
    keras.utils.set_random_seed(0)
    encoder_inputs = keras.Input((features,))
    x = keras.layers.Dense(4, activation="tanh")(encoder_inputs)
    z_mean = keras.layers.Dense(latent_dim, name="z_mean", dtype="float32")(x)
    z_log_var = keras.layers.Dense(latent_dim, name="z_log_var", dtype="float32")(x)
    z = Sampling(dtype="float32")([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input((latent_dim,))
    x = keras.layers.Dense(4, activation="tanh")(latent_inputs)
    decoder_outputs = keras.layers.Dense(features, activation="sigmoid", dtype="float32")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    model = VAE(encoder, decoder)
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01))
    return model


class WGANGP(mp.MixedPrecisionModel):  # mp: was keras.Model
    def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3, gp_weight=10.0):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        alpha = tf.random.uniform([batch_size, 1], 0.0, 1.0)
        diff = fake_images - real_images
        interpolated = real_images + alpha * diff
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(tf.cast(grads, tf.float32)), axis=[1]))
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        for _ in range(self.d_steps):
            random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
            with tf.GradientTape() as tape:
                fake_images = self.generator(random_latent_vectors, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
                scaled_d_loss = self.scaler.scale(d_loss)  # mp
            d_gradient = tape.gradient(scaled_d_loss, self.discriminator.trainable_variables)  # mp
            self.scaler.step(
                self.d_optimizer,
                d_gradient,  # mp
                self.discriminator.trainable_variables,
                loss=d_loss,
            )
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            generated_images = self.generator(random_latent_vectors, training=True)
            gen_img_logits = self.discriminator(generated_images, training=True)
            g_loss = self.g_loss_fn(gen_img_logits)
            scaled_g_loss = self.scaler.scale(g_loss)  # mp
        gen_gradient = tape.gradient(scaled_g_loss, self.generator.trainable_variables)  # mp
        self.scaler.step(
            self.g_optimizer,
            gen_gradient,  # mp
            self.generator.trainable_variables,
            loss=g_loss,
        )
        return {"d_loss": d_loss, "g_loss": g_loss}


def wgan_gp(features=4, latent_dim=3):
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(4),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(1, dtype="float32"),
        ],
        name="critic",
    )
    generator = keras.Sequential(
        [
            keras.Input((latent_dim,)),
            keras.layers.Dense(4),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(features, dtype="float32"),
        ],
        name="generator",
    )
    model = WGANGP(discriminator, generator, latent_dim)
    model.compile(
        d_optimizer=keras.optimizers.Adam(0.0002, beta_1=0.5, beta_2=0.9),
        g_optimizer=keras.optimizers.Adam(0.0002, beta_1=0.5, beta_2=0.9),
        d_loss_fn=lambda real_img, fake_img: tf.reduce_mean(fake_img) - tf.reduce_mean(real_img),
        g_loss_fn=lambda fake_img: -tf.reduce_mean(fake_img),
    )
    return model
