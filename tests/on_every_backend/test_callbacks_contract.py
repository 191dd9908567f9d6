"""LossScaleMonitor, EpochTimer and HeadroomMonitor on every backend: they
read what the step logs during an epoch and the model only between epochs."""

from __future__ import annotations

import time
import warnings

import keras
import numpy as np
import pytest

import mp_callbacks as mp


def _model(loss_scale="auto"):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8)(inputs)
    h = keras.layers.BatchNormalization()(h)
    return mp.MixedPrecisionModel(inputs, keras.layers.Dense(1, dtype="float32")(h), loss_scale=loss_scale)


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def test_loss_scale_monitor_records_the_scale_every_n_steps_from_the_logs():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _model(loss_scale={"initial_scale": 2.0**24, "growth_interval": 1000})
    model.compile(keras.optimizers.SGD(0.01), "mse")
    monitor = mp.LossScaleMonitor(every_n_steps=2, max_skipped_fraction=1.0)
    x, y = _data(128)
    history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[monitor], verbose=0).history
    state = model.loss_scale_state()
    steps = [record["step"] for record in monitor.history]
    assert steps == list(range(2, 33, 2))
    # The scale only comes down while calibrating, never back up here.
    scales = [record["loss_scale"] for record in monitor.history]
    assert scales == sorted(scales, reverse=True)
    assert scales[0] < 2.0**24 and scales[-1] == state["scale"]
    assert history["loss_scale"][-1] == state["scale"]


def test_loss_scale_monitor_warns_when_too_many_steps_are_skipped():
    model = _model()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(32)
    y[::8] = np.nan  # every batch of 8 holds one NaN target: every step skips
    monitor = mp.LossScaleMonitor(max_skipped_fraction=0.5)
    with pytest.warns(
        mp.MixedPrecisionWarning, match=r"4 of 4 steps \(100%\).*4 of them had a non-finite loss"
    ):
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0, shuffle=False)
    assert monitor.history == [{"epoch": 0, "step": 4, "loss_scale": 1.0}]


def test_loss_scale_monitor_warns_once_the_scale_collapses():
    keras.mixed_precision.set_global_policy("mixed_float16")
    # A floor the gradients overflow at: the scale reaches it and stays.
    model = _model(loss_scale={"initial_scale": 2.0**24, "min_scale": 2.0**22, "growth_interval": 1000})
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(64)
    monitor = mp.LossScaleMonitor(max_skipped_fraction=1.0)
    with pytest.warns(mp.MixedPrecisionWarning, match="Loss scale collapsed to 4.1943e\\+06 \\(its minimum"):
        model.fit(x, y, batch_size=8, epochs=1, callbacks=[monitor], verbose=0)


def test_a_healthy_fit_with_the_monitor_warns_nothing():
    model = _model()
    model.compile("adam", "mse")
    x, y = _data(32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mp.MixedPrecisionWarning)
        history = model.fit(
            x, y, batch_size=8, epochs=2, callbacks=[mp.LossScaleMonitor()], verbose=0
        ).history
    assert history["loss_scale"] == [1.0, 1.0]


def test_epoch_timer_counts_the_samples_the_steps_saw():
    model = _model()
    model.compile("sgd", "mse")
    x, y = _data(40)
    timer = mp.EpochTimer(time_validation=True)
    history = model.fit(
        x, y, batch_size=8, epochs=2, validation_split=0.2, callbacks=[timer], verbose=0
    ).history
    assert [record["samples"] for record in timer.records] == [32.0, 32.0]
    assert [record["steps"] for record in timer.records] == [4, 4]
    assert len(history["samples_per_sec"]) == 2 and all(rate > 0 for rate in history["samples_per_sec"])
    assert all(record["val_time"] is not None for record in timer.records)


class _SlowBatchEnd(keras.callbacks.Callback):
    """An async-safe callback whose batch-end hook is slow: Keras runs the
    hooks of a batch in turn on its thread pool, so the timer's hooks after
    it are still queued when validation begins."""

    def __init__(self):
        super().__init__()
        self.async_safe = True

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.3)


def test_epoch_timer_counts_every_step_when_validation_begins_before_the_batch_hooks_ran():
    model = _model()
    model.compile("sgd", "mse")
    x, y = _data(40)
    timer = mp.EpochTimer(time_validation=True)
    model.fit(
        x, y, batch_size=8, epochs=2, validation_split=0.2, callbacks=[_SlowBatchEnd(), timer], verbose=0
    )
    assert [record["samples"] for record in timer.records] == [32.0, 32.0]
    assert [record["steps"] for record in timer.records] == [4, 4]
    # The training part ends after the timer's hooks ran, each behind a slow
    # one (the warm epoch's four steps alone take milliseconds).
    assert timer.records[1]["epoch_time"] >= 0.3


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="Keras's torch trainer runs one step per execution"
)
def test_steps_per_execution_that_does_not_divide_the_epoch_counts_each_step_once():
    # 8 batches in executions of 3: Keras ends the last, two-step execution
    # at batch index 8, as if it had run three.
    model = _model()
    model.compile("sgd", "mse", steps_per_execution=3)
    x, y = _data(64)
    monitor, timer = mp.LossScaleMonitor(), mp.EpochTimer(batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mp.MixedPrecisionWarning)
        history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[monitor, timer], verbose=0).history
    assert history["skipped_steps"] == [0.0, 0.0]
    assert [record["steps"] for record in timer.records] == [8, 8]
    assert [record["samples"] for record in timer.records] == [64.0, 64.0]
    assert [record["step"] for record in monitor.history] == [8, 16]


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="Keras's torch trainer runs one step per execution"
)
def test_headroom_monitor_counts_steps_not_executions():
    # Executions of 3 end at steps 3, 6 and 8 of each epoch: a probe after
    # each that reaches a multiple of 2, none more at the epoch's end.
    model = _model()
    model.compile("sgd", "mse", steps_per_execution=3)
    x, y = _data(64)
    monitor = mp.HeadroomMonitor(probe=x[:4], every_n_steps=2)
    model.fit(x, y, batch_size=8, epochs=2, callbacks=[monitor], verbose=0)
    assert [record["step"] for record in monitor.history] == [3, 6, 8, 11, 14, 16]
