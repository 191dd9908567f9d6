"""HeadroomMonitor on the models users bring: it changes nothing it
measures, tells a model it cannot probe, and calls only overflow overflow."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from keras_io_models import Sampling, gan, vae

import mp_callbacks as mp


def _sampling_model():
    # Samples at inference too, as the VAE's encoder does: a probe that
    # runs it advances the SeedGenerator unless it puts the state back.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    z_mean = keras.layers.Dense(2)(inputs)
    z_log_var = keras.layers.Dense(2)(inputs)
    z = Sampling(dtype="float32")([z_mean, z_log_var])
    outputs = keras.layers.Dense(1, dtype="float32")(z)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _run(build, data, monitor=None):
    model = build()
    history = model.fit(
        *data, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[monitor] if monitor else []
    ).history
    return [history[k] for k in sorted(history) if not k.startswith("headroom")], model.get_weights()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["functional", "vae"])
def test_the_probe_changes_nothing_it_measures(case):
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(32, 6))).astype("float32") / 4
    if case == "functional":
        build, data, target = _sampling_model, (x, np.zeros((32, 1), "float32")), None
    else:
        build, data, target = vae, (x,), "encoder"
    without = _run(build, data)
    monitor = mp.HeadroomMonitor(probe=x[:4], every_n_steps=1, target=target)
    with_probe = _run(build, data, monitor)
    assert len(monitor.history) == 8 and monitor.history[0]["headroom"]
    assert with_probe[0] == without[0]  # every logged figure, bit for bit
    for ours, theirs in zip(with_probe[1], without[1]):
        np.testing.assert_array_equal(ours, theirs)


def test_a_model_without_call_is_said_once_and_fit_goes_on():
    keras.config.set_dtype_policy("mixed_float16")
    model = gan()
    data = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
    monitor = mp.HeadroomMonitor(probe=data[:2], every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(data, batch_size=8, epochs=2, verbose=0, callbacks=[monitor]).history
    said = [str(w.message) for w in caught if "HeadroomMonitor" in str(w.message)]
    assert len(said) == 1 and "target=" in said[0] and "'generator'" in said[0]
    assert len(history["d_loss"]) == 2 and monitor.history == []
    # Given a sub-model, it probes that one.
    monitor = mp.HeadroomMonitor(probe=np.ones((2, 3), "float32"), every_n_steps=1, target="generator")
    history = model.fit(data, batch_size=8, epochs=1, verbose=0, callbacks=[monitor]).history
    assert any(k.startswith("headroom/") for k in history) and len(monitor.history) == 2
    with pytest.raises(ValueError, match=r"target.*'discriminator', 'generator'"):
        model.fit(
            data,
            batch_size=8,
            epochs=1,
            verbose=0,
            callbacks=[mp.HeadroomMonitor(probe=data[:2], target="decoder")],
        )


def test_nan_weights_are_not_called_an_overflow():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    broken = keras.layers.Dense(4, name="broken")
    hidden = keras.layers.Dense(4, name="after")(broken(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    model.compile("sgd", "mse")
    kernel = broken.kernel.numpy()
    kernel[0, 0] = np.nan
    broken.kernel.assign(kernel)
    x = np.ones((8, 4), "float32")
    monitor = mp.HeadroomMonitor(probe=x[:2], every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.set_model(model)
        monitor.on_train_begin()
        monitor.on_epoch_begin(0)
        monitor.on_train_batch_end(0)
    messages = [str(w.message) for w in caught if issubclass(w.category, mp.MixedPrecisionWarning)]
    assert len(messages) == 1  # 'after' inherits the NaN and is not named
    assert "'broken'" in messages[0] and "weights are not finite" in messages[0]
    assert "overflow" in messages[0] and "with_float32_layers" not in messages[0]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_only_layers_with_float16s_range_are_logged_unless_chosen(policy):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head", dtype="float32")(hidden))
    model.compile("sgd", "mse")
    x, y = np.ones((16, 4), "float32"), np.zeros((16, 1), "float32")
    history = model.fit(
        x, y, batch_size=8, verbose=0, callbacks=[mp.HeadroomMonitor(probe=x[:2], every_n_steps=1)]
    ).history
    assert not [k for k in history if k.startswith("headroom/")]
    history = model.fit(
        x,
        y,
        batch_size=8,
        verbose=0,
        callbacks=[mp.HeadroomMonitor(probe=x[:2], every_n_steps=1, layers=["hidden"])],
    ).history
    assert [k for k in history if k.startswith("headroom/")] == ["headroom/hidden"]
    assert 0 < history["headroom/hidden"][0] < 1e-30  # the share of 3.4e38 it uses


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_every_n_steps_counts_steps_not_executions(steps_per_execution):
    # 8 batches in executions of 3 end at steps 3, 6 and 8: a probe after
    # each execution that reaches a multiple of 2, and the history numbers
    # the steps; the second epoch goes on from the first's 8.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    model = _sampling_model()
    model.compile(keras.optimizers.SGD(0.05), "mse", steps_per_execution=steps_per_execution)
    monitor = mp.HeadroomMonitor(probe=x[:4], every_n_steps=2)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    expected = {1: [2, 4, 6, 8, 10, 12, 14, 16], 3: [3, 6, 8, 11, 14, 16]}[steps_per_execution]
    assert [record["step"] for record in monitor.history] == expected
    assert [record["epoch"] for record in monitor.history] == [0] * (len(expected) // 2) + [1] * (
        len(expected) // 2
    )
