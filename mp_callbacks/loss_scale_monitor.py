"""`LossScaleMonitor`: the loss scale over training, and warnings when it
collapses or too many steps are skipped."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

from mp_callbacks._backend import keras
from mp_callbacks._callback_support import ConfigCopyMixin, LossScaleSource
from mp_callbacks.errors import MixedPrecisionWarning

__all__ = ["LossScaleMonitor"]

logger = logging.getLogger(__name__)

_ADVICE = (
    "keep softmax, sigmoid and normalization outputs in float32 "
    "(dtype='float32' on those layers), lower the learning rate or add "
    "gradient clipping (clipnorm), and check the data for inf/NaN"
)


class LossScaleMonitor(ConfigCopyMixin, keras.callbacks.Callback):
    """Records the loss scale and warns when loss scaling is in trouble.

    Puts `loss_scale` in every epoch's logs (so `History`, `CSVLogger`,
    `TensorBoard` and keras-tuner objectives placed after it see it), and
    `skipped_steps` too when the model does not report it already (a stock
    model with Keras's `LossScaleOptimizer`). Works with
    `MixedPrecisionModel` and with a stock `keras.Model` whose optimizer is a
    `keras.mixed_precision.LossScaleOptimizer`; with neither, it reports 1.0
    and logs once that no loss scaling is active.

    Warns (`MixedPrecisionWarning`) when the scale collapses (reaches its
    minimum, or falls below `collapse_threshold`) and when more than
    `max_skipped_fraction` of an epoch's steps were skipped; each warning
    says what to try.

    Args:
        every_n_steps: also record the scale every N training steps (one
            host read each time); None records once per epoch.
        collapse_threshold: warn when the scale falls below this, on top
            of reaching the loss scale's own minimum; None: minimum only.
        max_skipped_fraction: warn when the fraction of skipped steps in an
            epoch is above this (0 warns on any skipped step).

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
        if every_n_steps is not None and (
            not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1
        ):
            raise ValueError(
                "LossScaleMonitor: `every_n_steps` must be None or an integer >= 1; "
                f"received every_n_steps={every_n_steps!r}."
            )
        if collapse_threshold is not None and not (
            isinstance(collapse_threshold, (int, float))
            and math.isfinite(collapse_threshold)
            and collapse_threshold > 0
        ):
            raise ValueError(
                "LossScaleMonitor: `collapse_threshold` must be None or a finite "
                f"number > 0; received collapse_threshold={collapse_threshold!r}."
            )
        if not (isinstance(max_skipped_fraction, (int, float)) and 0 <= max_skipped_fraction <= 1):
            raise ValueError(
                "LossScaleMonitor: `max_skipped_fraction` must be a number in "
                f"[0, 1]; received max_skipped_fraction={max_skipped_fraction!r}."
            )
        self.every_n_steps = every_n_steps
        self.collapse_threshold = collapse_threshold
        self.max_skipped_fraction = float(max_skipped_fraction)
        self.history: list[dict[str, Any]] = []
        # Batch hooks only count steps (no tensor reads between N-step
        # records), so Keras may keep dispatching them asynchronously.
        self.async_safe = True
        self._source = LossScaleSource("none")
        self._steps_before_epoch = 0
        self._epoch_steps = 0
        self._last_recorded_step = 0
        self._collapsed = False
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
        self._source = LossScaleSource.of(self.model)
        self._steps_before_epoch = 0
        self._last_recorded_step = 0
        self._collapsed = False
        if not self._source.active:
            logger.info(
                "LossScaleMonitor: no loss scaling is active for model %r "
                "(dtype policy %s); loss_scale is reported as 1.0.",
                self.model.name,
                self.model.dtype_policy.name,
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_steps = 0
        if self._source.kind == "keras":
            self._iterations_at_epoch_start = int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        self._epoch_steps = max(self._epoch_steps, batch + 1)
        if self.every_n_steps is None:
            return
        step = self._steps_before_epoch + self._epoch_steps
        if step // self.every_n_steps > self._last_recorded_step // self.every_n_steps:
            self._record(step)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        step = self._steps_before_epoch + self._epoch_steps
        if self.history and self.history[-1]["step"] == step and step > 0:
            scale = self.history[-1]["loss_scale"]  # just recorded at step N
        else:
            scale = self._record(step)
        logs["loss_scale"] = scale
        if "skipped_steps" not in logs and self._source.kind == "keras":
            applied = int(self.model.optimizer.iterations.numpy()) - self._iterations_at_epoch_start
            logs["skipped_steps"] = float(max(self._epoch_steps - applied, 0))
        self._steps_before_epoch = step
        self._check_collapse(epoch, scale)
        self._check_skipped(epoch, logs.get("skipped_steps"))

    # ------------------------------------------------------------ helpers
    def _record(self, step: int) -> float:
        scale = self._source.read_scale()
        self.history.append({"epoch": self._epoch, "step": step, "loss_scale": scale})
        self._last_recorded_step = step
        return scale

    def _check_collapse(self, epoch: int, scale: float) -> None:
        if not self._source.dynamic:
            return
        floor = self._source.min_scale
        collapsed = scale <= floor or (
            self.collapse_threshold is not None and scale < self.collapse_threshold
        )
        if collapsed and not self._collapsed:
            limit = f"its minimum {floor:g}" if scale <= floor else f"below {self.collapse_threshold:g}"
            warnings.warn(
                f"Loss scale collapsed to {scale:g} ({limit}) by the end of epoch "
                f"{epoch + 1}: gradients overflow even with little or no scaling, "
                f"which loss scaling cannot fix. Try: {_ADVICE}; or train this "
                "model in mixed_bfloat16 or float32.",
                MixedPrecisionWarning,
                stacklevel=2,
            )
        self._collapsed = collapsed

    def _check_skipped(self, epoch: int, skipped: Any) -> None:
        if skipped is None or not self._epoch_steps:
            return
        fraction = float(skipped) / self._epoch_steps
        if fraction > self.max_skipped_fraction:
            warnings.warn(
                f"{float(skipped):g} of {self._epoch_steps} steps ({fraction:.0%}) "
                f"were skipped in epoch {epoch + 1} because their gradients were "
                f"non-finite (limit {self.max_skipped_fraction:.0%}). Try: a lower "
                "initial loss scale or hysteresis=2 (DynamicLossScale(initial_scale="
                f"..., hysteresis=2)); {_ADVICE}.",
                MixedPrecisionWarning,
                stacklevel=2,
            )
