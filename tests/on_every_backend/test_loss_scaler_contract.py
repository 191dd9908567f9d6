"""`LossScaler` on every backend: TensorFlow's arguments, checks and
config; the model trains with the object it is given, and the object reads
the model's state."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from scale_cases import LOSS_SCALE_REFUSALS, REFUSALS, UNREPRESENTABLE

import mp_callbacks as mp
from mp_callbacks import LossScaler


def _model(loss_scale):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    outputs = keras.layers.Dense(1, dtype="float32")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=loss_scale)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


@pytest.mark.parametrize("kwargs, argument", UNREPRESENTABLE)
def test_unrepresentable_values_are_refused_at_construction(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        LossScaler(**kwargs)


@pytest.mark.parametrize("kwargs, message", REFUSALS)
def test_refusals_say_what_tensorflows_say(kwargs, message):
    with pytest.raises((ValueError, TypeError)) as caught:
        LossScaler(**kwargs)
    assert str(caught.value) == f"LossScaler: {message}"


@pytest.mark.parametrize("value, error, message", LOSS_SCALE_REFUSALS)
def test_loss_scale_arguments_are_refused_as_on_tensorflow(value, error, message):
    from mp_callbacks.backends.common.model import scaler_from_argument

    with pytest.raises(error) as caught:
        scaler_from_argument(value, owner="Owner")
    assert str(caught.value) == message


def test_config_fixed_and_disabled_are_tensorflows():
    scaler = LossScaler(initial_scale=2.0**10, growth_interval=50, hysteresis=2, name="mine")
    assert scaler.get_config() == {
        "initial_scale": 1024.0,
        "growth_interval": 50,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
        "hysteresis": 2,
        "name": "mine",
    }
    assert LossScaler.from_config(scaler.get_config()).get_config() == scaler.get_config()
    assert scaler.is_dynamic and scaler.get_scale() == 1024.0
    fixed = LossScaler.fixed(8.0)
    assert not fixed.is_dynamic and fixed.scaling_active and fixed.get_scale() == 8.0
    assert repr(fixed) == "LossScaler.fixed(8.0)"
    disabled = LossScaler.disabled()
    assert not disabled.scaling_active and disabled.get_scale() == 1.0


def test_the_model_trains_with_the_object_and_the_object_reads_the_models_state():
    keras.mixed_precision.set_global_policy("mixed_float16")
    scaler = LossScaler(initial_scale=2.0**24, growth_interval=1000)
    model = _model(scaler)
    assert model.scaler is scaler
    x, y = _data(128)  # 2**24 times these gradients overflows float16
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    state = scaler.diagnostics()
    assert 1 <= state["skipped_steps"] < 16 and state["step_count"] == 16
    assert scaler.get_scale() == model.get_scale() == 2.0 ** (24 - state["skipped_steps"])
    assert history["loss_scale"] == [scaler.get_scale()]
    assert model.scaler is scaler  # compile and fit kept it


def test_set_loss_scale_resumes_from_the_objects_state_and_the_next_fit_uses_it():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _model("auto")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    scaler = LossScaler(initial_scale=2.0**15)
    scaler.set_state({"scale": np.float32(64.0), "step_count": np.int64(7)})
    model.set_loss_scale(scaler)
    assert model.scaler is scaler and model.get_scale() == 64.0
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    assert history["loss_scale"] == [64.0]
    assert scaler.diagnostics()["step_count"] == 7 + 4


def test_a_bad_restore_changes_nothing():
    scaler = LossScaler(initial_scale=64.0)
    before = scaler.diagnostics()
    with pytest.raises(ValueError, match="loss scale"):
        scaler.set_state({"good_steps": np.int64(7), "scale": np.float32(np.nan)})
    assert scaler.diagnostics() == before


def test_save_and_load_keep_the_settings_and_the_state(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _model(LossScaler(initial_scale=2.0**24, growth_interval=1000, hysteresis=2))
    x, y = _data(64)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.scaler, LossScaler)
    assert loaded.scaler.get_config() == model.scaler.get_config()
    assert loaded.scaler.diagnostics() == model.scaler.diagnostics()
