"""`LossScaleMonitor`: the loss scale over training, and warnings when it
collapses or too many steps are skipped."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

from mp_callbacks._backend import BACKEND
from mp_callbacks._callback_support import MixedPrecisionCallback
from mp_callbacks._loss_scale_source import LossScaleSource, read_variable
from mp_callbacks._validation import check_int, check_real
from mp_callbacks.errors import MixedPrecisionWarning

__all__ = ["LossScaleMonitor"]

logger = logging.getLogger(__name__)

_ADVICE = (
    "keep softmax, sigmoid and normalization outputs in float32 "
    "(dtype='float32' on those layers), lower the learning rate or add "
    "gradient clipping (clipnorm), and check the data for inf/NaN"
)


class LossScaleMonitor(MixedPrecisionCallback):
    """Records the loss scale and warns when loss scaling is in trouble.

    Puts `loss_scale` in every epoch's logs (so `History`, `CSVLogger`,
    `TensorBoard` and keras-tuner objectives placed after it see it), and
    `skipped_steps` too when the model does not report it already. Works
    with `MixedPrecisionModel` (its own `train_step` or yours), with any
    model whose hand-written `train_step` keeps a `LossScaler` in an
    attribute (whatever its name) or trains through
    `mp_callbacks.LossScaleOptimizer`, and with a stock `keras.Model` whose
    optimizer is Keras's `LossScaleOptimizer`. Where no loss is scaled
    (also a `train_step` that never calls the scale) it reports 1.0 and
    logs once that no loss scaling is active.

    Warns (`MixedPrecisionWarning`) when the scale collapses (reaches its
    minimum, or falls below `collapse_threshold`) and when more than
    `max_skipped_fraction` of an epoch's steps were skipped; each warning
    says what to try. Both read the loss scale's own counters, whoever
    calls it. The skips of a dynamic scale calibrating down from its
    `initial_scale` before the first applied step (as every dynamic scaler
    does at first) are not counted toward the fraction; `history` still
    has their scales.

    Args:
        every_n_steps: int or None. Also record the scale every N training
            steps (one host read each time). Defaults to None: once per
            epoch.
        collapse_threshold: float or None. Warn when the scale falls below
            this, on top of reaching the loss scale's own minimum. Defaults
            to None: the minimum only.
        max_skipped_fraction: float in [0, 1]. Warn when the fraction of
            skipped steps in an epoch is above this (0 warns on any skipped
            step). Defaults to `0.05`.

    Raises:
        ValueError: an argument out of its range (named, with the value).
        TypeError: an argument of the wrong type (a string for a number).

    Attributes:
        history: list of `{"epoch", "step", "loss_scale"}` records.

    Example:

    ```python
    import keras, numpy as np
    from mp_callbacks import LossScaleMonitor, MixedPrecisionModel

    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1)(inputs)
    model = MixedPrecisionModel(inputs, outputs, loss_scale=2.0**10)
    model.compile("sgd", "mse")
    monitor = LossScaleMonitor(every_n_steps=2)
    model.fit(np.ones((32, 8)), np.zeros((32, 1)), batch_size=8, epochs=2,
              callbacks=[monitor], verbose=0)
    print(monitor.history[-1])  # {'epoch': 1, 'step': 8, 'loss_scale': 1024.0}
    ```
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        collapse_threshold: float | None = None,
        max_skipped_fraction: float = 0.05,
    ) -> None:
        super().__init__()
        owner = "LossScaleMonitor"
        if every_n_steps is not None:
            every_n_steps = check_int(
                owner, "every_n_steps", every_n_steps, low=1, requirement="None or an integer >= 1"
            )
        if collapse_threshold is not None:
            collapse_threshold = check_real(
                owner,
                "collapse_threshold",
                collapse_threshold,
                low=0.0,
                low_inclusive=False,
                requirement="None or a finite number > 0",
            )
        max_skipped_fraction = check_real(
            owner,
            "max_skipped_fraction",
            max_skipped_fraction,
            low=0.0,
            high=1.0,
            requirement="a number in [0, 1]",
        )
        self.every_n_steps = every_n_steps
        self.collapse_threshold = collapse_threshold
        self.max_skipped_fraction = float(max_skipped_fraction)
        # Batch hooks only count steps (no tensor reads between N-step
        # records), so Keras may keep dispatching them asynchronously; an
        # N-step record reads the scale in step order, so it is not async.
        self.async_safe = every_n_steps is None
        self._reset(LossScaleSource("none"))

    def _reset(self, source: LossScaleSource) -> None:
        """Everything is per fit, as in keras.callbacks.History: a monitor
        reused across fits or models never reports an earlier run's scale."""
        self.history: list[dict[str, Any]] = []
        self._source = source
        self._steps_before_epoch = 0
        self._last_recorded_step = 0
        self._collapsed = False
        self._told_inactive = False
        self._counters_at_epoch_start: dict[str, Any] = {}
        # Set again by on_epoch_begin before any use: placeholders.
        self._epoch_steps = 0
        self._lowest_scale = math.inf
        self._iterations_at_epoch_start = 0
        self._epoch = 0

    def get_config(self) -> dict[str, Any]:
        return {
            "every_n_steps": self.every_n_steps,
            "collapse_threshold": self.collapse_threshold,
            "max_skipped_fraction": self.max_skipped_fraction,
        }

    # ------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self._reset(LossScaleSource.of(self.model))
        if self._source.scaler is not None:
            self._source.scaler.reset_lowest_scale()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_steps = 0
        self._lowest_scale = math.inf
        if self._source.scaler is not None:
            self._counters_at_epoch_start = self._source.scaler.diagnostics()
        if self._source.kind == "keras":
            self._iterations_at_epoch_start = int(read_variable(self.model.optimizer.iterations))

    def on_train_batch_end(self, batch, logs=None):
        self._note_batch(batch)
        if self.every_n_steps is None:
            return
        step = self._steps_before_epoch + self._epoch_steps
        if step // self.every_n_steps > self._last_recorded_step // self.every_n_steps:
            self._record(step, logs)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        # Whether the loss is scaled is known once the step has been traced.
        self._source = LossScaleSource.of(self.model)
        if not self._source.active and not self._told_inactive:
            self._told_inactive = True
            logger.info(
                "LossScaleMonitor: no loss scaling is active for model %r "
                "(dtype policy %s); loss_scale is reported as 1.0.",
                self.model.name,
                self.model.dtype_policy.name,
            )
        step = self._steps_before_epoch + self._epoch_steps
        if self.history and self.history[-1]["step"] == step and self._epoch_steps:
            scale = self.history[-1]["loss_scale"]  # recorded at this very step
        else:
            scale = self._record(step)
        # The model's own entry is exact; never overwrite it.
        logs.setdefault("loss_scale", scale)
        skipped, steps, calibration = self._epoch_skips(logs)
        if "skipped_steps" not in logs and skipped is not None:
            logs["skipped_steps"] = float(skipped)
        self._steps_before_epoch = step
        self._check_collapse(epoch, scale, self._lowest_scale)
        self._check_skipped(epoch, skipped, steps, calibration, self._epoch_nonfinite_losses())

    # ------------------------------------------------------------ helpers
    def _record(self, step: int, batch_logs: dict | None = None) -> float:
        """Reads the scale (and the lowest since the last read) and records it.
        On JAX, during an epoch, from the step's own logs: the model's
        variables hold no value until the epoch ends."""
        if BACKEND == "jax" and batch_logs is not None and "loss_scale" in batch_logs:
            lowest = scale = float(batch_logs["loss_scale"])
        else:
            lowest = self._source.read_lowest_scale()
            scale = self._source.read_scale()
        self._lowest_scale = min(self._lowest_scale, lowest, scale)
        self.history.append({"epoch": self._epoch, "step": step, "loss_scale": scale})
        self._last_recorded_step = step
        return scale

    def _check_collapse(self, epoch: int, scale: float, lowest: float) -> None:
        """Warns once per collapse; `lowest` catches a collapse inside the
        epoch that had recovered by its end."""
        if not self._source.dynamic:
            return
        floor = self._source.min_scale

        def collapsed_at(value: float) -> bool:
            return value <= floor or (self.collapse_threshold is not None and value < self.collapse_threshold)

        collapsed = collapsed_at(min(lowest, scale))
        if collapsed and not self._collapsed:
            low = min(lowest, scale)
            if low > floor:
                limit = f"below {self.collapse_threshold:g}"
            elif self._source.kind == "mp":
                limit = f"its minimum {floor:g}"
            else:  # Keras's LossScaleOptimizer has no minimum of its own
                limit = f"at or below {floor:g}"
            when = (
                f"by the end of epoch {epoch + 1}"
                if collapsed_at(scale)
                else f"during epoch {epoch + 1} (it ended the epoch at {scale:g})"
            )
            warnings.warn(
                f"Loss scale collapsed to {low:g} ({limit}) {when}: gradients "
                "overflow even with little or no scaling, which loss scaling "
                f"cannot fix. Try: {_ADVICE}; or train this model in "
                "mixed_bfloat16 or float32.",
                MixedPrecisionWarning,
                stacklevel=2,
            )
        self._collapsed = collapsed_at(scale)

    def _epoch_nonfinite_losses(self) -> int | None:
        """Steps of this epoch whose loss was not finite (None: not counted)."""
        loss_scale = self._source.scaler
        if loss_scale is None or not self._counters_at_epoch_start:
            return None
        now = loss_scale.diagnostics()
        return now["nonfinite_loss_steps"] - self._counters_at_epoch_start["nonfinite_loss_steps"]

    def _epoch_skips(self, logs: dict) -> tuple[float | None, int, int]:
        """(steps skipped, steps taken, skips while calibrating) this epoch,
        from the loss scale's own counters where there is one."""
        loss_scale = self._source.scaler
        if loss_scale is not None and self._counters_at_epoch_start:
            now, start = loss_scale.diagnostics(), self._counters_at_epoch_start
            # Calibration is over only once a step applied; until then the
            # skips may be a scale that never finds a level: counted.
            calibrated = now["step_count"] > now["skipped_steps"]
            calibration = now["calibration_steps"] - start["calibration_steps"] if calibrated else 0
            return (
                float(now["skipped_steps"] - start["skipped_steps"]),
                now["step_count"] - start["step_count"],
                calibration,
            )
        if self._source.kind == "keras":
            applied = int(read_variable(self.model.optimizer.iterations)) - self._iterations_at_epoch_start
            return float(max(self._epoch_steps - applied, 0)), self._epoch_steps, 0
        skipped = logs.get("skipped_steps")
        return (None if skipped is None else float(skipped)), self._epoch_steps, 0

    def _check_skipped(
        self, epoch: int, skipped: float | None, steps: int, calibration: int, epoch_losses: int | None = None
    ) -> None:
        if skipped is None or not steps:
            return
        if calibration:
            logger.info(
                "LossScaleMonitor: %d step(s) of epoch %d were skipped while the loss scale "
                "came down from its initial_scale (%g) to fit the gradients; not counted "
                "toward max_skipped_fraction.",
                calibration,
                epoch + 1,
                self._source.scaler.initial_scale,
            )
        counted = skipped - calibration
        fraction = counted / steps
        if fraction > self.max_skipped_fraction:
            also = f" (and {calibration} more while the scale calibrated)" if calibration else ""
            warnings.warn(
                f"{counted:g} of {steps} steps ({fraction:.0%}) "
                f"were skipped in epoch {epoch + 1}{also} because they were non-finite "
                f"(limit {self.max_skipped_fraction:.0%}). {self._advice(epoch_losses)}",
                MixedPrecisionWarning,
                stacklevel=2,
            )

    def _advice(self, nonfinite_losses: int | None) -> str:
        """What to try, for the setting the skips happened in."""
        scaler = self._source.scaler
        if nonfinite_losses:
            return (
                f"{nonfinite_losses} of them had a non-finite loss, which no loss scale causes (it "
                "is computed before scaling): check the data for NaN/inf inputs and labels "
                "(NaNGradientMonitor names a bad batch), keep softmax, sigmoid and "
                "normalization outputs in float32, or lower the learning rate."
            )
        if scaler is not None and scaler.is_dynamic:
            return (
                "Try: a lower initial loss scale or hysteresis=2 (LossScaler(initial_scale="
                f"..., hysteresis=2)); {_ADVICE}."
            )
        if scaler is not None and scaler.scaling_active:
            return (
                f"Try: a lower fixed loss scale than {scaler.initial_scale:g}, or a dynamic one; {_ADVICE}."
            )
        if self._source.kind == "keras":
            return (
                "Keras's LossScaleOptimizer halves its scale at every skip; for a floor, "
                "hysteresis and a scale that ignores bad data, train with "
                f"mp.MixedPrecisionModel or mp.LossScaleOptimizer. Try: {_ADVICE}."
            )
        return f"No loss scale is in use, so the gradients overflow by themselves. Try: {_ADVICE}."
