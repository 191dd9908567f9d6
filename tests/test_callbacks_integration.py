"""The three callbacks together in one real fit, read back through History,
CSVLogger and TensorBoard's event files."""

from __future__ import annotations

import copy
import csv

import keras
import pytest
import tensorflow as tf
from helpers import classification_data, tiny_classifier
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import mp_callbacks as mp

# Its module-scoped fixtures are built once: the whole file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_callbacks_integration")

EPOCHS = 3


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fit")
    x, y = classification_data(n=64)
    model = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=32.0, growth_interval=5))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    monitor = mp.LossScaleMonitor(every_n_steps=3)
    nan_monitor = mp.NaNGradientMonitor(check_every=2)
    timer = mp.EpochTimer(time_validation=True)
    csv_path = directory / "log.csv"
    tb_dir = directory / "tb"
    batch_logs = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_logs.append({k: float(v) for k, v in logs.items()})
    )
    history = model.fit(
        x,
        y,
        epochs=EPOCHS,
        batch_size=16,
        validation_split=0.25,
        verbose=0,
        callbacks=[
            monitor,
            nan_monitor,
            timer,
            keras.callbacks.CSVLogger(str(csv_path)),
            keras.callbacks.TensorBoard(str(tb_dir), update_freq=1),
            recorder,
        ],
    )
    return {
        "model": model,
        "history": history.history,
        "monitor": monitor,
        "nan_monitor": nan_monitor,
        "timer": timer,
        "csv_path": csv_path,
        "tb_dir": tb_dir,
        "batch_logs": batch_logs,
    }


CALLBACK_KEYS = {"loss_scale", "skipped_steps", "epoch_time", "steps_per_sec", "samples_per_sec", "val_time"}


def test_history_has_every_callback_key(fitted):
    history = fitted["history"]
    assert set(history) >= CALLBACK_KEYS
    for key in CALLBACK_KEYS:
        assert len(history[key]) == EPOCHS
    # 48 training samples, 3 steps per epoch; growth every 5 steps: 32 -> 64 at step 5.
    assert history["loss_scale"] == [32.0, 64.0, 64.0]
    assert history["skipped_steps"] == [0.0, 0.0, 0.0]
    # The sample count is read from the model, not derived from the rate.
    assert [r["samples"] for r in fitted["timer"].records] == [48.0, 48.0, 48.0]
    assert [r["steps"] for r in fitted["timer"].records] == [3, 3, 3]
    assert history["val_time"] == [r["val_time"] for r in fitted["timer"].records]


def test_csv_logger_has_the_columns(fitted):
    with open(fitted["csv_path"], newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == EPOCHS
    assert CALLBACK_KEYS | {"grad_norm", "skipped_steps"} <= set(rows[0])
    assert [float(r["loss_scale"]) for r in rows] == [32.0, 64.0, 64.0]
    assert all(float(r["epoch_time"]) > 0 for r in rows)


def _scalars(events, tag):
    return [(event.step, float(tf.make_ndarray(event.tensor_proto))) for event in events.Tensors(tag)]


def test_tensorboard_event_files_hold_the_scalars(fitted):
    """TensorBoard's own reader finds the step's figures, per batch with
    update_freq=1 and per epoch, equal to what the logs held."""
    events = EventAccumulator(str(fitted["tb_dir"] / "train"), size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags()["tensors"])
    assert {"batch_loss_scale", "batch_skipped_steps", "batch_grad_norm"} <= tags
    assert {"epoch_loss_scale", "epoch_skipped_steps", "epoch_grad_norm", "epoch_epoch_time"} <= tags
    history, batch_logs = fitted["history"], fitted["batch_logs"]
    # 3 steps per epoch: growth every 5 steps doubles the scale after step 5.
    assert _scalars(events, "batch_loss_scale") == [
        (step, 32.0 if step < 5 else 64.0) for step in range(1, 3 * EPOCHS + 1)
    ]
    for name in ("skipped_steps", "grad_norm"):
        assert [value for _, value in _scalars(events, f"batch_{name}")] == pytest.approx(
            [logs[name] for logs in batch_logs]
        )
        assert _scalars(events, f"epoch_{name}") == [
            (epoch, pytest.approx(value)) for epoch, value in enumerate(history[name])
        ]
    assert [value for _, value in _scalars(events, "epoch_loss_scale")] == [32.0, 64.0, 64.0]
    assert len(events.Tensors("epoch_epoch_time")) == EPOCHS


def test_loss_scale_monitor_records_every_n_steps(fitted):
    records = fitted["monitor"].history
    # Steps 3, 6, 9 are both every-3 points and epoch ends: one record each.
    assert [(r["epoch"], r["step"], r["loss_scale"]) for r in records] == [
        (0, 3, 32.0),
        (1, 6, 64.0),
        (2, 9, 64.0),
    ]


def test_epoch_timer_summary_and_records(fitted):
    timer = fitted["timer"]
    assert [r["warm"] for r in timer.records] == [False, True, True]
    assert [r["steps"] for r in timer.records] == [3, 3, 3]
    summary = timer.summary()
    assert summary["epochs"] == EPOCHS
    warm = sorted(r["epoch_time"] for r in timer.records[1:])
    assert summary["median_epoch_time"] == pytest.approx(sum(warm) / 2)
    assert summary["first_epoch_time"] == timer.records[0]["epoch_time"]
    # Exact totals and the exclusion of validation are checked with a fake
    # clock in test_callback_reuse.py.


@pytest.mark.parametrize(
    "callback",
    [
        mp.LossScaleMonitor(every_n_steps=4, collapse_threshold=8.0, max_skipped_fraction=0.2),
        mp.NaNGradientMonitor(patience=3, action="warn", check_every=7),
        mp.EpochTimer(time_validation=True, batch_size=32),
    ],
    ids=lambda c: type(c).__name__,
)
def test_deepcopy_keeps_config_and_drops_the_model(callback, fitted):
    callback.set_model(fitted["model"])
    clone = copy.deepcopy(callback)
    assert type(clone) is type(callback)
    assert clone.get_config() == callback.get_config()
    assert getattr(clone, "_model", None) is None
    assert type(callback).from_config(callback.get_config()).get_config() == callback.get_config()
