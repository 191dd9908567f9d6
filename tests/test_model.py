"""MixedPrecisionModel: real fits against stock Keras."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import NaNGradientDense, classification_data, overflowing_classifier, tiny_classifier

import mp_callbacks as mp

# Tiny layers (4 units) keep float16 cheap on CPU; compile's check_model
# hint about Tensor-Core sizes is expected here and tested in test_model_checks.
pytestmark = pytest.mark.filterwarnings("ignore:check_model found:mp_callbacks.errors.MixedPrecisionWarning")
# The tests that read `trained_pair` share one xdist group, so it is built
# once; the rest of the file spreads over the workers.
TRAINED_PAIR_GROUP = pytest.mark.xdist_group("test_model.trained_pair")


def _regression_graph(regularized: bool = False, two_outputs: bool = False):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    regularizer = keras.regularizers.L2(0.01) if regularized else None
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer)(inputs)
    first = keras.layers.Dense(3, name="first")(hidden)
    if not two_outputs:
        return inputs, first
    second = keras.layers.Dense(1, name="second")(hidden)
    return inputs, [first, second]


CASES = {
    "plain": {},
    "sample_weight": {"sample_weight": True},
    "class_weight": {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}},
    "regularized": {"regularized": True},
    "two_outputs": {"two_outputs": True},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_float32_training_matches_stock_keras(case):
    """With a power-of-two scale, scaling then unscaling is exact in float32:
    the model must train to the same weights as stock keras.Model."""
    options = CASES[case]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(48, 5)).astype("float32")
    labels = rng.integers(0, 3, size=48)
    fit_kwargs = {"epochs": 2, "batch_size": 16, "shuffle": False, "verbose": 0}
    if options.get("two_outputs"):
        y = [labels, rng.normal(size=(48, 1)).astype("float32")]
        loss = [keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"]
        compile_kwargs = {"loss": loss, "loss_weights": [1.0, 0.5]}
    else:
        y = labels
        compile_kwargs = {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    if options.get("sample_weight"):
        fit_kwargs["sample_weight"] = rng.uniform(0.1, 2.0, size=48).astype("float32")
    if "class_weight" in options:
        fit_kwargs["class_weight"] = options["class_weight"]

    graph = {
        "regularized": options.get("regularized", False),
        "two_outputs": options.get("two_outputs", False),
    }
    stock = keras.Model(*_regression_graph(**graph))
    ours = mp.MixedPrecisionModel(
        *_regression_graph(**graph), loss_scale=mp.LossScaler(initial_scale=2.0**12)
    )
    ours.set_weights(stock.get_weights())
    stock.compile(keras.optimizers.SGD(0.1, momentum=0.9), **compile_kwargs)
    ours.compile(keras.optimizers.SGD(0.1, momentum=0.9), **compile_kwargs)
    stock_history = stock.fit(x, y, **fit_kwargs).history
    our_history = ours.fit(x, y, **fit_kwargs).history

    for ours_w, stock_w in zip(ours.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(ours_w, stock_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(our_history["loss"], stock_history["loss"], rtol=1e-5)
    assert set(our_history) == set(stock_history) | set(mp.LOG_KEYS)
    assert our_history["loss_scale"] == [2.0**12, 2.0**12]
    assert our_history["skipped_steps"] == [0.0, 0.0]
    assert all(g > 0 for g in our_history["grad_norm"])


@pytest.fixture(scope="module")
def trained_pair():
    """A trained MixedPrecisionModel and a stock model with the same weights."""
    x, y = classification_data()
    model = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=64.0, growth_interval=3))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    stock = keras.Model(model.inputs, model.outputs)
    stock.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, stock, history, (x, y)


@TRAINED_PAIR_GROUP
def test_history_has_the_three_keys_every_epoch(trained_pair):
    model, _, history, _ = trained_pair
    logs = history.history
    assert set(mp.LOG_KEYS) <= set(logs)
    assert all(len(logs[key]) == 2 for key in mp.LOG_KEYS)
    # 4 clean steps per epoch, growth every 3: 64 -> 128 (step 3) -> 256 (step 6).
    assert logs["loss_scale"] == [128.0, 256.0]
    assert model.get_scale() == 256.0
    assert isinstance(model.get_scale(), float)
    assert logs["skipped_steps"] == [0.0, 0.0]


def test_grad_norm_is_the_mean_global_norm_of_unscaled_gradients():
    x, y = classification_data(n=16)
    model = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=2.0**10))
    model.compile(keras.optimizers.SGD(0.0), "sparse_categorical_crossentropy")
    with tf.GradientTape() as tape:
        loss = keras.losses.sparse_categorical_crossentropy(y, model(x, training=True))
        loss = tf.reduce_mean(loss)
    expected = tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables))
    history = model.fit(x, y, epochs=1, batch_size=16, verbose=0).history
    assert float(expected) > 0.01
    assert history["grad_norm"][0] == pytest.approx(float(expected), rel=1e-5)


@TRAINED_PAIR_GROUP
def test_evaluate_and_predict_behave_as_stock_keras(trained_pair):
    model, stock, _, (x, y) = trained_pair
    ours = model.evaluate(x, y, verbose=0, return_dict=True)
    theirs = stock.evaluate(x, y, verbose=0, return_dict=True)
    assert ours.keys() == theirs.keys() == {"loss", "accuracy"}
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-6)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(stock.evaluate(x, y, verbose=0))
    np.testing.assert_allclose(model.predict(x, verbose=0), stock.predict(x, verbose=0))
    assert [m.name for m in model.metrics] == [m.name for m in stock.metrics]


def test_overflow_skips_steps_without_touching_weights_or_optimizer():
    x, _ = classification_data(n=32)
    model = tiny_classifier(loss_scale=mp.LossScaler.fixed(2.0**127))
    model.compile(keras.optimizers.Adam(0.01), keras.losses.MeanSquaredError())
    targets = np.full((32, 3), 100.0, "float32")  # loss * 2**127 overflows float32
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, targets, epochs=1, batch_size=8, verbose=0).history
    assert history["skipped_steps"] == [4.0]
    # No applied step to average over: NaN, not a 0 that reads as vanishing gradients.
    assert len(history["grad_norm"]) == 1 and np.isnan(history["grad_norm"][0])
    assert int(model.optimizer.iterations.numpy()) == 0
    for w_after, w_before in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w_after, w_before)
    for slot in model.optimizer.variables:
        assert np.all(np.isfinite(slot.numpy()))
        if slot.path.endswith(("momentum", "velocity")):
            assert not np.any(slot.numpy())


def test_steps_per_execution_and_jit_compile_train_identically():
    x, y = classification_data(n=48)
    targets = np.eye(3, dtype="float32")[y] * 50.0
    results = []
    for steps_per_execution, jit_compile in ((1, False), (3, True)):
        model = tiny_classifier(seed=5, loss_scale=mp.LossScaler(initial_scale=2.0**127, max_scale=2.0**127))
        model.compile(
            keras.optimizers.SGD(1e-3),
            "mse",
            steps_per_execution=steps_per_execution,
            jit_compile=jit_compile,
        )
        history = model.fit(x, targets, epochs=2, batch_size=4, shuffle=False, verbose=0).history
        results.append((history, model.get_weights(), model.scaler.diagnostics()))
    (h1, w1, d1), (h2, w2, d2) = results
    assert h1["skipped_steps"] == h2["skipped_steps"]
    assert sum(h1["skipped_steps"]) == d1["skipped_steps"] > 0
    assert h1["loss_scale"] == h2["loss_scale"]
    assert d1 == d2
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("clipping", ["clipnorm", "global_clipnorm", "clipvalue"])
def test_gradient_clipping_acts_on_unscaled_gradients(clipping):
    x, y = classification_data(n=32)
    model = tiny_classifier(loss_scale=mp.LossScaler.fixed(2.0**12))
    limit = 1e-3
    model.compile(keras.optimizers.SGD(1.0, **{clipping: limit}), "sparse_categorical_crossentropy")
    before = [w.copy() for w in model.get_weights()]
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    steps = [after - start for after, start in zip(model.get_weights(), before)]
    # Unclipped gradients here are far larger than 1e-3, so the update hits
    # the limit exactly; clipping the scaled gradient would have given
    # 1e-3 / 4096.
    if clipping == "clipnorm":
        for step in steps:
            assert np.linalg.norm(step) == pytest.approx(limit, rel=1e-3)
    elif clipping == "global_clipnorm":
        total = np.sqrt(sum(np.sum(step**2) for step in steps))
        assert total == pytest.approx(limit, rel=1e-3)
    else:
        assert max(np.abs(step).max() for step in steps) == pytest.approx(limit, rel=1e-3)


def test_mixed_float16_auto_uses_one_dynamic_scale():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = classification_data(n=32)
    model = tiny_classifier()
    sgd = keras.optimizers.SGD(0.01)
    model.compile(sgd, "sparse_categorical_crossentropy")
    # As in Keras: one LossScaleOptimizer, and it is the model's own scale.
    assert isinstance(model.optimizer, mp.LossScaleOptimizer)
    assert model.optimizer.inner_optimizer is sgd and model.optimizer.scaler is model.scaler
    assert model.scaler.is_dynamic and model.scaler.initial_scale == 2.0**15
    history = model.fit(x, y, epochs=1, batch_size=16, verbose=0).history
    assert history["loss_scale"] == [2.0**15]
    assert model.layers[1].compute_dtype == "float16"


def test_seed_recipe_loss_scale_optimizer_is_adopted_not_stacked():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = classification_data(n=32)
    model = tiny_classifier()
    wrapped = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=256.0, dynamic_growth_steps=2
    )
    model.compile(wrapped, "sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, mp.LossScaleOptimizer)  # Keras's is replaced, not stacked
    assert model.optimizer.inner_optimizer is wrapped.inner_optimizer
    assert model.optimizer.dynamic_growth_steps == 2
    assert model.scaler.initial_scale == 256.0
    assert model.scaler.growth_interval == 2
    history = model.fit(x, y, epochs=1, batch_size=8, verbose=0).history
    # 4 clean steps, growth every 2: one consistent scale 256 -> 1024.
    assert history["loss_scale"] == [1024.0]
    assert not wrapped.built


def test_bfloat16_and_float32_auto_use_no_scaling():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = tiny_classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    assert not model.scaler.scaling_active
    assert model.get_scale() == 1.0


def test_per_variable_nonfinite_counts_name_the_poisoned_layer():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, activation="relu", name="clean")(inputs)
    hidden = NaNGradientDense(4, name="poisoned")(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = classification_data(n=32)
    history = model.fit(x, y, epochs=1, batch_size=8, verbose=0).history
    counts = model.nonfinite_gradient_counts()
    assert history["skipped_steps"] == [4.0]
    assert list(counts) == [v.path for v in model.trainable_variables]
    assert {path: n for path, n in counts.items() if n} == {"poisoned/kernel": 4}


class SubclassedNet(mp.MixedPrecisionModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="relu")
        self.head = keras.layers.Dense(3, activation="softmax", dtype="float32")

    def call(self, inputs):
        return self.head(self.hidden(inputs))


def test_subclassed_and_functional_models_coexist():
    functional = tiny_classifier()  # must not turn the class Functional-only
    net = SubclassedNet(loss_scale=32.0)
    x, y = classification_data(n=32)
    net.compile("sgd", "sparse_categorical_crossentropy")
    history = net.fit(x, y, epochs=1, batch_size=16, verbose=0).history
    assert history["loss_scale"] == [32.0]
    assert isinstance(functional, mp.MixedPrecisionModel)
    assert isinstance(net, mp.MixedPrecisionModel)
    assert not isinstance(net, keras.src.models.functional.Functional)


def test_from_model_wraps_sequential_and_keeps_weights_and_optimizer():
    keras.utils.set_random_seed(0)
    sequential = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    optimizer = keras.optimizers.Adam(0.01)
    sequential.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    model = mp.MixedPrecisionModel.from_model(sequential, loss_scale=8.0)
    assert model.optimizer.inner_optimizer is optimizer  # it scales: wrapped as in Keras
    assert [id(v) for v in model.weights] == [id(v) for v in sequential.weights]
    x, y = classification_data(n=32)
    history = model.fit(x, y, epochs=1, batch_size=16, verbose=0).history
    assert {"accuracy", "loss", *mp.LOG_KEYS} <= set(history)
    np.testing.assert_allclose(model.predict(x, verbose=0), sequential.predict(x, verbose=0))

    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"keras\.Input"):
        mp.MixedPrecisionModel.from_model(unbuilt)


@TRAINED_PAIR_GROUP
def test_keras_save_and_load_keep_config_and_current_scale(tmp_path, trained_pair):
    model, _, _, (x, _) = trained_pair
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects
    assert type(loaded).__name__ == "MixedPrecisionModel"
    assert isinstance(loaded, mp.MixedPrecisionModel)
    assert loaded.scaler.get_config() == model.scaler.get_config()
    assert loaded.get_scale() == model.get_scale() == 256.0
    assert loaded.scaler.diagnostics() == model.scaler.diagnostics()
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_weights_checkpoint_round_trip_keeps_scale(tmp_path):
    x, _ = classification_data(n=32)
    targets = np.full((32, 3), 100.0, "float32")
    model = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=2.0**127, max_scale=2.0**127))
    model.compile(keras.optimizers.SGD(1e-4), "mse")
    model.fit(x, targets, epochs=1, batch_size=4, verbose=0)
    path = str(tmp_path / "ckpt.weights.h5")
    model.save_weights(path)

    fresh = tiny_classifier(seed=9, loss_scale=mp.LossScaler(initial_scale=2.0**127, max_scale=2.0**127))
    fresh.compile(keras.optimizers.SGD(1e-4), "mse")
    assert fresh.get_scale() == 2.0**127
    fresh.load_weights(path)
    assert fresh.get_scale() == model.get_scale() < 2.0**127
    assert fresh.scaler.diagnostics() == model.scaler.diagnostics()
    for a, b in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_mirrored_strategy_skips_on_every_replica(two_cpu_strategy):
    x, y = classification_data(n=64)
    x[60:] = np.nan  # second half of the last batch: one replica goes non-finite
    with two_cpu_strategy.scope():
        # A NaN row overflows the gradients with a finite loss, on every CPU.
        model = overflowing_classifier(loss_scale=mp.LossScaler(initial_scale=2.0**8))
        model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    history = model.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0).history
    assert history["skipped_steps"] == [1.0]
    assert int(model.optimizer.iterations.numpy()) == 7
    scale_replicas = [v.numpy() for v in model.scaler._scale.values]
    assert scale_replicas == [128.0, 128.0]
    assert history["loss_scale"] == [128.0]
    for variable in model.trainable_variables:
        replicas = (
            [v.numpy() for v in variable.value.values]
            if hasattr(variable.value, "values")
            else [variable.numpy()]
        )
        for replica in replicas[1:]:
            np.testing.assert_array_equal(replica, replicas[0])
        assert np.all(np.isfinite(replicas[0]))


def test_import_fails_clearly_on_another_backend():
    env = dict(os.environ, KERAS_BACKEND="numpy")
    result = subprocess.run(
        [sys.executable, "-c", "import mp_callbacks"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "KERAS_BACKEND=tensorflow" in result.stderr


def test_import_without_tensorflow_says_what_to_install():
    code = "import sys; sys.modules['tensorflow'] = None; import mp_callbacks"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "mp_callbacks[cpu]" in result.stderr and "mp_callbacks[gpu]" in result.stderr


@keras.saving.register_keras_serializable(package="mp_callbacks_tests")
class SerializableNet(mp.MixedPrecisionModel):
    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.head = keras.layers.Dense(3, activation="softmax", dtype="float32")

    def call(self, inputs):
        return self.head(self.hidden(inputs))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_subclassed_model_saves_and_loads_with_its_scale(tmp_path):
    x, y = classification_data(n=32)
    net = SerializableNet(units=8, loss_scale=mp.LossScaler(initial_scale=64.0, growth_interval=2))
    net.compile("adam", "sparse_categorical_crossentropy")
    net.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert net.get_scale() == 256.0
    net.save(tmp_path / "net.keras")
    loaded = keras.models.load_model(tmp_path / "net.keras")
    assert type(loaded) is SerializableNet and loaded.units == 8
    assert loaded.get_scale() == 256.0
    assert loaded.scaler.get_config() == net.scaler.get_config()
    np.testing.assert_allclose(loaded.predict(x, verbose=0), net.predict(x, verbose=0))


def test_training_loss_under_mirrored_strategy_matches_stock_keras(two_cpu_strategy):
    # Keras divides each replica's loss by the replica count; the loss log
    # must undo that exactly as stock Keras does.
    x, y = classification_data(n=64)
    histories = []
    for cls in (keras.Model, mp.MixedPrecisionModel):
        with two_cpu_strategy.scope():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((6,))
            hidden = keras.layers.Dense(4, activation="relu")(inputs)
            outputs = keras.layers.Dense(3, activation="softmax")(hidden)
            model = cls(inputs, outputs)
            model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        histories.append(model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0).history)
    stock, ours = histories
    np.testing.assert_allclose(ours["loss"], stock["loss"], rtol=1e-5)
    assert ours["loss"][0] > 0.5  # a real cross-entropy, not a replica share of it


def test_get_config_names_auto_until_compile_then_the_resolved_scale():
    inputs = keras.Input((3,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
    assert model.get_config()["loss_scale"] == "auto"
    model.compile("sgd", "mse")
    config = model.get_config()["loss_scale"]
    assert config["class_name"] == "LossScaler"
    assert config["config"]["initial_scale"] == 1.0 and config["config"]["max_scale"] == 1.0


def test_set_loss_scale_replaces_the_scale_and_retraces():
    x, y = classification_data(n=16)
    model = tiny_classifier(loss_scale=4.0)
    model.compile("sgd", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, verbose=0)
    assert model.get_scale() == 4.0 and model.train_function is not None
    model.set_loss_scale(mp.LossScaler(initial_scale=64.0, growth_interval=1))
    assert model.train_function is None
    assert model.scaler.built  # counters for the built model's variables
    history = model.fit(x, y, batch_size=8, verbose=0).history
    assert history["loss_scale"] == [256.0]
    model.set_loss_scale("auto")  # compiled: resolved at once
    assert model.scaler.get_config()["max_scale"] == 1.0


class _LossInputsRecorder(mp.MixedPrecisionModel):
    """Overrides compute_loss and compute_metrics the way Keras documents
    them, and keeps what they were given (x and training)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self.seen_x_sum = keras.ops.sum(x) if x is not None else keras.ops.convert_to_tensor(-1.0)
        self.seen_training = training
        return super().compute_loss(x, y, y_pred, sample_weight, training=training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        self.metrics_x_sum = keras.ops.sum(x) if x is not None else keras.ops.convert_to_tensor(-1.0)
        return super().compute_metrics(x, y, y_pred, sample_weight)


def test_compute_loss_overrides_get_the_batch_and_training_true_and_the_tracker_counts_samples():
    keras.mixed_precision.set_global_policy("float32")
    inputs = keras.Input((3,))
    model = _LossInputsRecorder(inputs, keras.layers.Dense(1)(inputs), name="recorder")
    model.compile("sgd", "mse", run_eagerly=True)  # what compute_loss saw stays readable
    x = np.full((50, 3), 0.5, "float32")
    timer = mp.EpochTimer()
    model.fit(x, np.zeros((50, 1)), batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    assert model.seen_training is True
    # The last compute_loss call saw the last, partial batch: 2 rows of 0.5 x 3.
    assert float(model.seen_x_sum) == pytest.approx(3.0)
    assert float(model.metrics_x_sum) == pytest.approx(3.0)  # so did compute_metrics
    # Keras's loss tracker is weighted by the batch's sample count: 50 in all.
    assert float(model._loss_tracker.count.numpy()) == 50.0
    assert timer.records[0]["samples"] == 50.0


def test_a_healthy_step_reads_each_gradient_once():
    """Finiteness and grad_norm come from one fused sum of squares per
    gradient; a second pass (a separate norm, or a re-check inside the skip
    decision) would cost every step and change no value."""
    keras.mixed_precision.set_global_policy("float32")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="relu")(inputs)
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(2)(hidden))
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    graph = (
        tf.function(model.train_step)
        .get_concrete_function((tf.TensorSpec((8, 4), tf.float32), tf.TensorSpec((8,), tf.int64)))
        .graph
    )
    op_types = [op.type for op in graph.get_operations()]  # the step, outside its branches
    assert op_types.count("L2Loss") == len(model.trainable_variables) == 4
    assert op_types.count("Square") == 0  # no separate norm


def _step_graph(model, y_spec=None):
    y_spec = tf.TensorSpec((8,), tf.int64) if y_spec is None else y_spec
    return (
        tf.function(model.train_step).get_concrete_function((tf.TensorSpec((8, 4), tf.float32), y_spec)).graph
    )


def _writes_in_branches(graph) -> int:
    """Variable writes inside the step's cond branches (its function library)."""
    library = graph.as_graph_def().library.function
    return sum(
        node.op.startswith(("Assign", "ResourceApply", "ResourceScatter"))
        for function in library
        if function.signature.name.startswith("cond")
        for node in function.node_def
    )


def _compiled_calls(graph) -> list:
    """The step's calls of an XLA-compiled function (the compiled update)."""
    calls = []
    for op in graph.get_operations():
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            try:
                if op.get_attr("_XlaMustCompile"):
                    calls.append(op)
            except ValueError:
                pass
    return calls


def test_a_healthy_step_updates_outside_any_cond():
    """An update that is not compiled by XLA (RMSprop's: see
    test_compiled_update.py) has its writes gated one by one (a scalar
    Select each), not wrapped in a tf.cond, which would cost every step
    several percent on few CPU threads. Only the skip path's restores live
    in a branch."""
    keras.mixed_precision.set_global_policy("float32")
    inputs = keras.Input((4,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(2)(keras.layers.Dense(3)(inputs)))
    model.compile(keras.optimizers.RMSprop(0.1), "sparse_categorical_crossentropy")
    graph = _step_graph(model)
    assert _compiled_calls(graph) == []
    op_types = [op.type for op in graph.get_operations()]
    # Per variable: its gradient (the arithmetic waits for the decision),
    # its own write and its velocity's; and the iteration counter.
    assert op_types.count("Select") == 3 * len(model.trainable_variables) + 1
    # The kept batch (x, y, its step number) is restored on skip, nothing else.
    assert _writes_in_branches(graph) == 3


def test_a_verified_optimizers_update_and_skip_are_one_compiled_call():
    """SGD with momentum is compiled by XLA: the update and its cond are one
    call, nothing is gated write by write, and outside that call only the
    kept batch's restore sits in a branch."""
    keras.mixed_precision.set_global_policy("float32")
    inputs = keras.Input((4,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(2)(keras.layers.Dense(3)(inputs)))
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy")
    graph = _step_graph(model)
    calls = _compiled_calls(graph)
    assert len(calls) == 1
    assert [op.type for op in graph.get_operations()].count("Select") == 0
    library = {function.signature.name: function for function in graph.as_graph_def().library.function}
    compiled = library[calls[0].get_attr("f").name]
    branches = {
        node.attr[branch].func.name
        for node in compiled.node_def
        if node.op in ("If", "StatelessIf")
        for branch in ("then_branch", "else_branch")
    }
    writes = sum(
        node.op.startswith(("Assign", "ResourceApply"))
        for name in branches
        for node in library[name].node_def
    )
    # Each variable and its momentum, and the iteration counter.
    assert writes == 2 * len(model.trainable_variables) + 1
    assert _writes_in_branches(graph) == 3 + writes


def test_an_update_that_cannot_be_gated_is_skipped_by_a_cond_exactly():
    # Keras applies a kernel constraint with a plain assign, which cannot be
    # gated: the whole update then sits in a tf.cond, and still skips exactly.
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = mp.MixedPrecisionModel(
        inputs,
        keras.layers.Dense(2, kernel_constraint=keras.constraints.NonNeg())(inputs),
        loss_scale=mp.LossScaler(initial_scale=2.0**10, growth_interval=1000),
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    assert _writes_in_branches(_step_graph(model, tf.TensorSpec((8, 2), tf.float32))) > 3
    x = np.ones((8, 4), "float32")
    before = [w.copy() for w in model.get_weights()]
    bad = np.full((8, 2), np.inf, "float32")
    history = model.fit(x, bad, batch_size=8, verbose=0).history
    assert history["skipped_steps"] == [1.0]
    for after, old in zip(model.get_weights(), before):
        np.testing.assert_array_equal(after, old)
    assert int(model.optimizer.iterations.numpy()) == 0
    model.fit(x, np.zeros((8, 2), "float32"), batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert np.all(model.get_weights()[0] >= 0)


def test_a_model_without_trainable_weights_skips_nothing(caplog):
    keras.mixed_precision.set_global_policy("float32")
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(1, name="frozen")
    model = mp.MixedPrecisionModel(inputs, dense(inputs))
    dense.trainable = False
    model.compile("sgd", "mse")
    with caplog.at_level("WARNING", logger="mp_callbacks.model"):
        history = model.fit(np.ones((8, 3)), np.zeros((8, 1)), batch_size=4, verbose=0).history
    assert history["skipped_steps"] == [0.0] and history["grad_norm"] == [0.0]
    assert "The model does not have any trainable weights." in caplog.text


def _twin_regressions():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    ours = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
    stock_inputs = keras.Input((3,))
    stock = keras.Model(stock_inputs, keras.layers.Dense(1)(stock_inputs))
    stock.set_weights(ours.get_weights())
    for model in (ours, stock):
        model.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mae"], weighted_metrics=["mse"])
    return ours, stock


def test_sample_weights_reach_the_metrics_as_in_a_stock_model():
    keras.mixed_precision.set_global_policy("float32")
    ours, stock = _twin_regressions()
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(16, 3)), rng.normal(size=(16, 1))
    weights = np.linspace(0.0, 3.0, 16)
    logs = [
        m.fit(x, y, sample_weight=weights, batch_size=8, shuffle=False, verbose=0).history
        for m in (ours, stock)
    ]
    assert logs[0]["mae"] == pytest.approx(logs[1]["mae"], rel=1e-6)
    assert logs[0]["mse"] == pytest.approx(logs[1]["mse"], rel=1e-6)  # weighted
    assert logs[0]["loss"] == pytest.approx(logs[1]["loss"], rel=1e-6)


def test_grad_norm_is_the_mean_over_applied_steps_only():
    keras.mixed_precision.set_global_policy("float32")
    ours, _ = _twin_regressions()
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    x[12] = np.nan  # the second batch of 8 is skipped

    @tf.function
    def norm_of_first_batch():
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y[:8], ours(x[:8]))
        return tf.linalg.global_norm(tape.gradient(loss, ours.trainable_variables))

    expected = float(norm_of_first_batch())
    history = ours.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    assert history["skipped_steps"] == [1.0]
    assert history["grad_norm"][0] == pytest.approx(expected, rel=1e-5)


def test_grad_norm_under_mirrored_strategy_is_each_replicas_batch_gradient_norm(two_cpu_strategy):
    # Keras divides each replica's loss by the replica count, so each
    # replica's gradient is a share; the logged norm undoes that: it is the
    # mean, over replicas, of the norm of the gradient of its own batch's loss.
    keras.mixed_precision.set_global_policy("float32")
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    with two_cpu_strategy.scope():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((3,))
        model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(keras.optimizers.SGD(0.0), "mse")
    plain_inputs = keras.Input((3,))
    plain = keras.Model(plain_inputs, keras.layers.Dense(1)(plain_inputs))
    plain.set_weights(model.get_weights())

    def norm_of(xs, ys):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(ys, plain(xs))
        return float(tf.linalg.global_norm(tape.gradient(loss, plain.trainable_variables)))

    expected = (norm_of(x[:8], y[:8]) + norm_of(x[8:], y[8:])) / 2
    history = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history
    assert history["grad_norm"][0] == pytest.approx(expected, rel=1e-5)


@keras.saving.register_keras_serializable(package="mp_callbacks_tests")
class NaNBackward(keras.layers.Layer):
    """Weightless identity whose input gradient is NaN, whatever comes back:
    the NaN does not wait for the rest of the backward pass."""

    def call(self, x):
        @tf.custom_gradient
        def identity(value):
            return tf.identity(value), lambda upstream: tf.fill(
                tf.shape(value), tf.constant(np.nan, value.dtype)
            )

        return identity(x)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_an_embedding_written_before_the_decision_is_put_back_and_never_read_by_its_own_step(jit_compile):
    """SGD's sparse update of an Embedding is written as soon as its
    gradient exists (it comes last: waiting for the decision would make it
    the step's tail) and its rows are put back on a skip. Here every step's
    embedding gradient is NaN: the table must come out bit for bit as it
    went in, and no step's forward pass may read its own NaN rows (the loss
    of each step is the untouched model's loss on that batch). What orders
    the write after the forward pass is checked on the graph in
    test_gated_update (the write takes the loss as data)."""
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Flatten()(NaNBackward()(keras.layers.Embedding(50, 8)(inputs)))
    outputs = keras.layers.Dense(3)(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (96, 6)).astype("int32")
    y = rng.integers(0, 3, 96)
    before = [w.copy() for w in model.get_weights()]
    expected = [
        float(model.compute_loss(x=None, y=y[i : i + 8], y_pred=model(x[i : i + 8]))) for i in range(0, 96, 8)
    ]

    class StepLosses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            means.append(float(logs["loss"]))

    means = []
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[StepLosses()]).history
    assert history["skipped_steps"] == [12.0]
    for after, old in zip(model.get_weights(), before):
        np.testing.assert_array_equal(after, old)
    # Keras logs the running mean: recover each step's own loss.
    steps = np.arange(1, 13)
    per_step = np.diff(np.concatenate([[0.0], np.array(means) * steps]))
    np.testing.assert_allclose(per_step, expected, rtol=1e-4)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_an_activity_regularizer_in_low_precision_trains_with_its_penalty_in_the_loss(policy):
    # Stock Keras on TensorFlow cannot add the layer's float16 or bfloat16
    # penalty to the float32 loss (a TypeError in compute_loss). Keras 3.10
    # sums the penalty over the batch (3.11 on divide it by the batch size):
    # a factor of 0.01 keeps its float16 gradient finite at the first scale on both.
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.01))(inputs)
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    model.compile(keras.optimizers.SGD(0.0), "mse")  # nothing moves: the loss can be recomputed
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)).astype("float32"), rng.normal(size=(16, 1)).astype("float32")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    predictions = model(x, training=True)
    assert [keras.backend.standardize_dtype(loss.dtype) for loss in model.losses] == ["float32"]
    penalty = float(keras.ops.convert_to_numpy(model.losses[0]))
    mse = float(np.mean((keras.ops.convert_to_numpy(predictions) - y) ** 2))
    assert penalty > 0.01 * mse
    assert history["loss"][0] == pytest.approx(mse + penalty, rel=1e-2)
    assert history["skipped_steps"] == [0.0]
