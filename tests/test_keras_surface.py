"""The seams between the library and the parts of Keras users bring:
optimizer features, adapted preprocessing layers, wrappers and custom
layers with sublayers, augmentation layers under bfloat16, adopting a model
built under float32, bad data over many steps, and a step that raises."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import classification_data

import mp_callbacks as mp

# ------------------------------------------------------------- optimizers


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True], ids=["no XLA", "XLA"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_gradient_accumulation_trains_as_stock_and_skips_a_poisoned_step(policy, jit_compile):
    def build(cls):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(4)(inputs)
        outputs = keras.layers.Dense(1, dtype="float32")(hidden)
        model = cls(inputs, outputs)
        model.compile(
            keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), "mse", jit_compile=jit_compile
        )
        return model

    keras.mixed_precision.set_global_policy(policy)
    x, _ = classification_data(n=32)
    y = x[:, :1] * 2.0
    ours = build(mp.MixedPrecisionModel)
    history = ours.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    # float16 may spend its first step calibrating the scale down.
    assert history["skipped_steps"] == ([0.0, 0.0] if policy == "float32" else [1.0, 0.0])
    if policy == "float32":
        stock = build(keras.Model)
        stock.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        for a, b in zip(ours.get_weights(), stock.get_weights()):
            np.testing.assert_array_equal(a, b)
    # A poisoned batch: skipped, every weight and the accumulators as they were.
    before = [v.numpy() for v in ours.variables + ours.optimizer.variables]
    x_bad = x[:8].copy()
    x_bad[0] = np.nan
    history = ours.fit(x_bad, y[:8], batch_size=8, epochs=1, verbose=0).history
    assert history["skipped_steps"] == [1.0]
    after = [v.numpy() for v in ours.variables + ours.optimizer.variables]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------ copies of a model's layers


@keras.saving.register_keras_serializable(package="mp_callbacks_tests")
class PatchEncoder(keras.layers.Layer):
    """keras-io's ViT patch encoder: sublayers made in __init__, positions
    from ops.arange into an Embedding."""

    def __init__(self, num_patches, projection_dim, **kwargs):
        super().__init__(**kwargs)
        self.num_patches = num_patches
        self.projection_dim = projection_dim
        self.projection = keras.layers.Dense(projection_dim)
        self.position_embedding = keras.layers.Embedding(num_patches, projection_dim)

    def call(self, patch):
        positions = keras.ops.expand_dims(keras.ops.arange(0, self.num_patches), 0)
        return self.projection(patch) + self.position_embedding(positions)

    def get_config(self):
        return {
            **super().get_config(),
            "num_patches": self.num_patches,
            "projection_dim": self.projection_dim,
        }


_X = np.random.default_rng(0).normal(3.0, 10.0, size=(16, 6, 4)).astype("float32")


def _layered_model(cls=keras.Model):
    """An adapted Normalization, a custom layer with sublayers, Bidirectional,
    TimeDistributed and a nested Sequential, under the global policy."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 4))
    normalization = keras.layers.Normalization(name="norm")
    normalization.adapt(_X)
    h = normalization(inputs)
    h = PatchEncoder(6, 8, name="patches")(h)
    h = keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True), name="bi")(h)
    h = keras.layers.TimeDistributed(keras.layers.Dense(3), name="td")(h)
    h = keras.Sequential([keras.layers.Dense(5), keras.layers.Dense(2)], name="nested")(h)
    outputs = keras.layers.Dense(1, dtype="float32", name="out")(keras.layers.Flatten()(h))
    return cls(inputs, outputs)


def _low_precision(model):
    return sorted(
        layer.name
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if not isinstance(layer, keras.layers.InputLayer) and layer.compute_dtype != "float32"
    )


@pytest.fixture
def bfloat16_model_and_reference():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = _layered_model(mp.MixedPrecisionModel)
    keras.mixed_precision.set_global_policy("float32")
    reference = _layered_model()
    reference.set_weights(model.get_weights())
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    return model, reference


@pytest.mark.parametrize(
    "copy",
    [mp.float32_copy, lambda model: mp.PrecisionPlan("float32").apply(model)],
    ids=["float32_copy", "PrecisionPlan.apply"],
)
def test_copies_compute_every_layer_in_float32_with_the_same_predictions(copy, bfloat16_model_and_reference):
    model, reference = bfloat16_model_and_reference
    assert "bi" in _low_precision(model) and "out" not in _low_precision(model)  # the float32 head
    copied = copy(model)
    assert _low_precision(copied) == []
    np.testing.assert_array_equal(copied.predict(_X, verbose=0), reference.predict(_X, verbose=0))


@pytest.mark.slow
def test_copies_of_an_adapted_normalization_keep_normalizing():
    keras.mixed_precision.set_global_policy("float32")
    model = _layered_model(mp.MixedPrecisionModel)
    expected = model.predict(_X, verbose=0)
    for copied in (
        mp.float32_copy(model),
        mp.with_float32_layers(model, ["bi"]),
        mp.PrecisionPlan("float32").apply(model),
    ):
        np.testing.assert_array_equal(copied.predict(_X, verbose=0), expected)


def test_with_float32_layers_takes_a_custom_layers_name_and_its_sublayers(bfloat16_model_and_reference):
    model, _ = bfloat16_model_and_reference
    inner = model.get_layer("patches").projection.name
    fixed = mp.with_float32_layers(model, ["patches", inner])
    patches = fixed.get_layer("patches")
    assert patches.compute_dtype == "float32"
    assert patches.projection.compute_dtype == patches.position_embedding.compute_dtype == "float32"
    assert fixed.get_layer("bi").compute_dtype == "bfloat16"  # the others keep theirs
    fixed = mp.with_float32_layers(model, ["nested"])
    assert [layer.compute_dtype for layer in fixed.get_layer("nested").layers] == ["float32", "float32"]
    with pytest.raises(ValueError, match=r"names.*no_such_layer"):
        mp.with_float32_layers(model, ["no_such_layer"])


def test_check_model_has_no_false_findings_for_a_vit_encoder_and_batch_normalization():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((6, 4))
    h = PatchEncoder(6, 8, name="patches")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Activation("linear", dtype="float32")(keras.layers.Flatten()(h))
    findings = mp.check_model(keras.Model(inputs, outputs))
    assert findings == []
    # Keras still computes BatchNormalization in float32 and rounds only its output.
    layer = keras.layers.BatchNormalization(dtype="mixed_bfloat16")
    values = np.array([[1.0, 1.001, 300.0, 300.5]], "float32").T
    out = keras.ops.convert_to_numpy(keras.ops.cast(layer(values, training=True), "float32"))
    exact = (values - values.mean()) / np.sqrt(values.var() + layer.epsilon)
    np.testing.assert_allclose(out, exact, rtol=1e-2)


# ---------------------------------------------- augmentation under bfloat16


@pytest.mark.parametrize(
    "augmentation",
    [
        lambda: keras.layers.RandomRotation(0.1),
        lambda: keras.layers.RandomZoom(0.1),
        lambda: keras.layers.RandomTranslation(0.1, 0.1),
    ],
    ids=["RandomRotation", "RandomZoom", "RandomTranslation"],
)
def test_diagnose_batch_runs_on_augmentation_layers_under_bfloat16(augmentation):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).random((8, 8, 8, 3)).astype("float32")
    y = np.arange(8) % 2
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Flatten()(augmentation()(inputs))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(2, dtype="float32", name="head")(h))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = mp.diagnose_batch(model, x, y)
    assert report.loss_finite and report.origin is None
    assert report.gradient_max["head"] > 0  # the weights' gradients are there
    assert any("no gradient for some layers' inputs" in note for note in report.notes)


# ------------------------------------------------ adopting an existing model


def test_from_model_brings_a_float32_model_into_the_policy_set_afterwards():
    keras.mixed_precision.set_global_policy("float32")
    x, y = classification_data(n=32)
    inputs = keras.Input((6,))
    normalization = keras.layers.Normalization(name="normalization")
    normalization.adapt(x)
    h = keras.layers.Dense(8, name="hidden")(normalization(inputs))
    h = keras.layers.Dense(8, name="pinned", dtype="float32")(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="out")(h)
    original = keras.Model(inputs, outputs)
    weights = original.get_weights()
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mp.MixedPrecisionModel.from_model(original)
    dtypes = {layer.name: layer.compute_dtype for layer in model.layers[1:]}
    assert dtypes == {"normalization": "float16", "hidden": "float16", "pinned": "float32", "out": "float32"}
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    model.compile("adam", "sparse_categorical_crossentropy")
    assert mp.check_model(model) == []
    history = model.fit(x, y, batch_size=8, verbose=0).history
    assert history["loss_scale"] == [2.0**15] and np.isfinite(history["loss"][0])


# ------------------------------------------------------ failures mid-step


class BrokenMetrics(mp.MixedPrecisionModel):
    """A train_step whose metric code raises after the update, until fixed."""

    broken = True

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        if type(self).broken:
            raise ValueError("a bug in the metric code")
        return {"loss": loss}


def test_a_step_that_raised_leaves_nothing_behind_for_the_next_fit():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = classification_data(n=16)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32")(keras.layers.Dense(4)(inputs))
    model = BrokenMetrics(inputs, outputs)
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="metric code"):
        model.fit(x, y, batch_size=8, verbose=0)
    BrokenMetrics.broken = False
    try:
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    finally:
        BrokenMetrics.broken = True
    assert history["skipped_steps"] == [0.0, 0.0]
    assert model.scaler.diagnostics()["step_count"] == 4


# ------------------------------------------------------------------ saving


def test_a_subclass_without_get_config_saves_as_stock_keras_does(tmp_path):
    # Keras 3.15 refuses at save and says to implement get_config (3.10
    # writes a file it cannot load): the same subclass of MixedPrecisionModel
    # does exactly what the same subclass of keras.Model does.
    def outcome(base):
        class Wrapper(base):
            def __init__(self, encoder, **kwargs):
                super().__init__(**kwargs)
                self.encoder = encoder

            def call(self, x):
                return self.encoder(x)

        model = Wrapper(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
        model.compile("sgd", "mse")
        model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
        try:
            model.save(tmp_path / f"{base.__name__}.keras")
        except NotImplementedError as error:
            assert "get_config" in str(error)
            return "refused"
        return "saved"

    keras.mixed_precision.set_global_policy("float32")
    stock = outcome(keras.Model)
    assert outcome(mp.MixedPrecisionModel) == stock
    if keras.__version__ >= "3.15":
        assert stock == "refused"


# ------------------------------------------------------------ bad data


def test_one_bad_input_row_is_bad_data_it_does_not_stop_training():
    keras.mixed_precision.set_global_policy("float32")
    x, y = classification_data(n=32)
    x[8, 2] = np.nan
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3, activation="softmax", name="head")(
        keras.layers.Dense(4, name="first")(inputs)
    )
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile("sgd", "sparse_categorical_crossentropy")
    monitor, scale_monitor = (
        mp.NaNGradientMonitor(check_every=1),
        mp.LossScaleMonitor(max_skipped_fraction=0.1),
    )
    with pytest.warns(mp.MixedPrecisionWarning) as caught:
        history = model.fit(
            x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[monitor, scale_monitor]
        ).history
    messages = [str(w.message) for w in caught]
    assert len(history["loss"]) == 3  # not stopped (the default action is "stop")
    assert history["skipped_steps"] == [1.0, 1.0, 1.0]
    assert monitor.error is None and monitor.bad_data_steps == 3
    assert any("non-finite input values (1 of its 8 rows" in m and "not divergence" in m for m in messages)
    assert not any("diverged" in m or "output overflowed" in m for m in messages)
    # The advice fits the setting: no loss scale, and a non-finite loss.
    skipped = [m for m in messages if "were skipped" in m]
    assert skipped and all("non-finite loss" in m and "initial loss scale" not in m for m in skipped)


# -------------------------------------------------- the one unscaling rule


def _clipping_setup():
    variable = tf.Variable([0.0, 0.0])
    scaler = mp.LossScaler(initial_scale=2.0**10)
    return variable, scaler, keras.optimizers.SGD(1.0)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("applies_with", ["step", "step with variables", "LossScaleOptimizer.apply"])
def test_gradscalers_clipping_recipe_unscales_once(graph, applies_with):
    # PyTorch's recipe: unscale, clip, step. The step must not divide again.
    variable, scaler, sgd = _clipping_setup()
    optimizer = mp.LossScaleOptimizer(sgd, loss_scale=scaler) if "LossScaleOptimizer" in applies_with else sgd

    def train_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * tf.constant([3.0, 4.0]))
            scaled = scaler.scale(loss)
        grads = tape.gradient(scaled, [variable])
        given = [variable] if applies_with == "step with variables" else None
        grads = scaler.unscale(grads, given)
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        if applies_with == "LossScaleOptimizer.apply":
            optimizer.apply(grads, [variable])
        else:
            scaler.step(optimizer, grads, [variable], loss=loss)

    (tf.function(train_step) if graph else train_step)()
    # The unscaled gradient (3, 4) clipped to norm 1: (0.6, 0.8), applied once.
    np.testing.assert_allclose(variable.numpy(), [-0.6, -0.8], rtol=1e-6)


def test_unscaling_the_same_gradients_twice_is_refused():
    variable, scaler, _ = _clipping_setup()
    grads = [tf.constant([1024.0, 2048.0])]
    unscaled = scaler.unscale(grads)
    with pytest.raises(RuntimeError, match=r"already unscaled in this step.*call unscale\(\) once"):
        scaler.unscale(unscaled)
    with pytest.raises(RuntimeError, match="already unscaled"):
        scaler.unscale(grads)
    scaler.unscale([tf.constant([1.0])], [variable])
    with pytest.raises(RuntimeError, match="same variables"):
        scaler.unscale([tf.constant([2.0])], [variable])


def test_unscale_then_apply_in_a_models_own_train_step_divides_once():
    class Clipping(mp.MixedPrecisionModel):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
                scaled = self.optimizer.scale_loss(loss)
            grads = self.scaler.unscale(tape.gradient(scaled, self.trainable_variables))
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    model = Clipping(inputs, dense(inputs), loss_scale=mp.LossScaler.fixed(2.0**10))
    model.compile(keras.optimizers.SGD(0.5), "mse")
    model.fit(np.array([[1.0, 2.0]], "float32"), np.array([[1.0]], "float32"), verbose=0)
    # d/dk (k.x - 1)^2 at k = 0 is -2x: one SGD step of 0.5 gives k = x.
    np.testing.assert_allclose(dense.kernel.numpy().ravel(), [1.0, 2.0], rtol=1e-6)


# ------------------------------------------------------------- XLA


@pytest.mark.parametrize("jit_compile", [False, True], ids=["no XLA", "XLA"])
def test_the_overflowing_layer_is_named_under_xla_too(jit_compile):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    x, y = classification_data(n=16)
    x[8:] *= 1e3  # the second batch overflows float16 in "blowup"
    inputs = keras.Input((6,))
    h = keras.layers.Dense(4, name="first")(inputs)
    h = keras.layers.Lambda(lambda t: t * 1e3, name="blowup")(h)
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32", name="out")(h)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile("sgd", "sparse_categorical_crossentropy", jit_compile=jit_compile)
    monitor = mp.NaNGradientMonitor(action="warn", check_every=1)
    with pytest.warns(mp.MixedPrecisionWarning, match="diverged"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    (kept_x, kept_y, _), step = model.kept_batch()
    np.testing.assert_array_equal(kept_x, x[8:])
    np.testing.assert_array_equal(kept_y, y[8:])
    assert step == 1 and model.kept_batch_note() is None
    assert monitor.error.origin == "blowup"


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_xla_retraces_for_a_new_batch_structure_and_shape_as_stock(policy):
    # Keras's own trainer test (test_on_batch_methods[jit]): a batch with
    # sample weights after one without, then another batch size. The kept
    # batch may not make variables in the retrace.
    keras.mixed_precision.set_global_policy(policy)
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    losses = {}
    for cls in (keras.Model, mp.MixedPrecisionModel):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = cls(inputs, keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(3)(inputs)))
        model.compile("sgd", "mse", jit_compile=True)
        losses[cls] = [
            model.train_on_batch(x, y, return_dict=True)["loss"],
            model.train_on_batch(x, y, np.full((8,), 0.5, "float32"), return_dict=True)["loss"],
            model.train_on_batch(x[:5], y[:5], return_dict=True)["loss"],
        ]
    np.testing.assert_allclose(
        losses[mp.MixedPrecisionModel], losses[keras.Model], rtol=1e-3 if policy != "float32" else 0
    )


# --------------------------------------------------------------- autotune


def _pooled_volumes():
    # TensorFlow has no float16 CPU kernel for AvgPool3D: the float16
    # candidate cannot train (stock Keras fails the same way).
    inputs = keras.Input((4, 4, 4, 2))
    h = keras.layers.AveragePooling3D(2)(inputs)
    outputs = keras.layers.Dense(2, dtype="float32")(keras.layers.Flatten()(h))
    model = keras.Model(inputs, outputs)
    model.compile("adam", "mse")
    return model


def test_autotune_drops_a_candidate_that_cannot_run_and_says_why():
    x = np.random.default_rng(0).random((64, 4, 4, 4, 2)).astype("float32")
    y = np.random.default_rng(1).random((64, 2)).astype("float32")
    plan = mp.autotune(
        _pooled_volumes,
        x,
        y,
        policies=["float32", "mixed_float16"],
        steps=5,
        batch_size=16,
        in_subprocess=False,
    )
    assert plan.policy == "float32"
    dropped = [c for c in plan.candidates if c.get("verdict") == "dropped"]
    assert [c["policy"] for c in dropped] == ["mixed_float16"]
    assert "AveragePooling3D" in dropped[0]["error"]  # names the layer that failed
    assert any(reason.startswith("dropped: mixed_float16") for reason in plan.reasons)


def pooled_digits():
    """A bench model whose float16 run cannot train on a CPU (AvgPool3D)."""
    inputs = keras.Input((28, 28, 1))
    h = keras.layers.Reshape((7, 4, 28, 1))(inputs)
    h = keras.layers.AveragePooling3D(2)(h)
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(keras.layers.Flatten()(h))
    return keras.Model(inputs, outputs)


@pytest.mark.slow
def test_bench_drops_a_policy_whose_run_fails_and_says_why():
    from mp_callbacks_bench.api import run_bench

    report = run_bench(
        pooled_digits,
        policies=["float32", "mixed_float16"],
        epochs=1,
        train_samples=256,
        test_samples=64,
        probe=False,
        force=True,
        in_subprocess=False,
    )
    assert [r["policy"] for r in report.results] == ["float32"]
    assert [s["policy"] for s in report.skipped] == ["mixed_float16"]
    assert "its run failed" in report.skipped[0]["reason"]


def test_ctrl_c_mid_fit_then_fit_trains():
    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise KeyboardInterrupt

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = classification_data(n=32)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32")(keras.layers.Dense(4)(inputs))
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[Interrupt()])
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert history["skipped_steps"] == [0.0, 0.0] and np.isfinite(history["loss"]).all()
    assert model.scaler.diagnostics()["step_count"] == 2 + 8


@pytest.mark.parametrize("through", ["LossScaler.step", "LossScaleOptimizer.apply"])
def test_gradient_accumulation_in_a_hand_written_loop(through):
    keras.mixed_precision.set_global_policy("float32")
    variable = tf.Variable([1.0, 1.0])
    adam = keras.optimizers.Adam(0.1, gradient_accumulation_steps=2)
    scaler = mp.LossScaler(initial_scale=2.0**8)
    optimizer = mp.LossScaleOptimizer(adam, loss_scale=scaler) if "Optimizer" in through else adam

    @tf.function
    def train_step(target):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((variable - target) ** 2)
            scaled = scaler.scale(loss)
        grads = tape.gradient(scaled, [variable])
        if "Optimizer" in through:
            optimizer.apply(grads, [variable])
        else:
            scaler.step(optimizer, grads, [variable], loss=loss)

    reference = tf.Variable([1.0, 1.0])
    stock = keras.optimizers.Adam(0.1, gradient_accumulation_steps=2)
    for _ in range(4):
        target = tf.constant([0.0, 2.0])
        train_step(target)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((reference - target) ** 2)
        stock.apply(tape.gradient(loss, [reference]), [reference])
    np.testing.assert_allclose(variable.numpy(), reference.numpy(), rtol=1e-6)
    assert not np.array_equal(variable.numpy(), [1.0, 1.0])


def test_an_adopted_gpt2_fits_a_dataset_smaller_than_the_default_batch():
    # KerasHub 0.32, TensorFlow: 4 samples with batch_size left at 32 made
    # the gated update's trace fail inside Keras's all-reduce ("All
    # custom_gradient outputs should be from the same graph"); the step now
    # skips by a tf.cond there instead.
    keras_hub = pytest.importorskip("keras_hub")
    keras.mixed_precision.set_global_policy("float32")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
    )
    model = mp.MixedPrecisionModel.from_model(
        keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 64, size=(4, 16)).astype("int32"),
        "padding_mask": np.ones((4, 16), "int32"),
    }
    history = model.fit(x, rng.integers(0, 64, size=(4, 16)), verbose=0).history
    assert np.isfinite(history["loss"][0]) and history["skipped_steps"] == [0.0]
