"""The model's contract on every backend: one module, collected by the
TensorFlow, JAX and torch suites alike (no TensorFlow import here): the
exact skip, float32 equal to stock, true logs, the dynamic scale, save and
load with the scale, copies in float32, every optimizer feature."""

from __future__ import annotations

import math
import warnings

import keras
import numpy as np
import pytest
from backend_helpers import data as _data
from backend_helpers import functional as _functional
from backend_helpers import state as _state
from backend_helpers import values as _values

import mp_callbacks as mp


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_nan_batch_leaves_every_variable_bit_for_bit_as_it_was(policy):
    keras.mixed_precision.set_global_policy(policy)
    model = _functional(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.Adam(1e-3, use_ema=True), "mse")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    before = _state(model)
    assert any("moving_mean" in path for path in before)
    assert any("seed_generator" in path for path in before)
    assert any("average" in path for path in before)  # EMA copies
    bad = x[:8].copy()
    bad[3, 1] = np.nan
    history = model.fit(bad, y[:8], batch_size=8, epochs=1, verbose=0).history
    after = _state(model)
    assert after.keys() == before.keys()
    changed = [path for path in before if not np.array_equal(before[path], after[path], equal_nan=True)]
    assert changed == []
    assert history["skipped_steps"] == [1.0]
    assert math.isnan(history["grad_norm"][0])  # no applied step this epoch
    # A finite batch then trains again.
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    assert any(not np.array_equal(after[p], v) for p, v in _state(model).items())


def test_float32_training_equals_stock_keras_to_the_last_digit():
    x, y = _data()
    trained = {}
    for cls in (keras.Model, mp.MixedPrecisionModel):
        model = _functional(cls)
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        keras.utils.set_random_seed(7)
        losses = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history["loss"]
        trained[cls] = (_state(model), losses)
    stock, ours = trained[keras.Model], trained[mp.MixedPrecisionModel]
    assert ours[1] == stock[1]
    assert len(ours[0]) == len(stock[0])
    for (path, value), mine in zip(stock[0].items(), ours[0].values()):
        np.testing.assert_array_equal(mine, value, err_msg=path)


def test_the_logged_norm_is_the_gradients_norm():
    # Plain SGD moves the weights by lr * gradient: the moved distance over
    # lr is the norm the step must log.
    model = _functional(mp.MixedPrecisionModel, batch_norm=False, dropout=False)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(8)
    before = [v.numpy() for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    moved = math.sqrt(
        sum(float(np.sum((v.numpy() - b) ** 2)) for v, b in zip(model.trainable_variables, before))
    )
    assert history["grad_norm"][0] == pytest.approx(moved / 0.01, rel=1e-4)
    assert history["skipped_steps"] == [0.0]
    assert history["loss_scale"] == [1.0]  # float32: "auto" scales nothing


def test_a_dynamic_scale_backs_off_where_float16_overflows_and_then_trains():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(
        mp.MixedPrecisionModel, loss_scale={"initial_scale": 2.0**24, "growth_interval": 1000}
    )
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(128)  # 2**24 times these gradients overflows float16
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    state = model.loss_scale_state()
    assert 1 <= state["skipped_steps"] < 16
    assert state["scale"] == 2.0 ** (24 - state["skipped_steps"])
    assert history["skipped_steps"] == [float(state["skipped_steps"])]
    assert history["loss_scale"] == [state["scale"]]
    assert state["step_count"] == 16
    # The first steps overflow until the scale fits (calibration); on torch
    # a step or two later may overflow again as the gradients grow.
    assert 1 <= state["calibration_steps"] <= state["skipped_steps"]
    if keras.backend.backend() == "jax":
        assert state["calibration_steps"] == state["skipped_steps"]


def test_auto_scales_under_float16_only_and_can_be_turned_off():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(mp.MixedPrecisionModel)
    model.compile("sgd", "mse")
    assert model.get_scale() == 2.0**15
    unscaled = _functional(mp.MixedPrecisionModel)
    unscaled.compile("sgd", "mse", auto_scale_loss=False)
    assert unscaled.get_scale() == 1.0
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    bf16 = _functional(mp.MixedPrecisionModel)
    bf16.compile("sgd", "mse")
    assert bf16.get_scale() == 1.0


def test_save_and_load_keep_the_scale(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(
        mp.MixedPrecisionModel, loss_scale={"initial_scale": 2.0**24, "growth_interval": 1000}
    )
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(64)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded).__name__ == "MixedPrecisionModel"
    assert loaded.loss_scale_state() == model.loss_scale_state()
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert loaded.predict(x[:4], verbose=0).shape == (4, 1)


def test_from_model_shares_the_layers_and_follows_the_global_policy():
    keras.utils.set_random_seed(3)
    stock = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    keras.mixed_precision.set_global_policy("mixed_float16")
    wrapped = mp.MixedPrecisionModel.from_model(stock)
    assert wrapped.layers[1] is stock.layers[0]
    assert stock.layers[0].compute_dtype == "float16"
    assert stock.layers[-1].compute_dtype == "float32"  # the output stays float32
    wrapped.compile("sgd", "mse")
    assert wrapped.get_scale() == 2.0**15
    with pytest.raises(ValueError, match="known inputs and outputs"):
        mp.MixedPrecisionModel.from_model(keras.Sequential([keras.layers.Dense(1)]))


def test_bad_arguments_name_the_argument_and_the_value():
    with pytest.raises(ValueError, match=r"`loss_scale`.*received loss_scale='dynamic'"):
        _functional(mp.MixedPrecisionModel, loss_scale="dynamic")
    with pytest.raises(ValueError, match=r"loss_scale=0\.0"):
        _functional(mp.MixedPrecisionModel, loss_scale=0.0)
    with pytest.raises(ValueError, match="growth_interval"):
        _functional(mp.MixedPrecisionModel, loss_scale={"growth_interval": 0})
    with pytest.raises(TypeError, match="loss_scale"):
        _functional(mp.MixedPrecisionModel, loss_scale=[2.0])


def test_the_first_compile_warns_what_check_model_finds_once():
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(8)(inputs))
    model = mp.MixedPrecisionModel(inputs, outputs)
    findings = mp.check_model(model)
    assert [f.kind for f in findings] == ["output_dtype"]
    with pytest.warns(
        mp.MixedPrecisionWarning, match=r"(?s)check_model found 1 .*softmax is computed in float16"
    ):
        model.compile("sgd", "sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error", mp.MixedPrecisionWarning)
        model.compile("sgd", "sparse_categorical_crossentropy")


def test_a_loaded_model_is_compiled_and_keeps_training(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    x, y = _data(16)
    model.fit(x, y, batch_size=8, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.compiled
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    history = loaded.fit(x, y, batch_size=8, verbose=0).history
    assert set(mp.LOG_KEYS) <= set(history)


def _trained_mixed_model():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(mp.MixedPrecisionModel, dropout=False)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    x, y = _data(32)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return model, x


def test_weights_load_into_a_plain_keras_model_for_serving(tmp_path):
    model, x = _trained_mixed_model()
    path = str(tmp_path / "served.weights.h5")
    model.save_weights(path)
    served = _functional(keras.Model, dropout=False)
    served.load_weights(path)
    assert len(served.weights) == len(model.weights)  # the scale is kept apart
    for a, b in zip(served.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_array_equal(served.predict(x, verbose=0), model.predict(x, verbose=0))


def test_float32_copy_computes_in_float32_and_leaves_the_original_working():
    model, x = _trained_mixed_model()
    before = model.predict(x, verbose=0)
    copy = mp.float32_copy(model)
    assert all(layer.compute_dtype == "float32" for layer in copy.layers[1:])
    keras.mixed_precision.set_global_policy("float32")
    reference = _functional(keras.Model, dropout=False)
    reference.set_weights([w.numpy() for w in model.weights])
    np.testing.assert_array_equal(copy.predict(x, verbose=0), reference.predict(x, verbose=0))
    # Its buffers are its own: the original still predicts (and trains).
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)
    model.fit(x, x[:, :1], batch_size=8, verbose=0)


def test_with_float32_layers_keeps_the_named_layer_in_float32():
    model, x = _trained_mixed_model()
    batch_norm = next(
        layer.name for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)
    )
    adapted = mp.with_float32_layers(model, [batch_norm])
    dtypes = {layer.name: layer.compute_dtype for layer in adapted.layers[1:]}
    assert dtypes[batch_norm] == "float32"
    assert sorted(set(dtypes.values())) == ["float16", "float32"]
    adapted.compile("sgd", "mse")
    history = adapted.fit(x, x[:, :1], batch_size=8, verbose=0).history
    assert set(mp.LOG_KEYS) <= set(history)


#: Every feature Keras's optimizers offer on top of the update itself.
_OPTIMIZER_FEATURES = {
    "gradient_accumulation": {"gradient_accumulation_steps": 2},
    "ema": {"use_ema": True, "ema_overwrite_frequency": 3},
    "clipnorm": {"clipnorm": 0.1},
    "global_clipnorm": {"global_clipnorm": 0.1},
    "clipvalue": {"clipvalue": 0.01},
    "weight_decay": {"weight_decay": 0.05},
    "schedule": {"learning_rate": keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)},
}


@pytest.mark.parametrize("feature", sorted(_OPTIMIZER_FEATURES))
def test_every_optimizer_feature_trains_as_stock_and_a_skip_keeps_its_state(feature):
    x, y = _data(24)
    trained = []
    for cls in (keras.Model, mp.MixedPrecisionModel):
        model = _functional(cls)
        model.compile(keras.optimizers.Adam(**{"learning_rate": 0.01, **_OPTIMIZER_FEATURES[feature]}), "mse")
        keras.utils.set_random_seed(5)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)  # 3 steps: mid-accumulation
        trained.append(model)
    stock, ours = (_values(m) for m in trained)
    assert len(ours) == len(stock)
    for a, b in zip(ours, stock):
        np.testing.assert_array_equal(a, b)
    before = _state(trained[1])
    if feature == "gradient_accumulation":
        assert any("gradient_accumulator" in p and np.any(v) for p, v in before.items())
    bad = x[:8].copy()
    bad[0, 0] = np.nan
    history = trained[1].fit(bad, y[:8], batch_size=8, epochs=1, verbose=0).history
    after = _state(trained[1])
    assert [p for p in before if not np.array_equal(before[p], after[p])] == []
    assert history["skipped_steps"] == [1.0]


def test_a_trained_model_pickles_and_trains_on_as_the_original():
    # Keras pickles a model as its .keras archive (for distributed
    # frameworks); a functional MixedPrecisionModel's class is made at run
    # time, which pickle could not find by name.
    import pickle

    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(
        mp.MixedPrecisionModel, dropout=False, loss_scale={"initial_scale": 1024.0, "growth_interval": 1}
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    x, y = _data(32)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    copy = pickle.loads(pickle.dumps(model))
    assert isinstance(copy, mp.MixedPrecisionModel)
    assert copy.loss_scale_state() == model.loss_scale_state()
    assert model.get_scale() != 1024.0  # the state pickled is the trained one
    histories = [m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history for m in (model, copy)]
    assert histories[0] == histories[1]
    for a, b in zip(model.weights + model.optimizer.variables, copy.weights + copy.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize(
    "optimizer", [lambda: keras.optimizers.SGD(0.01, momentum=0.9), lambda: keras.optimizers.Adam(1e-3)]
)
def test_the_reference_step_trains_bit_for_bit_as_the_fast_one(optimizer):
    # `fast_step = False` swaps each backend's speed work (TF: the compiled
    # or gated update; JAX: the gated writes; torch: the host's share of the
    # scale's update) for the reference path: the training must not change.
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data(64)
    x[20, 1] = np.nan  # step 2 skipped for its loss, after the scale's back-offs
    trained = []
    for fast in (True, False):
        model = _functional(
            mp.MixedPrecisionModel, loss_scale={"initial_scale": 2.0**19, "growth_interval": 3}
        )
        model.fast_step = fast
        model.compile(optimizer(), "mse")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
        trained.append((_state(model), model.loss_scale_state(), history))
    (fast_state, fast_scale, fast_logs), (reference_state, reference_scale, reference_logs) = trained
    assert fast_scale == reference_scale
    assert fast_scale["skipped_steps"] >= 3  # overflows (calibration) and the NaN batch
    np.testing.assert_equal(fast_logs, reference_logs)
    assert 0 < fast_logs["skipped_steps"][1] < 8 and math.isfinite(fast_logs["grad_norm"][0])
    assert len(fast_state) == len(reference_state)  # (the layers' names differ)
    for (path, value), reference in zip(fast_state.items(), reference_state.values()):
        np.testing.assert_array_equal(reference, value, err_msg=path)
