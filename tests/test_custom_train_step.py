"""Existing Keras code as it is written: the keras-io examples with their
own `train_step` (a GAN, a VAE, a WGAN-GP, the guide's first custom model)
as `MixedPrecisionModel` subclasses, a hand-written recipe under Keras's
automatic wrapping, functional subclasses, sparse and ragged inputs."""

from __future__ import annotations

import warnings
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras_io_models import GuideModel, gan, guide_model, vae, wgan_gp

import mp_callbacks as mp

POISONED_STEP = 2  # of 4 steps of 8 samples


class BatchLogs(keras.callbacks.Callback):
    """Every batch's logs (Keras reports the epoch's running values)."""

    def on_train_begin(self, logs=None):
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in (logs or {}).items()})


def _poisoned(features, seed=0):
    data = np.random.default_rng(seed).normal(size=(32, features)).astype("float32")
    data[POISONED_STEP * 8] = np.nan
    return data


def _finite(model):
    return all(np.all(np.isfinite(w)) for w in model.get_weights())


def _fit(model, *data, monitors=(), epochs=1):
    batches = BatchLogs()
    history = model.fit(
        *data, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[batches, *monitors]
    ).history
    return history, [logs["skipped_steps"] for logs in batches.logs]


# ------------------------------------------------------- keras-io patterns
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_gan_skips_the_poisoned_step_for_the_discriminator_only(jit_compile):
    keras.config.set_dtype_policy("mixed_float16")
    model = gan()
    model.jit_compile = jit_compile  # under XLA each optimizer's update is skipped by a cond
    history, skipped = _fit(model, _poisoned(4), monitors=[mp.LossScaleMonitor(max_skipped_fraction=1)])
    assert model.generator.layers[0].compute_dtype == "float16"
    assert _finite(model)
    assert skipped == [0.0, 0.0, 1.0, 1.0]  # counted at the poisoned step
    assert history["skipped_steps"] == [1.0]
    state = model.scaler.diagnostics()
    assert state["step_count"] == 4 and state["skipped_steps"] == 1  # one update per step
    # The poisoned input makes the loss NaN: bad data, skipped for both
    # optimizers without backing the scale off.
    assert history["loss_scale"] == [2.0**15]
    # Real images reach the discriminator's update only.
    assert int(model.d_optimizer.iterations.numpy()) == 3
    assert int(model.g_optimizer.iterations.numpy()) == 4
    assert np.isfinite(history["grad_norm"][0]) and history["grad_norm"][0] > 0


def test_vae_with_keras_3s_scale_loss_skips_the_poisoned_step():
    keras.config.set_dtype_policy("mixed_float16")
    model = vae()
    data = np.abs(_poisoned(6)) / 4.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history, skipped = _fit(model, data)
    assert not [w for w in caught if "never scales its loss" in str(w.message)]
    assert _finite(model)
    assert skipped == [0.0, 0.0, 1.0, 1.0]
    assert history["loss_scale"] == [2.0**15]  # a NaN loss (bad data) does not back off
    assert int(model.optimizer.iterations.numpy()) == 3
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


@pytest.mark.slow
def test_wgan_gp_skips_every_critic_update_of_the_poisoned_step():
    keras.config.set_dtype_policy("mixed_float16")
    model = wgan_gp()
    # The penalty's gradients overflow float16 at 2**15: start lower, so
    # that the only skip is the poisoned step's.
    model.set_loss_scale(mp.LossScaler(initial_scale=2.0**8))
    _, skipped = _fit(model, _poisoned(4))
    assert _finite(model)
    assert skipped == [0.0, 0.0, 1.0, 1.0]
    assert model.scaler.diagnostics()["step_count"] == 4
    assert int(model.d_optimizer.iterations.numpy()) == 3 * 3  # 3 critic updates a step
    assert int(model.g_optimizer.iterations.numpy()) == 4


def test_the_guides_own_train_step_is_protected_and_warned_once():
    # The guide's step never scales its loss and applies through
    # self.optimizer: stock Keras skips its NaN step; so must we.
    keras.config.set_dtype_policy("mixed_float16")
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    x[POISONED_STEP * 8] = np.nan
    y = np.zeros((32, 1), "float32")
    model = guide_model()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history, skipped = _fit(
            model, x, y, epochs=2, monitors=[mp.LossScaleMonitor(max_skipped_fraction=1.0)]
        )
    unscaled = [w for w in caught if "never scales its loss" in str(w.message)]
    assert len(unscaled) == 1 and issubclass(unscaled[0].category, mp.MixedPrecisionWarning)
    assert "self.optimizer.scale_loss(loss)" in str(unscaled[0].message)
    assert _finite(model)
    assert history["skipped_steps"] == [1.0, 1.0] and skipped[:4] == [0.0, 0.0, 1.0, 1.0]
    # The scale never scaled a loss: 1.0 is what the step used, not 32768.
    assert history["loss_scale"] == [1.0, 1.0]
    assert int(model.optimizer.iterations.numpy()) == 2 * 3
    kinds = [finding.kind for finding in mp.check_model(model)]
    assert "missing_loss_scale" in kinds  # float16 with no loss scaled, now that it is known


@pytest.mark.parametrize("base", [keras.Model, GuideModel])
def test_a_nan_loss_in_your_own_step_raises_as_in_stock_keras(base):
    keras.config.set_dtype_policy("mixed_float16")
    x = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")
    x[POISONED_STEP * 8] = np.nan
    if base is keras.Model:  # the guide's step on a stock model
        base = type("StockGuideModel", (keras.Model,), {"train_step": GuideModel.train_step})
    model = guide_model(base)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(mp.NonFiniteGradientError, match="the loss was non-finite"):
        model.fit(
            x,
            np.zeros((32, 1), "float32"),
            batch_size=8,
            shuffle=False,
            verbose=0,
            callbacks=[mp.NaNGradientMonitor(action="raise", check_every=1)],
        )
    assert _finite(model)


class _Scaling(mp.MixedPrecisionModel):
    """The guide's step, scaling its loss in one of the three spellings."""

    spelling = "scale_loss"

    def train_step(self, data):
        x, y = data
        variables = self.trainable_variables
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            if self.spelling == "scale_loss":  # Keras 3
                scaled = self.optimizer.scale_loss(loss)
            elif self.spelling == "get_scaled_loss":  # tf.keras
                scaled = self.optimizer.get_scaled_loss(loss)
            else:
                scaled = self.scaler.scale(loss)
        grads = tape.gradient(scaled, variables)
        if self.spelling == "scale_loss":
            self.optimizer.apply(grads, variables)
        elif self.spelling == "get_scaled_loss":
            grads = self.optimizer.get_unscaled_gradients(grads)
            self.optimizer.apply_gradients(zip(grads, variables))
        else:
            self.scaler.step(self.optimizer, grads, variables)
        return {"loss": loss}


@pytest.mark.parametrize("spelling", ["scale_loss", "get_scaled_loss", "step"])
def test_each_spelling_unscales_exactly_once(spelling):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    weights = []
    for base in (None, _Scaling):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1)(inputs)
        if base is None:
            model = keras.Model(inputs, outputs)
        else:
            model = type("Scaling", (_Scaling,), {"spelling": spelling})(inputs, outputs, loss_scale=2.0**10)
        model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for stock, ours in zip(*weights):
        np.testing.assert_allclose(ours, stock, rtol=1e-6, atol=1e-7)


def test_the_recipe_under_kerass_automatic_wrap_unscales_once_and_says_so():
    # A stock keras.Model with the LossScaler recipe: compile() wraps
    # its optimizer in Keras's LossScaleOptimizer under mixed_float16.
    keras.config.set_dtype_policy("mixed_float16")

    class Recipe(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scaler = mp.LossScaler(initial_scale=2.0**10)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
                scaled = self.scaler.scale(loss)
            grads = self.scaler.unscale(tape.gradient(scaled, self.trainable_variables))
            self.scaler.apply_gradients(self.optimizer, grads, self.trainable_variables, loss=loss)
            return {"loss": loss}

    x = np.ones((8, 4), "float32")
    y = np.full((8, 1), 2.0, "float32")
    deltas = []
    for auto_scale_loss in (True, False):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = Recipe(inputs, keras.layers.Dense(1, dtype="float32")(inputs))
        model.compile(keras.optimizers.SGD(0.1), "mse", auto_scale_loss=auto_scale_loss)
        before = model.get_weights()[0].copy()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        named = [w for w in caught if "auto_scale_loss=False" in str(w.message)]
        assert len(named) == (1 if auto_scale_loss else 0)
        deltas.append(np.abs(model.get_weights()[0] - before).max())
    wrapped, plain = deltas
    assert plain > 0.1 and wrapped == pytest.approx(plain, rel=1e-6)


def test_a_hand_written_steps_scale_is_found_under_any_attribute():
    keras.config.set_dtype_policy("mixed_float16")

    class Scaler(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scaler = mp.LossScaler(initial_scale=2.0**10)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
                scaled = self.scaler.scale(loss)
            grads = tape.gradient(scaled, self.trainable_variables)
            self.scaler.step(self.optimizer, grads, self.trainable_variables, loss=loss)
            return {"loss": loss}

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = Scaler(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    model.compile(keras.optimizers.SGD(0.01), "mse", auto_scale_loss=False)
    assert "missing_loss_scale" not in [f.kind for f in mp.check_model(model)]
    x = np.random.default_rng(3).normal(size=(32, 4)).astype("float32")
    x[8] = x[24] = np.nan  # 2 of 4 steps skipped, after an applied one
    with pytest.warns(mp.MixedPrecisionWarning, match=r"^2 of 4 steps \(50%\) were skipped"):
        history = model.fit(
            x,
            np.zeros((32, 1), "float32"),
            batch_size=8,
            shuffle=False,
            verbose=0,
            callbacks=[mp.LossScaleMonitor()],
        ).history
    # The NaN rows make the loss NaN: bad data, skipped without backing off.
    assert history["loss_scale"] == [2.0**10] and history["skipped_steps"] == [2.0]
    assert mp.LossScaler is type(model.scaler) and _finite(model)


# ----------------------------------------------------------- construction
def _functional_net_class():
    class FunctionalNet(mp.MixedPrecisionModel):
        def __init__(self):
            inputs = keras.Input((3,))
            outputs = keras.layers.Dense(2, name="out")(inputs)
            super().__init__(inputs=inputs, outputs=outputs, name="functional_net")

    return FunctionalNet


def _call_net_class():
    class CallNet(mp.MixedPrecisionModel):
        def __init__(self):
            super().__init__(name="call_net")
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    return CallNet


@pytest.mark.parametrize("order", ["functional_first", "call_first"])
def test_both_construction_styles_work_in_one_process_in_any_order(order):
    # Keras's own functional construction rewrites the bases of the classes
    # between a model's class and keras.Model; neither style may.
    declared = mp.MixedPrecisionModel.__bases__
    shared = declared[-1].__bases__  # ModelBase: what every backend's model shares
    assert shared == (keras.Model,)
    classes = [_functional_net_class(), _call_net_class()]
    if order == "call_first":
        classes.reverse()
    x = np.ones((2, 3), "float32")
    for cls in classes:
        model = cls()
        assert isinstance(model, cls) and type(model).__name__ == cls.__name__
        assert model(x).shape == (2, 2)
    assert mp.MixedPrecisionModel.__bases__ == declared and declared[-1].__bases__ == shared
    assert all(cls.__bases__ == (mp.MixedPrecisionModel,) for cls in classes)


def test_from_model_keeps_a_single_input_a_single_tensor():
    keras.utils.set_random_seed(0)
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    x = np.ones((3, 4), "float32")
    for original in (sequential, functional):
        wrapped = mp.MixedPrecisionModel.from_model(original)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = wrapped(x)
        assert not [w for w in caught if "structure" in str(w.message)]
        np.testing.assert_allclose(out, original(x), rtol=1e-6)


def test_auto_scale_loss_false_means_no_scaling_as_in_keras():
    # Keras's own underflow test: sigmoid gradients vanish in float16
    # without a loss scale, and the first kernel never moves.
    class DeepModel(mp.MixedPrecisionModel):
        def __init__(self):
            super().__init__(dtype="mixed_float16")
            self.dense_layers = [
                keras.layers.Dense(
                    1, use_bias=False, kernel_initializer="ones", activation="sigmoid", dtype="mixed_float16"
                )
                for _ in range(15)
            ]

        def call(self, x):
            for layer in self.dense_layers:
                x = layer(x)
            return x

    moved = {}
    for auto_scale_loss in (False, True):
        model = DeepModel()
        model.compile(keras.optimizers.SGD(learning_rate=1e9), loss="mse", auto_scale_loss=auto_scale_loss)
        model.fit(np.ones((1, 1)), np.ones((1, 1)), batch_size=1, verbose=0)
        kernel = model.dense_layers[0].kernel.numpy()
        moved[auto_scale_loss] = not np.array_equal(kernel, np.ones_like(kernel))
    assert moved == {False: False, True: True}
    assert not model.scaler.is_dynamic or model.get_scale() > 1


# ------------------------------------------------------ sparse and ragged
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_sparse_inputs_train_with_sparse_updates(run_eagerly):
    def batches():
        rng = np.random.default_rng(0)
        for _ in range(4):
            dense = rng.uniform(size=(2, 4)).astype("float32") * (rng.uniform(size=(2, 4)) > 0.25)
            yield tf.sparse.from_dense(dense), rng.uniform(size=(2, 3)).astype("float32")

    inputs = keras.Input((4,), sparse=True)
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(3, use_bias=False)(inputs))
    optimizer = keras.optimizers.Adagrad()
    model.compile(optimizer, "mse", run_eagerly=run_eagerly, jit_compile=False)
    sparse_updates = []

    def assign_sub(variable, value):
        sparse_updates.append(isinstance(value, tf.IndexedSlices))
        type(optimizer).assign_sub(optimizer, variable, value)

    before = model.get_weights()[0].copy()
    with mock.patch.object(optimizer, "assign_sub", side_effect=assign_sub):
        history = model.fit(batches(), epochs=1, verbose=0).history
    assert any(sparse_updates)  # not densified on the way
    assert history["skipped_steps"] == [0.0] and not np.array_equal(before, model.get_weights()[0])


def test_a_skipped_sparse_batch_is_not_kept_and_the_diagnosis_says_so():
    dense = np.ones((8, 4), "float32")
    dense[0, 0] = np.inf
    x = tf.sparse.from_dense(dense)
    inputs = keras.Input((4,), sparse=True)
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    monitor = mp.NaNGradientMonitor(action="warn", check_every=1)
    with pytest.warns(mp.MixedPrecisionWarning, match="not replayed: its inputs are sparse"):
        history = model.fit(
            tf.data.Dataset.from_tensors((x, np.zeros((8, 1), "float32"))), verbose=0, callbacks=[monitor]
        ).history
    assert history["skipped_steps"] == [1.0] and model.kept_batch() is None


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_ragged_inputs_train(run_eagerly):
    class Doubling(mp.MixedPrecisionModel):
        def call(self, x):
            return x * 2

    model = Doubling()
    x = tf.ragged.constant([[1.0], [2.0, 3.0]])
    assert isinstance(model(x), tf.RaggedTensor)
    model.compile(optimizer="adam", loss=lambda y, y_pred, sample_weight=None: 0.0, run_eagerly=run_eagerly)
    history = model.fit(x, x, verbose=0).history
    assert history["skipped_steps"] == [0.0]
    assert isinstance(model.predict(x, verbose=0), tf.RaggedTensor)


def test_an_override_calling_super_train_step_is_one_step_traced_once():
    # Keras's trainer tests: CustomTrainTestStepModel and test_retracing.
    traces = []

    class Extra(mp.MixedPrecisionModel):
        def train_step(self, data):
            traces.append(1)
            logs = super().train_step(data)
            logs["my_custom_metric"] = 10.0
            return logs

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = Extra(inputs, keras.layers.Dense(1)(inputs))
    model.compile("adam", "mse", steps_per_execution=20)
    history = model.fit(np.ones((100, 4)), np.ones((100, 1)), batch_size=1, verbose=0).history
    assert len(traces) <= 2
    assert history["my_custom_metric"] == [10.0] and history["skipped_steps"] == [0.0]
    assert model.scaler.diagnostics()["step_count"] == 100  # once per step, not twice
    assert not hasattr(Extra.__dict__["train_step"], "__wrapped__")  # the class is as written


def test_the_step_traced_by_a_users_own_tf_function_needs_no_autograph(monkeypatch):
    # A user's `tf.function(model.train_step)` converts what it calls with
    # AutoGraph (Keras's fit does not); the library's step is plain Python
    # over the graph, and strict conversion raises where AutoGraph would
    # only warn ("could not transform ... generators are not supported").
    monkeypatch.setenv("AUTOGRAPH_STRICT_CONVERSION", "1")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(3)(hidden), loss_scale=2.0**4)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
    y = np.zeros(8, "int64")
    step = tf.function(model.train_step)  # autograph=True, as users write it
    step((x, y))
    before = [v.numpy().copy() for v in model.variables if "loss_scale" not in v.path]
    step((np.full_like(x, np.nan), y))
    after = [v.numpy() for v in model.variables if "loss_scale" not in v.path]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    assert model.scaler.diagnostics()["skipped_steps"] == 1

    scaler = mp.LossScaler(initial_scale=2.0**4)
    optimizer = keras.optimizers.Adam()

    @tf.function
    def own_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model.compute_loss(x=x, y=y, y_pred=model(x, training=True)))
            scaled = scaler.scale(loss)
        grads = scaler.unscale(tape.gradient(scaled, model.trainable_variables))
        return scaler.apply_gradients(optimizer, grads, model.trainable_variables, loss=loss)

    assert bool(own_step(x, y)) and not bool(own_step(np.full_like(x, np.nan), y))
