"""`EpochTimer`: how long each epoch takes, and how many steps and samples
per second that is."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any

from mp_callbacks._callback_support import MixedPrecisionCallback
from mp_callbacks._keras_internals import loss_tracker
from mp_callbacks._loss_scale_source import read_variable
from mp_callbacks._validation import check_bool, check_int

__all__ = ["EpochTimer"]

logger = logging.getLogger(__name__)

# Where an epoch is: fit's validation runs between training and epoch end,
# and evaluate() outside an epoch must not be taken for it.
_IDLE, _TRAINING, _VALIDATING, _VALIDATED = "idle", "training", "validating", "validated"


class EpochTimer(MixedPrecisionCallback):
    """Times every epoch and puts the figures in the epoch logs.

    Logs `epoch_time` (seconds of training in the epoch, validation
    excluded), `steps_per_sec` and `samples_per_sec`, and with
    `time_validation=True` also `val_time`. The first epoch includes
    tracing and compilation, so it is marked and left out of the summary's
    median. Uses a monotonic clock and reads nothing from the device per
    step. The sample count is read once per epoch: a `MixedPrecisionModel`
    counts the samples of every batch its steps see (its own `train_step`
    or yours); otherwise it is `batch_size` times the steps when given, or
    Keras's loss tracker when that counts samples (a `train_step` that
    updates it with a scalar loss counts steps: `samples_per_sec` is then
    left out rather than wrong). Works on any `keras.Model`.

    Args:
        time_validation: bool. Also log the validation time as `val_time`.
            Defaults to `False`.
        batch_size: int or None. Samples per step, for a stock model whose
            sample count cannot be read (a custom `train_step`). Defaults to
            None.

    Raises:
        ValueError: `batch_size` is not a positive integer.
        TypeError: an argument of the wrong type (a string for a number).

    Attributes:
        records: one dict per epoch: `epoch`, `epoch_time`, `steps`,
            `samples`, `steps_per_sec`, `samples_per_sec`, `val_time`,
            `warm` (False for the first epoch of a fit).

    Example:

    ```python
    import keras, numpy as np
    from mp_callbacks import EpochTimer

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    timer = EpochTimer(time_validation=True)
    history = model.fit(np.ones((64, 8)), np.zeros((64, 1)), batch_size=16,
                        epochs=3, validation_split=0.25, callbacks=[timer], verbose=0)
    print(len(history.history["samples_per_sec"]), timer.records[-1]["samples"])  # 3 48.0
    ```
    """

    def __init__(self, time_validation: bool = False, batch_size: int | None = None) -> None:
        super().__init__()
        if batch_size is not None:
            batch_size = check_int(
                "EpochTimer", "batch_size", batch_size, low=1, requirement="None or an integer >= 1"
            )
        self.time_validation = check_bool("EpochTimer", "time_validation", time_validation)
        self.batch_size = batch_size
        self.records: list[dict[str, Any]] = []
        self._clock = time.perf_counter
        self._warned_samples = False
        # Per-fit and per-epoch state; every hook that reads it is preceded
        # by the hook that sets it, so these are placeholders.
        self._phase = _IDLE
        self._train_begin = 0.0
        self._epoch_begin = 0.0
        self._train_seconds = 0.0
        self._samples: float | None = None
        self._val_begin = 0.0
        self._val_seconds: float | None = None
        self._epoch_steps = 0
        self._total_seconds = 0.0
        # Batch-end hooks may still be queued when validation begins (Keras
        # runs them on a thread pool on JAX and torch, and waits for them
        # only at the epoch's end): the training part waits for them.
        self._batch_hooks_done = threading.Condition(self._batch_lock)
        self._batches_begun = 0
        self._batches_ended = 0

    def get_config(self) -> dict[str, Any]:
        return {"time_validation": self.time_validation, "batch_size": self.batch_size}

    # ------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self.records = []
        self._train_begin = self._clock()

    def on_epoch_begin(self, epoch, logs=None):
        self._phase = _TRAINING
        self._val_seconds = None
        with self._batch_hooks_done:
            self._epoch_steps = 0
            self._batches_begun = 0
            self._batches_ended = 0
            self._last_batch_end: float | None = None
        self._epoch_begin = self._clock()

    def on_train_batch_begin(self, batch, logs=None):
        # Keras calls begin hooks in step order, on the training thread.
        with self._batch_hooks_done:
            self._batches_begun += 1

    def on_train_batch_end(self, batch, logs=None):
        self._note_batch(batch)
        # Training ends at the last batch, not at this callback's epoch end:
        # callbacks before it (NaNGradientMonitor's replay) are not training.
        now = self._clock()
        with self._batch_hooks_done:
            # Hooks may run out of order (JAX, torch): keep the latest.
            self._last_batch_end = now if self._last_batch_end is None else max(self._last_batch_end, now)
            self._batches_ended += 1
            self._batch_hooks_done.notify_all()

    def on_test_begin(self, logs=None):
        if self._phase == _TRAINING:  # fit's validation (not evaluate() outside fit)
            self._wait_for_batch_hooks()
            self._end_training_part()
            self._phase = _VALIDATING
            self._val_begin = self._clock()

    def on_test_end(self, logs=None):
        if self._phase == _VALIDATING:
            self._val_seconds = self._clock() - self._val_begin
            self._phase = _VALIDATED

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        if self._phase == _TRAINING:
            self._end_training_part()
        self._phase = _IDLE
        seconds = self._train_seconds
        record: dict[str, Any] = {
            "epoch": epoch,
            "epoch_time": seconds,
            "steps": self._epoch_steps,
            "samples": self._samples,
            # A zero-length epoch (a coarse clock, or no step) has no rate.
            "steps_per_sec": self._epoch_steps / seconds if seconds > 0 else 0.0,
            "samples_per_sec": (
                self._samples / seconds if self._samples is not None and seconds > 0 else None
            ),
            "val_time": self._val_seconds,
            "warm": bool(self.records),
        }
        self.records.append(record)
        logs["epoch_time"] = seconds
        logs["steps_per_sec"] = record["steps_per_sec"]
        if record["samples_per_sec"] is not None:
            logs["samples_per_sec"] = record["samples_per_sec"]
        if self.time_validation and self._val_seconds is not None:
            logs["val_time"] = self._val_seconds

    def on_train_end(self, logs=None):
        self._total_seconds = self._clock() - self._train_begin
        summary = self.summary()
        if summary["epochs"]:
            logger.info(
                "EpochTimer: %d epoch(s) in %.2f s; first epoch (tracing included) %.2f s; "
                "median warm epoch %.2f s (%s samples/s).",
                summary["epochs"],
                summary["total_time"],
                summary["first_epoch_time"],
                summary["median_epoch_time"],
                "n/a"
                if summary["median_samples_per_sec"] is None
                else f"{summary['median_samples_per_sec']:.0f}",
            )

    # ------------------------------------------------------------ results
    def summary(self) -> dict[str, Any]:
        """`epochs`, `total_time` (whole fit), `first_epoch_time`,
        `median_epoch_time`, `median_steps_per_sec`, `median_samples_per_sec`
        (medians over warm epochs, or the only epoch when there is one)."""
        warm = [r for r in self.records if r["warm"]] or self.records
        rates = [r["samples_per_sec"] for r in warm if r["samples_per_sec"] is not None]
        return {
            "epochs": len(self.records),
            "total_time": self._total_seconds,
            "first_epoch_time": self.records[0]["epoch_time"] if self.records else None,
            "median_epoch_time": statistics.median(r["epoch_time"] for r in warm) if warm else None,
            "median_steps_per_sec": statistics.median(r["steps_per_sec"] for r in warm) if warm else None,
            "median_samples_per_sec": statistics.median(rates) if rates else None,
        }

    # ------------------------------------------------------------ helpers
    def _wait_for_batch_hooks(self, timeout: float = 60.0) -> None:
        """Waits until every batch that began this epoch has had its end
        hook counted (queued hooks run on Keras's own threads, never this
        one); after `timeout` seconds it counts what it has."""
        with self._batch_hooks_done:
            self._batch_hooks_done.wait_for(lambda: self._batches_ended >= self._batches_begun, timeout)

    def _end_training_part(self) -> None:
        end = self._last_batch_end if self._last_batch_end is not None else self._clock()
        self._train_seconds = end - self._epoch_begin
        self._samples = self._count_samples()

    def _count_samples(self) -> float | None:
        if self._epoch_steps == 0:
            return 0.0  # the counters still hold the previous epoch's count
        counted = getattr(self.model, "epoch_sample_count", None)
        if callable(counted):
            return counted()
        if self.batch_size is not None:
            return float(self.batch_size * self._epoch_steps)
        # Keras's loss tracker is a Mean weighted by batch size in Keras's own
        # train_step: its count is the samples trained on this epoch. A step
        # that updates it with the scalar loss alone makes it count steps.
        tracker = loss_tracker(self.model)
        count = getattr(tracker, "count", None)
        if count is not None:
            samples = float(read_variable(count))
            if samples > 0 and samples != self._epoch_steps:
                return samples
        if not self._warned_samples:
            self._warned_samples = True
            logger.info(
                "EpochTimer: cannot count samples for %r; pass batch_size= to get samples_per_sec.",
                self.model.name,
            )
        return None
