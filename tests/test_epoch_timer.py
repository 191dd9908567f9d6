"""EpochTimer on stock models and with explicit batch sizes."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mp_callbacks as mp


def _stock_model():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def test_works_on_a_stock_model_and_counts_the_last_partial_batch():
    timer = mp.EpochTimer()
    history = (
        _stock_model()
        .fit(np.ones((50, 8)), np.zeros((50, 1)), batch_size=16, epochs=2, callbacks=[timer], verbose=0)
        .history
    )
    assert {"epoch_time", "steps_per_sec", "samples_per_sec"} <= set(history)
    assert "val_time" not in history
    assert [r["samples"] for r in timer.records] == [50.0, 50.0]
    assert [r["steps"] for r in timer.records] == [4, 4]
    for record in timer.records:
        assert record["steps_per_sec"] == pytest.approx(4 / record["epoch_time"])


def test_validation_is_excluded_from_epoch_time_and_timed_apart():
    timer = mp.EpochTimer(time_validation=True)
    history = (
        _stock_model()
        .fit(
            np.ones((64, 8)),
            np.zeros((64, 1)),
            batch_size=16,
            epochs=2,
            validation_data=(np.ones((4096, 8)), np.zeros((4096, 1))),
            callbacks=[timer],
            verbose=0,
        )
        .history
    )
    assert len(history["val_time"]) == 2
    for record in timer.records:
        assert record["val_time"] > 0 and record["samples"] == 64.0


def test_batch_size_argument_when_the_model_has_no_loss_tracker():
    class CustomStep(keras.Model):
        def train_step(self, data):
            return {"custom": 1.0}

    inputs = keras.Input((8,))
    model = CustomStep(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd")
    timer = mp.EpochTimer(batch_size=16)
    model.fit(np.ones((64, 8)), np.zeros((64, 1)), batch_size=16, epochs=1, callbacks=[timer], verbose=0)
    assert timer.records[0]["samples"] == 64.0

    untold = mp.EpochTimer()
    history = model.fit(
        np.ones((64, 8)), np.zeros((64, 1)), batch_size=16, epochs=1, callbacks=[untold], verbose=0
    ).history
    assert "samples_per_sec" not in history and "epoch_time" in history


def test_bad_batch_size_is_named():
    with pytest.raises(ValueError, match=r"`batch_size`.*batch_size=0"):
        mp.EpochTimer(batch_size=0)


# ------------------------------------------- every hook, with a fake clock
class _Clock:
    """Returns the given times, one per call."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def _compiled_model_with_sample_count(count):
    model = _stock_model()
    model.fit(np.ones((2, 8)), np.zeros((2, 1)), verbose=0)  # builds the loss tracker
    model._loss_tracker.count.assign(float(count))
    return model


def test_a_fresh_timer_summarises_nothing():
    assert mp.EpochTimer().summary() == {
        "epochs": 0,
        "total_time": 0.0,
        "first_epoch_time": None,
        "median_epoch_time": None,
        "median_steps_per_sec": None,
        "median_samples_per_sec": None,
    }


def test_hooks_give_exact_records_logs_and_summary():
    timer = mp.EpochTimer(time_validation=True)
    timer.set_model(_compiled_model_with_sample_count(48))
    # train begins at 5; epoch 1: 10 -> 16 training (its batches end at 12,
    # 14, 16), 16 -> 19 validation; epoch 2: 20 -> 22, no validation; epoch
    # 3: 30 -> 34, 34 -> 35; end at 40. Training ends at its last batch.
    timer._clock = _Clock(
        5.0,
        10.0,
        12.0,
        14.0,
        16.0,
        16.0,
        19.0,
        20.0,
        21.0,
        21.5,
        22.0,
        30.0,
        32.0,
        33.0,
        34.0,
        34.0,
        35.0,
        40.0,
    )
    timer.on_train_begin()
    logs_per_epoch = []
    for epoch, validate in enumerate((True, False, True)):
        timer.on_epoch_begin(epoch)
        for batch in range(3):
            timer.on_train_batch_end(batch)
        if validate:
            timer.on_test_begin()
            timer.on_test_end()
        logs = {}
        timer.on_epoch_end(epoch, logs)
        logs_per_epoch.append(logs)
    timer.on_train_end()
    assert logs_per_epoch == [
        {"epoch_time": 6.0, "steps_per_sec": 0.5, "samples_per_sec": 8.0, "val_time": 3.0},
        {"epoch_time": 2.0, "steps_per_sec": 1.5, "samples_per_sec": 24.0},
        {"epoch_time": 4.0, "steps_per_sec": 0.75, "samples_per_sec": 12.0, "val_time": 1.0},
    ]
    assert timer.records[1] == {
        "epoch": 1,
        "epoch_time": 2.0,
        "steps": 3,
        "samples": 48.0,
        "steps_per_sec": 1.5,
        "samples_per_sec": 24.0,
        "val_time": None,
        "warm": True,
    }
    assert [r["warm"] for r in timer.records] == [False, True, True]
    assert timer.summary() == {
        "epochs": 3,
        "total_time": 35.0,
        "first_epoch_time": 6.0,
        "median_epoch_time": 3.0,
        "median_steps_per_sec": 1.125,
        "median_samples_per_sec": 18.0,
    }


def test_validation_time_is_logged_only_when_asked_and_evaluate_outside_fit_is_ignored():
    timer = mp.EpochTimer()  # time_validation defaults to False
    timer.set_model(_compiled_model_with_sample_count(16))
    timer._clock = _Clock(0.0, 1.0, 3.0, 3.0, 4.0, 5.0, 7.0, 9.0)
    timer.on_train_begin()
    timer.on_epoch_begin(0)
    timer.on_train_batch_end(0)
    timer.on_test_begin()  # at 3: training took 2 s
    timer.on_test_end()  # at 4
    logs = {}
    timer.on_epoch_end(0, logs)
    assert logs == {"epoch_time": 2.0, "steps_per_sec": 0.5, "samples_per_sec": 8.0}
    assert timer.records[0]["val_time"] == 1.0
    # An evaluate() after the epoch changes nothing that was recorded, and
    # reads no clock (the clock would run out).
    timer.on_test_begin()
    timer.on_test_end()
    assert timer.records[0]["val_time"] == 1.0 and timer.records[0]["epoch_time"] == 2.0
    timer.on_epoch_begin(1)  # at 5
    timer.on_epoch_end(1, None)  # at 7; logs=None is allowed
    assert timer.records[1]["epoch_time"] == 2.0 and timer.records[1]["val_time"] is None
    timer.on_train_end()  # at 9
    assert timer.summary()["total_time"] == 9.0


def test_zero_length_and_one_sample_epochs():
    timer = mp.EpochTimer()
    timer.set_model(_compiled_model_with_sample_count(2))
    timer._clock = _Clock(0.0, 1.0, 1.0, 2.0, 4.0)
    timer.on_train_begin()
    timer.on_epoch_begin(0)
    timer.on_train_batch_end(0)
    timer.on_epoch_end(0, {})  # no time passed: no rate
    assert timer.records[0]["steps_per_sec"] == 0.0 and timer.records[0]["samples_per_sec"] is None
    timer.on_epoch_begin(1)
    timer.on_train_batch_end(0)
    timer.on_epoch_end(1, {})  # two samples in 2 s
    assert timer.records[1]["samples"] == 2.0 and timer.records[1]["samples_per_sec"] == 1.0


def test_a_model_whose_samples_cannot_be_counted_is_told_once(caplog):
    import types

    timer = mp.EpochTimer()
    timer.set_model(types.SimpleNamespace(name="custom"))  # no loss tracker at all
    timer._clock = _Clock(0.0, 0.0, 1.0, 1.0, 3.0, 3.0)
    with caplog.at_level("INFO", logger="mp_callbacks.epoch_timer"):
        timer.on_train_begin()
        for epoch in range(2):
            timer.on_epoch_begin(epoch)
            timer.on_train_batch_end(0)
            timer.on_epoch_end(epoch, {})
        timer.on_train_end()
    told = [r.getMessage() for r in caplog.records if "cannot count samples" in r.getMessage()]
    assert told == ["EpochTimer: cannot count samples for 'custom'; pass batch_size= to get samples_per_sec."]
    assert [r["samples_per_sec"] for r in timer.records] == [None, None]
    assert timer.summary()["median_samples_per_sec"] is None
    assert timer.summary()["median_steps_per_sec"] == 0.5  # the warm epoch: 1 step in 2 s


def test_batch_size_of_one_is_accepted():
    assert mp.EpochTimer(batch_size=1).batch_size == 1


def test_samples_per_sec_is_right_or_absent_for_the_guides_own_train_step():
    # The guide's step updates the loss tracker with the scalar loss, so
    # the tracker counts steps, not samples.
    from keras_io_models import GuideModel, guide_model

    x = np.ones((32, 4), "float32")
    y = np.zeros((32, 1), "float32")
    stock_step = type("StockGuide", (keras.Model,), {"train_step": GuideModel.train_step})
    counted = {}
    for base in (GuideModel, stock_step):
        model = guide_model(base)
        model.compile("sgd", "mse")
        timer = mp.EpochTimer()
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[timer]).history
        counted[base] = (timer.records[0]["samples"], "samples_per_sec" in history)
    assert counted[GuideModel] == (32.0, True)  # counted from the batches
    assert counted[stock_step] == (None, False)  # not 4 samples: absent


def test_figures_do_not_depend_on_the_callback_order():
    # A callback before the timer that spends 100 s at each epoch end (as
    # NaNGradientMonitor's replay does) is not training time.
    class FakeClock:
        now = 0.0

        def __call__(self):
            self.now += 1.0
            return self.now

    class SlowAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            clock.now += 100.0

    figures = []
    for order in ("timer first", "timer last"):
        clock = FakeClock()
        timer = mp.EpochTimer()
        timer._clock = clock
        callbacks = [timer, SlowAtEpochEnd()] if order == "timer first" else [SlowAtEpochEnd(), timer]
        model = _stock_model()
        model.fit(np.ones((8, 8)), np.zeros((8, 1)), batch_size=4, epochs=2, verbose=0, callbacks=callbacks)
        figures.append([(r["epoch_time"], r["steps"]) for r in timer.records])
    assert figures[0] == figures[1] == [(2.0, 2), (2.0, 2)]
