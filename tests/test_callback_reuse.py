"""The callbacks under reuse, restore and faults: one object over several
fits and two models, deep copies, a divergence followed by clean data, and
collapses that recover within an epoch."""

from __future__ import annotations

import copy
import warnings

import keras
import numpy as np
import pytest
from helpers import classification_data, overflowing_classifier, tiny_classifier

import mp_callbacks as mp


def _nan_then_clean(n_nan_batches: int, n_clean_batches: int, batch_size: int = 8):
    x, y = classification_data(n=(n_nan_batches + n_clean_batches) * batch_size)
    x[: n_nan_batches * batch_size] = np.nan
    return x, y


def _regression(loss_scale):
    """A model whose loss is NaN when its targets are: divergence at any scale."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(2, name="head")(inputs)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=loss_scale)
    model.compile("sgd", "mse")
    return model


def _nan_targets_then_clean(n_nan_batches: int, n_clean_batches: int, batch_size: int = 8):
    x, _ = classification_data(n=(n_nan_batches + n_clean_batches) * batch_size)
    y = np.zeros((len(x), 2), "float32")
    y[: n_nan_batches * batch_size] = np.nan
    return x, y


def test_no_false_divergence_on_clean_data_after_a_real_one():
    model = _regression(loss_scale=None)
    x_bad, y_bad = _nan_targets_then_clean(4, 0)
    first = mp.NaNGradientMonitor(patience=2, action="stop", check_every=1)
    model.fit(x_bad, y_bad, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[first])
    assert first.error is not None and first.error.step == 2
    assert "the loss was non-finite" in str(first.error)

    x, y = _nan_targets_then_clean(0, 4)
    fresh = mp.NaNGradientMonitor(patience=2, action="stop", check_every=1)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[fresh])
    assert fresh.error is None
    assert len(history.history["loss"]) == 2
    # And the same monitor object, reused, is just as fresh.
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[first])
    assert first.error is None


def test_warn_mode_warns_once_per_divergent_check_and_never_after():
    model = _regression(loss_scale=mp.LossScaler(initial_scale=16384.0))
    x, y = _nan_targets_then_clean(4, 4)
    monitor = mp.NaNGradientMonitor(patience=1, action="warn", check_every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    messages = [
        str(w.message)
        for w in caught
        if issubclass(w.category, mp.MixedPrecisionWarning) and "diverged" in str(w.message)
    ]
    assert len(messages) == 4
    assert [m.split("by step ")[1].split(":")[0] for m in messages] == ["1", "2", "3", "4"]
    assert all("the loss was non-finite" in m and "minimum" not in m for m in messages)
    assert history.history["skipped_steps"] == [4.0]


def _growing_model(name: str = "a"):
    # Scale x16 every 2 finite steps: one growth per 2-step fit.
    model = tiny_classifier(
        loss_scale=mp.LossScaler(
            initial_scale=256.0, growth_interval=2, growth_factor=16.0, max_scale=2.0**30
        )
    )
    model.compile("sgd", "sparse_categorical_crossentropy")
    return model


@pytest.mark.slow
def test_loss_scale_monitor_reused_across_fits_and_models_reads_the_live_scale():
    x, y = classification_data(n=16)
    model = _growing_model()
    monitor = mp.LossScaleMonitor()
    logged, actual = [], []
    for _ in range(3):
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
        logged.append(monitor.history[-1]["loss_scale"])
        actual.append(model.get_scale())
        assert history.history["loss_scale"] == [actual[-1]]
    assert actual == [4096.0, 65536.0, 1048576.0]
    assert logged == actual
    assert len(monitor.history) == 1  # per fit, as keras.callbacks.History

    other = tiny_classifier(loss_scale=8.0, seed=1)
    other.compile("sgd", "sparse_categorical_crossentropy")
    for callback in (monitor, copy.deepcopy(monitor)):
        history = other.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
        assert callback.history[-1]["loss_scale"] == 8.0
        assert history.history["loss_scale"] == [8.0]


def test_loss_scale_monitor_logs_the_scale_on_a_stock_model_with_our_optimizer():
    x, y = classification_data(n=16)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(
        mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[mp.LossScaleMonitor()])
    assert history.history["loss_scale"] == [64.0]


def test_collapse_inside_an_epoch_is_reported_even_after_recovery():
    model = overflowing_classifier(mp.LossScaler(initial_scale=4.0, growth_interval=1, min_scale=1.0))
    model.compile("sgd", "sparse_categorical_crossentropy")
    x, y = _nan_then_clean(2, 6)
    monitor = mp.LossScaleMonitor(max_skipped_fraction=1.0)
    with pytest.warns(mp.MixedPrecisionWarning, match=r"collapsed to 1 .*during epoch 1"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    assert model.get_scale() == 64.0  # 4 -> 2 -> 1, then six growths


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Advance(keras.callbacks.Callback):
    """Moves the fake clock: 1 s per training step, 100 s per validation step."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def on_train_batch_end(self, batch, logs=None):
        self.clock.now += 1.0

    def on_test_batch_end(self, batch, logs=None):
        self.clock.now += 100.0


def test_epoch_time_excludes_validation_exactly():
    x, y = classification_data(n=48)
    model = tiny_classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    clock = _FakeClock()
    timer = mp.EpochTimer(time_validation=True)
    timer._clock = clock
    history = model.fit(
        x[:32],
        y[:32],
        batch_size=8,
        epochs=2,
        verbose=0,
        validation_data=(x[32:], y[32:]),
        callbacks=[_Advance(clock), timer],
    )
    assert history.history["epoch_time"] == [4.0, 4.0]
    assert history.history["val_time"] == [200.0, 200.0]
    assert history.history["steps_per_sec"] == [1.0, 1.0]
    assert history.history["samples_per_sec"] == [8.0, 8.0]
    summary = timer.summary()
    assert summary["total_time"] == 2 * (4.0 + 200.0)
    assert summary["first_epoch_time"] == 4.0 and summary["median_epoch_time"] == 4.0


def test_epoch_with_no_steps_reports_no_samples():
    x, y = classification_data(n=16)
    model = tiny_classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    timer = mp.EpochTimer()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[timer])
    timer.on_epoch_begin(1)
    logs = {}
    timer.on_epoch_end(1, logs)
    assert logs["samples_per_sec"] == 0.0 and logs["steps_per_sec"] == 0.0
    assert timer.records[-1]["samples"] == 0.0


def test_callbacks_raise_no_numpy_deprecation_warning():
    x, y = classification_data(n=16)
    model = tiny_classifier()
    model.compile("sgd", "sparse_categorical_crossentropy")
    callbacks = [mp.LossScaleMonitor(every_n_steps=1), mp.NaNGradientMonitor(check_every=1), mp.EpochTimer()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    ours = [
        w
        for w in caught
        if issubclass(w.category, DeprecationWarning)
        and ("mp_callbacks" in w.filename or "__array__" in str(w.message))
    ]
    assert ours == []
