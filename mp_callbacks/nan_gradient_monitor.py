"""`NaNGradientMonitor`: overflow that loss scaling handles, told apart from
divergence, with the variables and the layer where it starts."""

from __future__ import annotations

import logging
import math
import threading
import warnings
from typing import Any

import numpy as np

from mp_callbacks._backend import keras
from mp_callbacks._callback_support import MixedPrecisionCallback
from mp_callbacks._loss_scale_source import LossScaleSource
from mp_callbacks._validation import check_choice, check_int
from mp_callbacks.diagnosis import diagnose_batch
from mp_callbacks.errors import MixedPrecisionWarning, NonFiniteGradientError

__all__ = ["NaNGradientMonitor"]

logger = logging.getLogger(__name__)

_ACTIONS = ("stop", "raise", "warn")


def _layer_of(variable_path: str) -> str:
    return variable_path.rsplit("/", 1)[0]


def _logged_losses(logs: dict) -> list[Any]:
    """`loss`, or else every training `*loss` entry (a GAN's d_loss, g_loss)."""
    if "loss" in logs:
        return [logs["loss"]]
    return [value for key, value in logs.items() if key.endswith("loss") and not key.startswith("val_")]


class NaNGradientMonitor(MixedPrecisionCallback):
    """Counts non-finite gradient steps and acts when training diverges.

    With `MixedPrecisionModel`, a skipped step whose scale is still above its
    minimum is overflow that loss scaling is handling: it is counted and
    training goes on. Divergence is a non-finite loss, or non-finite
    gradients with the scale pinned at its minimum (or with no loss scaling
    at all), for `patience` consecutive steps; but when the batch of the
    last skipped step holds a NaN or inf input, it is bad data, not
    divergence: the step was skipped, a warning names the rows, and
    training goes on. The diagnosis names the
    variables whose gradients were non-finite and the layer nearest the loss
    among them. `TerminateOnNaN` and Keras's `LossScaleOptimizer` give no
    location; `tf.debugging.enable_check_numerics` does, at a large cost.

    Nothing is read from the device per step: the loss scale's in-graph
    counters (which miss nothing in between) are read every `check_every`
    steps and at every epoch end. The loss scale is found as
    `LossScaleMonitor` finds it (a hand-written `train_step`'s too). Where
    there is none, or no step went through it since the last check (a
    `train_step` of your own that applies its updates elsewhere), the
    losses in the logs (`loss`, or every `*loss` key such as a GAN's
    `d_loss` and `g_loss`) are watched at the same points.

    Args:
        patience: int >= 1. Consecutive divergent steps that count as
            divergence. Defaults to `1`.
        action: str. `"stop"` (set `model.stop_training`, like
            `TerminateOnNaN`), `"raise"` (raise `NonFiniteGradientError`) or
            `"warn"` (`MixedPrecisionWarning`). Defaults to `"stop"`.
        check_every: int >= 1. Read the counters every this many training
            steps. Defaults to `200`.

    Raises:
        ValueError: an argument out of its range, or an unknown `action`.
        TypeError: an argument of the wrong type (a string for a number).

    Attributes:
        skipped_steps: steps skipped for non-finite gradients so far.
        handled_steps: those of them that loss scaling handled (skipped
            with the scale above its minimum).
        bad_data_steps: checks that found a divergent run whose last
            skipped batch holds a NaN or inf input: bad data, warned about
            and not acted on (the step was skipped, the weights are intact).
        error: the `NonFiniteGradientError` describing the divergence, or
            None while training is healthy.

    Puts `skipped_steps` (this epoch's count, from the loss scale's
    counters) in the epoch logs when the model does not report it already.

    Example:

    ```python
    import keras, numpy as np
    from mp_callbacks import MixedPrecisionModel, NaNGradientMonitor

    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1, name="head")(inputs)
    model = MixedPrecisionModel(inputs, outputs, loss_scale=None)
    model.compile("sgd", "mse")
    monitor = NaNGradientMonitor(patience=2, action="stop", check_every=1)
    x = np.full((16, 4), 1e30, "float32")  # finite data whose loss overflows
    model.fit(x, np.zeros((16, 1)), batch_size=4, callbacks=[monitor], verbose=0)
    print(monitor.error.origin, monitor.error.variables)  # loss ['head/kernel']
    ```
    """

    def __init__(self, patience: int = 1, action: str = "stop", check_every: int = 200) -> None:
        super().__init__()
        patience = check_int("NaNGradientMonitor", "patience", patience, low=1)
        action = check_choice("NaNGradientMonitor", "action", action, _ACTIONS)
        check_every = check_int("NaNGradientMonitor", "check_every", check_every, low=1)
        self.patience = patience
        self.action = action
        self.check_every = check_every
        self.skipped_steps = 0
        self.handled_steps = 0
        self.bad_data_steps = 0
        self.error: NonFiniteGradientError | None = None
        # A check reads the scale's state and restarts a latch in it: in
        # step order, after the trained state is synced (on JAX).
        self.async_safe = False
        self._loss_scale = None
        # One check at a time, whichever thread runs the hook.
        self._lock = threading.Lock()
        self._reset_progress()

    def _reset_progress(self) -> None:
        self._steps_before_epoch = 0
        self._epoch_steps = 0
        self._last_check_step = 0
        self._last_state: dict[str, Any] = {}
        self._last_counts: dict[str, int] = {}
        self._epoch_start_skipped = 0
        self._nonfinite_loss_checks = 0

    def get_config(self) -> dict[str, Any]:
        return {"patience": self.patience, "action": self.action, "check_every": self.check_every}

    # ------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self._reset_progress()
        self.error = None
        self._loss_scale = LossScaleSource.of(self.model).scaler
        if self._loss_scale is not None:
            # A new fit judges only its own steps: a divergence that stopped
            # an earlier fit must not be reported again on clean data.
            self._loss_scale.reset_divergence_latches()
            self._last_state = self._loss_scale.diagnostics()
            self._last_counts = self._loss_scale.nonfinite_gradient_counts()
        else:
            logger.info(
                "NaNGradientMonitor: %r does not train through a LossScaler; only the loss is watched.",
                self.model.name,
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_steps = 0
        if self._loss_scale is not None:
            self._epoch_start_skipped = self._last_state["skipped_steps"]

    def on_train_batch_end(self, batch, logs=None):
        self._note_batch(batch)
        step = self._steps_before_epoch + self._epoch_steps
        if step - self._last_check_step >= self.check_every:
            self._check(step, logs)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        step = self._steps_before_epoch + self._epoch_steps
        if step != self._last_check_step:  # a step is judged once
            self._check(step, logs)
        self._steps_before_epoch = step
        if self._loss_scale is not None:
            logs.setdefault(
                "skipped_steps", float(self._last_state["skipped_steps"] - self._epoch_start_skipped)
            )

    # ------------------------------------------------------------ checking
    def _check(self, step: int, logs: dict | None) -> None:
        with self._lock:
            self._check_locked(step, logs)

    def _check_locked(self, step: int, logs: dict | None) -> None:
        self._last_check_step = step
        if self.error is not None and self.action != "warn":
            return
        if self._loss_scale is None:
            self._check_loss_only(step, logs)
            return
        self._sync_trained_state()
        state = self._loss_scale.diagnostics()
        last = self._last_state
        if state["step_count"] == last["step_count"]:
            # No step went through the loss scale: watch the logged losses.
            self._check_loss_only(step, logs)
            return
        counts = self._loss_scale.nonfinite_gradient_counts()
        # (on_train_begin read a full state: `last` has every key)
        new_skips = state["skipped_steps"] - last["skipped_steps"]
        new_loss_failures = state["nonfinite_loss_steps"] - last["nonfinite_loss_steps"]
        new_divergent = state["divergent_steps"] - last["divergent_steps"]
        culprits = [path for path, count in counts.items() if count > self._last_counts.get(path, 0)]
        # Only divergent steps since the last check count: the latch alone
        # would report a run that ended (or was reported) before.
        diverged = new_divergent > 0 and state["max_divergent_run"] >= self.patience
        self.skipped_steps += new_skips
        self.handled_steps += max(new_skips - new_divergent, 0)
        if new_skips and not diverged:
            logger.debug(
                "NaNGradientMonitor: %d overflowing step(s) skipped by step %d; loss scale now %g.",
                new_skips,
                step,
                state["scale"],
            )
        self._last_state, self._last_counts = state, counts
        self._loss_scale.reset_max_divergent_run()
        if diverged:
            if new_loss_failures:
                reason = "the loss was non-finite"
            elif self._loss_scale.scaling_active:
                reason = (
                    "gradients were non-finite with the loss scale at its minimum "
                    f"({self._loss_scale.min_scale:g})"
                )
            else:
                reason = "gradients were non-finite and no loss scaling is active"
            self._diverge(step, reason, culprits, state["scale"])

    def _check_loss_only(self, step: int, logs: dict | None) -> None:
        losses = _logged_losses(logs or {})
        if not losses:
            return
        if all(math.isfinite(float(loss)) for loss in losses):
            self._nonfinite_loss_checks = 0
            return
        self._nonfinite_loss_checks += 1
        if self._nonfinite_loss_checks >= self.patience:
            self._diverge(step, "the loss was non-finite", [], None)

    def _replay_kept_batch(self) -> Any:
        """Diagnoses the batch of the last skipped step, if the model kept one."""
        kept = getattr(self.model, "kept_batch", None)
        batch = kept() if callable(kept) else None
        if batch is None:
            return None
        (x, y, sample_weight), _ = batch
        try:
            return diagnose_batch(self.model, x, y, sample_weight)
        except Exception as error:  # the diagnosis must never hide the divergence
            logger.warning("NaNGradientMonitor: could not replay the kept batch: %s", error)
            return None

    def _nonfinite_input_rows(self) -> tuple[int, int] | None:
        """(rows with a NaN or inf input, rows) of the kept batch, when some have one."""
        kept = getattr(self.model, "kept_batch", None)
        batch = kept() if callable(kept) else None
        if batch is None:
            return None
        (x, _, _), _ = batch
        flat = [np.asarray(t) for t in keras.tree.flatten(x) if t is not None]
        flat = [t for t in flat if np.issubdtype(t.dtype, np.floating) and t.ndim >= 1]
        if not flat:
            return None
        bad = np.zeros(len(flat[0]), bool)
        for tensor in flat:
            if len(tensor) == len(bad):
                bad |= ~np.isfinite(tensor.reshape(len(tensor), -1)).all(axis=1)
        return (int(bad.sum()), len(bad)) if bad.any() else None

    def _diverge(self, step: int, reason: str, culprits: list[str], scale: float | None) -> None:
        bad_rows = self._nonfinite_input_rows()
        if bad_rows is not None:
            # Bad data, skipped with the weights intact: not divergence.
            self.bad_data_steps += 1
            warnings.warn(
                f"NaNGradientMonitor: by step {step}, a step was skipped whose batch holds "
                f"non-finite input values ({bad_rows[0]} of its {bad_rows[1]} rows have a NaN or "
                "inf): bad data, not divergence. The weights are intact and training goes on; fix "
                "or drop those rows (model.kept_batch() returns the batch).",
                MixedPrecisionWarning,
                stacklevel=2,
            )
            return
        report = self._replay_kept_batch()
        origin: str | None
        variables_text = (
            f"Non-finite gradients in {len(culprits)} variable(s): {', '.join(culprits)}."
            if culprits
            else "No gradient was non-finite at the checks."
        )
        if report is not None and report.origin is not None:
            origin = report.origin
            if origin == "loss":
                located = (
                    "Every layer output of the replayed batch is finite but the loss is "
                    "not: check the labels and the loss function."
                )
            else:
                forward = origin == report.forward_origin
                located = (
                    f"Non-finite values first appear in layer {origin!r} ("
                    + (
                        "forward pass: its output overflowed"
                        if forward
                        else "backward pass: the gradient it passes back is not finite"
                    )
                    + "), found by replaying the batch of the last skipped step."
                )
                if report.float32_layers:
                    located += (
                        f" Compute {', '.join(map(repr, report.float32_layers))} in "
                        "float32: mp_callbacks.with_float32_layers(model, "
                        f"{report.float32_layers!r})."
                    )
            where = f"{located} {variables_text}"
        else:
            origin = _layer_of(culprits[-1]) if culprits else None
            where = (
                f"Non-finite gradients in {len(culprits)} variable(s): {', '.join(culprits)}; "
                f"most likely origin: layer {origin!r} (nearest the loss)."
                if culprits
                else "No gradient was non-finite at the checks; the loss itself was."
            )
        note = getattr(self.model, "kept_batch_note", None)
        note = note() if callable(note) else None
        if report is None and note:
            where += f" The batch of the last skipped step was not replayed: {note}."
        scale_text = f"; loss scale {scale:g}" if scale is not None else ""
        message = (
            f"Training diverged by step {step}: {reason} for at least {self.patience} "
            f"consecutive step(s){scale_text}. {where}"
        )
        self.error = NonFiniteGradientError(
            message, variables=culprits, origin=origin, step=step, scale=scale, report=report
        )
        if self.action == "raise":
            raise self.error
        if self.action == "warn":
            warnings.warn(message, MixedPrecisionWarning, stacklevel=2)
            return
        logger.warning("%s Stopping training.", message)
        self.model.stop_training = True
