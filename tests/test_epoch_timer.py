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
    history = _stock_model().fit(np.ones((50, 8)), np.zeros((50, 1)), batch_size=16, epochs=2,
                                 callbacks=[timer], verbose=0).history
    assert {"epoch_time", "steps_per_sec", "samples_per_sec"} <= set(history)
    assert "val_time" not in history
    assert [r["samples"] for r in timer.records] == [50.0, 50.0]
    assert [r["steps"] for r in timer.records] == [4, 4]
    for record in timer.records:
        assert record["steps_per_sec"] == pytest.approx(4 / record["epoch_time"])


def test_validation_is_excluded_from_epoch_time_and_timed_apart():
    timer = mp.EpochTimer(time_validation=True)
    history = _stock_model().fit(np.ones((64, 8)), np.zeros((64, 1)), batch_size=16, epochs=2,
                                 validation_data=(np.ones((4096, 8)), np.zeros((4096, 1))),
                                 callbacks=[timer], verbose=0).history
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
    history = model.fit(np.ones((64, 8)), np.zeros((64, 1)), batch_size=16, epochs=1,
                        callbacks=[untold], verbose=0).history
    assert "samples_per_sec" not in history and "epoch_time" in history


def test_bad_batch_size_is_named():
    with pytest.raises(ValueError, match="`batch_size`.*batch_size=0"):
        mp.EpochTimer(batch_size=0)
