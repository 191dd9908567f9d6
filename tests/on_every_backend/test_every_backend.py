"""Guarantees that hold on every backend: one module, collected by the
TensorFlow, JAX and torch suites alike (no TensorFlow import here), so that
a guarantee cannot hold on one backend and not on another."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
from backend_helpers import float8_model, float8_state

import mp_callbacks as mp

BACKEND = keras.backend.backend()


# ------------------------------------------------------------------ float8
def test_float8_scales_and_histories_train_as_in_stock_keras_under_float16():
    # Their "gradients" are their next values: never unscaled, never optimized.
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    states, norms = [], None
    for cls in (keras.Model, mp.MixedPrecisionModel):
        model = float8_model(cls)
        model.compile(keras.optimizers.SGD(0.01), "mse")
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history
        states.append(float8_state(model))
        norms = history.get("grad_norm")
    stock, ours = states
    assert set(stock) == set(ours) and "f8/inputs_scale" in ours and "f8/outputs_grad_amax_history" in ours
    for path in stock:
        np.testing.assert_allclose(ours[path], stock[path], rtol=1e-3, err_msg=path)
    assert float(ours["f8/kernel_scale"].ravel()[0]) > 1e-5  # never divided by 2**15
    # The logged norm leaves the state out (its history holds scaled values near 2**15).
    assert 0 < norms[0] < 100


# ------------------------------------------- your own train_step, stock's way
def _own_step_class():
    """A subclass whose train_step scales the loss and applies through
    `self.optimizer`, as keras-io teaches on each backend."""
    if BACKEND == "jax":
        import jax

        class OwnStep(mp.MixedPrecisionModel):
            def train_step(self, state, data):
                trainable, non_trainable, optimizer_vars, metrics_vars = state
                x, y = data

                def scaled_loss(values):
                    y_pred, new_non_trainable = self.stateless_call(values, non_trainable, x, training=True)
                    loss = keras.ops.mean((y_pred - y) ** 2)
                    mapping = list(zip(self.optimizer.variables, optimizer_vars))
                    with keras.StatelessScope(state_mapping=mapping):
                        return self.optimizer.scale_loss(loss), (loss, new_non_trainable)

                (_, (loss, non_trainable)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(trainable)
                trainable, optimizer_vars = self.optimizer.stateless_apply(optimizer_vars, grads, trainable)
                return {"own_loss": loss}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    elif BACKEND == "torch":

        class OwnStep(mp.MixedPrecisionModel):
            def train_step(self, data):
                x, y = data
                self.zero_grad()
                loss = keras.ops.mean((self(x, training=True) - y) ** 2)
                self.optimizer.scale_loss(loss).backward()
                weights = self.trainable_weights
                self.optimizer.apply([w.value.grad for w in weights], weights)
                return {"own_loss": loss}

    else:
        import tensorflow as tf

        class OwnStep(mp.MixedPrecisionModel):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    loss = keras.ops.mean((self(x, training=True) - y) ** 2)
                    scaled = self.optimizer.scale_loss(loss)
                grads = tape.gradient(scaled, self.trainable_variables)
                self.optimizer.apply(grads, self.trainable_variables)
                return {"own_loss": loss}

    return OwnStep


def test_your_own_step_through_the_optimizer_reports_the_scale_that_moved():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = _own_step_class()(inputs, keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(3)(inputs)))
    model.compile(keras.optimizers.SGD(0.01))
    before = [np.array(w) for w in model.get_weights()]
    x = np.full((8, 4), 1e4, "float32")  # its float16 gradients overflow at 2**15
    monitor = mp.LossScaleMonitor()
    history = model.fit(x, np.ones((8, 1), "float32"), batch_size=8, verbose=0, callbacks=[monitor]).history
    # The optimizer that scaled the loss backed off; everyone says so.
    assert model.optimizer.get_scale() == 2.0**14
    assert model.get_scale() == 2.0**14 and model.scaler.get_scale() == 2.0**14
    assert history["loss_scale"] == [2.0**14] and monitor.history[-1]["loss_scale"] == 2.0**14
    assert history["skipped_steps"] == [1.0]
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(new, old)


# -------------------------------------------------- nothing outlives a trial
def test_a_dropped_model_and_its_optimizer_are_freed_as_in_a_search():
    # keras-tuner's trials: build, compile, fit, drop, clear_session. What
    # the step keeps (compiled updates, buffers) must die with the model.
    import gc
    import weakref

    keras.config.set_dtype_policy("float32")
    inputs = keras.Input((4,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(inputs)))
    model.compile("adam", "mse")
    model.fit(np.ones((16, 4), "float32"), np.ones((16, 1), "float32"), batch_size=8, verbose=0)
    dropped = [weakref.ref(model), weakref.ref(model.optimizer)]
    del model, inputs
    keras.backend.clear_session()
    gc.collect()
    assert [ref() is None for ref in dropped] == [True, True]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_no_inf_or_nan_enters_a_float8_history_and_one_written_in_is_repaired_at_fit(policy):
    keras.config.set_dtype_policy(policy)
    model = float8_model(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = np.ones((16, 8), "float32"), np.ones((16, 2), "float32")
    model.fit(x, y, batch_size=8, verbose=0)
    before = float8_state(model)
    x[:8] = np.nan  # the first step's gradients, and so its new amax values, are NaN
    history = model.fit(x, y, batch_size=8, verbose=0, shuffle=False).history
    assert history["skipped_steps"] == [1.0]
    after = float8_state(model)
    assert all(np.isfinite(value).all() for value in after.values())
    history_path = "f8/inputs_amax_history"
    assert not np.array_equal(after[history_path], before[history_path])  # the good step wrote it
    # A checkpoint of a run that diverged elsewhere carries a NaN in.
    variable = next(v for v in model.variables if v.path == history_path)
    poisoned = np.array(variable.numpy())
    poisoned[3] = np.nan
    variable.assign(poisoned)
    with pytest.warns(mp.MixedPrecisionWarning, match=history_path):
        model.fit(x[8:], y[8:], batch_size=8, verbose=0)
    assert np.isfinite(np.array(variable.numpy())).all()


@pytest.mark.parametrize("follows", [True, False])
def test_float8_gradient_state_follows_a_loss_scale_back_off(follows):
    # The output-gradient scale and history hold scaled gradients' values:
    # after the scale halves, they halve too (False: stock Keras's footing).
    keras.config.set_dtype_policy("mixed_float16")
    model = float8_model(mp.MixedPrecisionModel)
    model.float8_follows_loss_scale = follows
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    model.fit(x[:8], np.zeros((8, 2), "float32"), batch_size=8, verbose=0)
    before = float8_state(model)
    probe = x[:8], np.full((8, 2), 1e-3, "float32")
    ratio_before = mp.diagnose_batch(model, *probe).float8["f8"]["outputs_grad"]["amax_ratio"]
    # Targets of 1e4: the float16 layer's scaled gradient overflows; skipped.
    history = model.fit(x[8:], np.full((8, 2), 1e4, "float32"), batch_size=8, verbose=0).history
    assert history["skipped_steps"] == [1.0] and history["loss_scale"] == [2.0**14]
    after = float8_state(model)
    # Measured in the next step's gradients: the E5M2 scale's footing is
    # right at once (stock's is a binade off until the history rolls over).
    ratio_after = mp.diagnose_batch(model, *probe).float8["f8"]["outputs_grad"]["amax_ratio"]
    assert ratio_after == pytest.approx(ratio_before * (1.0 if follows else 0.5), rel=1e-6)
    factor = 0.5 if follows else 1.0
    for name in ("f8/outputs_grad_scale", "f8/outputs_grad_amax_history"):
        assert before[name].max() > 0
        np.testing.assert_array_equal(after[name], before[name] * np.float32(factor), err_msg=name)
    for name in ("f8/inputs_scale", "f8/kernel_amax_history"):  # not scaled: as they were
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


# ------------------------------------------------------------------ copies
def _task_on_its_backbones_inputs():
    inputs = keras.Input((4,), name="x")
    backbone = keras.Model(inputs, keras.layers.Dense(8, name="hidden")(inputs), name="backbone")
    outputs = keras.layers.Dense(2, dtype="float32", name="head")(backbone(backbone.input))
    return keras.Model(backbone.input, outputs, name="task")


def test_copies_of_a_task_built_on_its_backbones_inputs():
    # A KerasHub task is built on its backbone's own inputs: rebuilt from
    # its config, the backbone gets an InputLayer of its own.
    keras.config.set_dtype_policy("float32")
    twin = _task_on_its_backbones_inputs()  # the same graph, in float32
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = mp.MixedPrecisionModel.from_model(_task_on_its_backbones_inputs())
    model.compile("adam", "mse")
    twin.set_weights(model.get_weights())
    x = np.random.default_rng(0).normal(size=(4, 4)).astype("float32")
    expected = np.asarray(twin.predict(x, verbose=0))
    copies = {
        "float32_copy": mp.float32_copy(model),
        "PrecisionPlan.apply": mp.PrecisionPlan(policy="float32").apply(model),
    }
    for name, copy in copies.items():
        np.testing.assert_array_equal(np.asarray(copy.predict(x, verbose=0)), expected, err_msg=name)
    pinned = mp.with_float32_layers(model, ["hidden"])
    hidden = next(layer for layer in pinned.get_layer("backbone").layers if layer.name == "hidden")
    assert hidden.compute_dtype == "float32"


# --------------------------------------------------- Keras's newest optimizers
@pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"), reason="Keras 3.15's MultiOptimizer")
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_a_multi_optimizer_trains_as_stock_and_one_decision_skips_all_of_it(policy):
    def select(variable):
        return keras.optimizers.Adam(1e-2) if "first" in variable.path else keras.optimizers.SGD(0.1)

    def build(cls):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, name="first")(inputs)
        model = cls(inputs, keras.layers.Dense(1, dtype="float32", name="head")(hidden))
        model.compile(keras.optimizers.MultiOptimizer(select), "mse")
        return model

    keras.config.set_dtype_policy(policy)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.ones((16, 1), "float32")
    trained = {}
    for cls in (keras.Model, mp.MixedPrecisionModel):
        model = build(cls)
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        trained[cls] = model
    ours = trained[mp.MixedPrecisionModel]
    if policy == "float32":
        for mine, stock in zip(ours.get_weights(), trained[keras.Model].get_weights()):
            np.testing.assert_array_equal(mine, stock)
    state = list(ours.trainable_variables) + list(ours.optimizer.variables)
    before = [np.array(v.numpy()) for v in state]
    history = ours.fit(np.full((8, 4), np.nan, "float32"), y[:8], batch_size=8, verbose=0).history
    assert history["skipped_steps"] == [1.0]
    for variable, value in zip(state, before):  # every sub-optimizer's slots and iterations too
        np.testing.assert_array_equal(np.array(variable.numpy()), value, err_msg=variable.path)


# ------------------------------------------------- layers told apart by path
@keras.saving.register_keras_serializable(package="test_every_backend")
class Block(keras.layers.Layer):
    """A block with a sublayer named `proj`, as every transformer block has
    its `query`, `key` and `value`."""

    def __init__(self, gain=1.0, **kwargs):
        super().__init__(**kwargs)
        self.gain = gain
        self.proj = keras.layers.Dense(4, kernel_initializer="ones", name="proj")

    def build(self, input_shape):
        self.proj.build(input_shape)

    def call(self, x):
        return self.proj(x * self.gain)

    def get_config(self):
        return {**super().get_config(), "gain": self.gain}


def test_same_named_sublayers_are_told_apart_by_their_paths():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    hidden = Block(1.0, name="block1")(inputs)
    hidden = Block(6e3, name="block2")(hidden)  # its proj gives 4 * 4 * 6e3 > 65504
    # The model's own layer shares the name: its path is its name.
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1, name="proj")(hidden))
    model.compile("sgd", "mse")
    x, y = np.ones((2, 4), "float32"), np.ones((2, 1), "float32")
    report = mp.diagnose_batch(model, x, y)
    assert {"proj", "block1/proj", "block2/proj"} <= set(report.activation_max)
    head_only = mp.with_float32_layers(model, ["proj"])
    assert [head_only.get_layer("proj").compute_dtype, head_only.get_layer("block2").proj.compute_dtype] == [
        "float32",
        "float16",
    ]
    assert report.first_nonfinite_layer == "block2/proj" and report.origin == "block2/proj"
    assert {"block1/proj", "block2/proj"} <= set(report.activation_max)
    assert "block2/proj" in report.float32_layers and "block1/proj" not in report.float32_layers
    fixed = mp.with_float32_layers(model, ["block2/proj"])
    dtypes = {
        path: fixed.get_layer(block).proj.compute_dtype for path, block in [("1", "block1"), ("2", "block2")]
    }
    assert dtypes == {"1": "float16", "2": "float32"}
    monitor = mp.HeadroomMonitor(probe=x)
    logs = model.fit(x, y, verbose=0, callbacks=[monitor]).history
    assert {"block1/proj", "block2/proj"} <= set(monitor.history[-1]["headroom"])
    assert {"headroom/block1/proj", "headroom/block2/proj"} <= set(logs)


class TiedEmbedding(keras.layers.Layer):
    """A token lookup that is also the LM head (`reverse=True`), as
    KerasHub's ReversibleEmbedding in GPT-2, Gemma, T5: one layer, two calls."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=(32, 8), name="embeddings")

    def call(self, x, reverse=False):
        table = keras.ops.cast(self.embeddings, self.compute_dtype)
        if reverse:
            return keras.ops.matmul(x, keras.ops.transpose(table))
        return keras.ops.take(table, x, axis=0)


def test_each_call_of_a_tied_embedding_is_its_own_entry_and_the_head_is_blamed():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    ids = keras.Input((6,), dtype="int32")
    embedding = TiedEmbedding(name="embedding")
    hidden = keras.layers.LayerNormalization(name="final_norm")(
        keras.layers.Dense(8, name="dense")(embedding(ids))
    )
    model = mp.MixedPrecisionModel(ids, embedding(hidden, reverse=True))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, 32, size=(2, 6)).astype("int32")
    # A loss scale that overflows the logits' gradient (float16) and nothing before it.
    report = mp.diagnose_batch(model, x, x, loss_scale=2.0**26)
    names = [record.name for record in report.layers]
    assert names == ["embedding (call 1)", "dense", "final_norm", "embedding (call 2)"]
    assert report.loss_finite and report.first_nonfinite_layer is None
    assert report.origin == "embedding (call 2)"  # the head, not the norm before it
    assert report.float32_layers == ["embedding"] and report.layer_of(report.origin) == "embedding"


# --------------------------------------------------------- bfloat16 visible
@keras.saving.register_keras_serializable(package="test_every_backend")
class NaiveVariance(keras.layers.Layer):
    """E[x^2] - E[x]^2, written by hand: cancels catastrophically for a large mean."""

    def call(self, x):
        mean = keras.ops.mean(x, axis=-1, keepdims=True)
        return keras.ops.mean(x * x, axis=-1, keepdims=True) - mean * mean


def test_the_bfloat16_layer_that_loses_precision_is_named_and_not_its_neighbours(tmp_path):
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(8, name="before")(inputs)
    spread = NaiveVariance(name="variance")(inputs)
    features = keras.layers.Concatenate(name="features")([hidden, spread])
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(
        keras.layers.Dense(4, name="after")(features)
    )
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile("sgd", "mse")
    x = (300.0 + np.random.default_rng(0).normal(size=(16, 16))).astype("float32")
    # diagnose_batch names it, in the same report as float16 overflow.
    report = mp.diagnose_batch(model, x[:8], np.ones((8, 1), "float32"))
    assert report.precision_loss["variance"] > 0.05
    assert all(report.precision_loss[name] < 0.05 for name in ("before", "after", "features"))
    assert report.float32_layers == ["variance"]
    assert "bfloat16 precision lost: variance" in str(report)
    monitor = mp.HeadroomMonitor(probe=x[:4])
    with pytest.warns(mp.MixedPrecisionWarning, match="'variance' computes in bfloat16") as caught:
        logs = model.fit(
            x, np.ones((16, 1), "float32"), batch_size=8, epochs=2, verbose=0, callbacks=[monitor]
        ).history
    named = {str(w.message).split("'")[1] for w in caught if "computes in bfloat16" in str(w.message)}
    assert named == {"variance"}
    assert logs["bfloat16/variance/error"][0] > 0.05
    assert all(logs[f"bfloat16/{name}/error"][0] < 0.05 for name in ("before", "after", "features"))
    assert set(monitor.history[-1]["bfloat16"]["variance"]) == {"error", "underflow"}
    # The plot of layer by epoch draws what the logs hold.
    drawn = monitor.plot(str(tmp_path / "bfloat16.png"))
    rows, epochs, table = drawn["bfloat16/error"]
    assert set(drawn) == {"bfloat16/error"} and epochs == [0, 1] and "variance" in rows
    np.testing.assert_allclose(table[rows.index("variance")], logs["bfloat16/variance/error"])
    assert (tmp_path / "bfloat16.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no layer has a value"):
        monitor.plot(str(tmp_path / "none.png"), figures=["float8/saturation"])
    with pytest.raises(ValueError, match=r"`figures` must be .*received figures=\['error'\]"):
        monitor.plot(str(tmp_path / "none.png"), figures=["error"])


# ----------------------------------------------------------- float8 visible
class Gain(keras.layers.Layer):
    """Multiplies by a non-trainable factor, set between fits (a jump)."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="ones", trainable=False, name="gain")

    def call(self, x):
        return x * keras.ops.cast(self.gain, x.dtype)


def test_a_float8_layers_inputs_saturating_after_a_jump_are_named_with_the_share(tmp_path):
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    first, second = keras.layers.Dense(8, name="first"), keras.layers.Dense(8, name="second")
    gain = Gain(name="gain")
    hidden = second(gain(first(inputs)))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1, dtype="float32", name="head")(hidden))
    first.quantize("float8")
    second.quantize("float8")
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    y = np.zeros((16, 1), "float32")
    monitor = mp.HeadroomMonitor(probe=x[:8], every_n_steps=1, probe_targets=y[:8])
    calm = model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor]).history
    assert calm["float8/second/inputs/saturation"][0] < 0.05
    gain.gain.assign(100.0)  # the second layer's activations jump: its scale is stale
    with pytest.warns(
        mp.MixedPrecisionWarning, match=r"float8 layer 'second': \d+\.\d% of its inputs saturate"
    ):
        jumped = model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor]).history
    assert jumped["float8/second/inputs/saturation"][0] > 0.5
    assert jumped["float8/second/inputs/amax_ratio"][0] > 10
    assert jumped["float8/first/inputs/saturation"][0] < 0.05  # not the layer before it
    assert jumped["float8/second/history_nonfinite"] == [0.0]
    probe = monitor.history[-1]["float8"]["second"]["inputs"]
    assert set(probe) == {"saturation", "underflow", "amax_ratio", "current_underflow", "mx_underflow"}
    # diagnose_batch names it too, with the output gradient of its backward pass.
    gain.gain.assign(1e4)  # a second jump, before its scale catches up
    report = mp.diagnose_batch(model, x[:8], y[:8])
    assert report.float8["second"]["inputs"]["saturation"] > 0.5
    assert report.float8["first"]["inputs"]["saturation"] < 0.05
    assert re.search(r"float8 saturated \(clipped, silently\): .*second inputs \(\d", str(report))
    # The jump reaches the gradients too (on TensorFlow from a traced
    # backward pass: Keras's float8 gradient runs only there).
    assert report.float8["second"]["outputs_grad"]["saturation"] > 0.5
    assert not any("float8" in note or "gradient" in note for note in report.notes)
    assert {"first", "second", "head"} <= set(report.gradient_max)  # the whole backward pass
    # With targets, the probe's backward pass gives the output gradient's figures too.
    assert 0.0 <= jumped["float8/second/outputs_grad/saturation"][0] <= 1.0
    assert "outputs_grad" in monitor.history[-1]["float8"]["second"]
    rows, _, table = monitor.plot(str(tmp_path / "float8.png"))["float8/saturation"]
    assert {"first/inputs", "first/kernel", "second/inputs", "second/kernel"} <= set(rows)
    assert table[rows.index("second/inputs"), 0] == jumped["float8/second/inputs/saturation"][0]


# --------------------------------------------------------------- check_model
class BFloat16Adapter(keras.layers.Layer):
    """A LoRA-like adapter whose weight is created in bfloat16."""

    def build(self, input_shape):
        self.a = self.add_weight(shape=(input_shape[-1], 2), dtype="bfloat16", name="lora_a")

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.cast(self.a, x.dtype))


def test_check_model_names_trainable_variables_kept_in_low_precision():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    adapted = BFloat16Adapter(name="adapter")(keras.layers.Dense(4, name="dense")(inputs))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1, dtype="float32", name="head")(adapted))
    findings = [f for f in mp.check_model(model) if f.kind == "low_precision_variable"]
    assert [(f.layer, f.layers) for f in findings] == [("adapter", ("adapter",))]
    assert "lora_a (bfloat16)" in findings[0].message
    keras.config.set_dtype_policy("bfloat16")  # every variable: one finding for the model
    inputs = keras.Input((4,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(4)(inputs)), name="pure")
    findings = [f for f in mp.check_model(model) if f.kind == "low_precision_variable"]
    assert [f.layer for f in findings] == ["pure"] and "mixed_bfloat16" in findings[0].message


def test_check_model_names_the_traps_of_bfloat16_ids_and_float8_policies():
    keras.config.set_dtype_policy("mixed_bfloat16")
    ids = keras.Input((3,), dtype="int32")
    # A nested Sequential without an Input of its own casts the ids: 999 looks up row 1000.
    inner = keras.Sequential([keras.layers.Embedding(1200, 4, name="lookup")], name="inner")
    model = mp.MixedPrecisionModel(ids, keras.layers.Dense(2, dtype="float32")(inner(ids)))
    rows = keras.ops.convert_to_numpy(
        keras.ops.cast(inner(np.array([[999, 0, 0]], "int32"))[0, 0], "float32")
    )
    table = keras.ops.convert_to_numpy(inner.layers[0].embeddings)
    np.testing.assert_allclose(rows, table[1000], rtol=1e-2)
    found = [(f.kind, f.layers) for f in mp.check_model(model)]
    assert found == [("float_index_input", ("inner", "lookup"))]
    fixed = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(1200, 4)])
    assert (
        mp.check_model(mp.MixedPrecisionModel(ids, keras.layers.Dense(2, dtype="float32")(fixed(ids)))) == []
    )
    # float8 on a layer Keras does not quantize: it builds, then fails in training.
    images = keras.Input((6, 6, 2))
    conv = keras.layers.Conv2D(2, 3, dtype="float8_from_mixed_bfloat16", name="conv")
    head = keras.layers.Dense(1, dtype="float32")(keras.layers.Flatten()(conv(images)))
    model = mp.MixedPrecisionModel(images, head)
    assert [(f.kind, f.layer) for f in mp.check_model(model)] == [("float8_unsupported_layer", "conv")]
    with pytest.raises(NotImplementedError):
        conv(np.ones((1, 6, 6, 2), "float32"))
    dense = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")]
    )
    dense.quantize("float8")
    assert mp.check_model(dense) == []
    # With floatx bfloat16, integer ids plus a Python float are typed float16 (keras#23712).
    keras.config.set_dtype_policy("float32")
    keras.config.set_floatx("bfloat16")
    try:
        shifted = keras.ops.add(ids, 0.5)
        assert keras.backend.standardize_dtype(shifted.dtype) == "float16"
        found = [(f.kind, f.layer) for f in mp.check_model(keras.Model(ids, keras.layers.Dense(2)(shifted)))]
        assert found == [("float16_result", shifted._keras_history[0].name)]
        cast_first = keras.ops.add(keras.ops.cast(ids, "bfloat16"), 0.5)
        assert mp.check_model(keras.Model(ids, keras.layers.Dense(2)(cast_first))) == []
    finally:
        keras.config.set_floatx("float32")
