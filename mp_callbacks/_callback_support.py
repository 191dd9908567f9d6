"""`MixedPrecisionCallback`: what the mp_callbacks callbacks share, as
Keras's callbacks share `MonitorCallback`."""

from __future__ import annotations

import copy
import threading
from typing import Any

from mp_callbacks._backend import BACKEND, BATCH_END_NAMES_FIRST_STEP, keras

__all__ = ["MixedPrecisionCallback"]


class MixedPrecisionCallback(keras.callbacks.Callback):
    """The base of `LossScaleMonitor`, `NaNGradientMonitor`, `EpochTimer`
    and `HeadroomMonitor`.

    * Settings are the config: `get_config()` returns the constructor's
      arguments and `from_config` rebuilds from them.
    * `copy.deepcopy` rebuilds the callback from its config: a callback
      that has been attached to a model holds it, and copying that would
      copy (or re-save) the whole model. A copy made from the config is what
      keras-tuner wants for each trial: same settings, fresh state.
    * Batch hooks only count steps (device reads happen per epoch, or every
      N steps), so Keras may dispatch them asynchronously (`async_safe`):
      on JAX it runs them on a thread pool, out of order, so the count
      takes a lock (`_note_batch`).
    * The model's loss scale is found one way (`LossScaleSource.of`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.async_safe = True
        self._epoch_steps = 0
        self._batch_lock = threading.Lock()

    def _note_batch(self, batch: int) -> int:
        """Counts batch `batch` (0-based) of the epoch, in whatever order
        the hooks run; returns the steps seen so far."""
        steps = batch + 1
        if BATCH_END_NAMES_FIRST_STEP:
            # Keras 3.10 names the execution by its first batch. It runs
            # TensorFlow only here, where reading `model` syncs nothing.
            steps = batch + max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
        # With steps_per_execution, Keras ends an epoch's last, shorter
        # execution at the index a full one would reach (8 batches in runs
        # of 3 end at index 8): never count past the epoch's known length.
        known = (self.params or {}).get("steps")
        if isinstance(known, int) and known > 0:
            steps = min(steps, known)
        with self._batch_lock:
            self._epoch_steps = max(self._epoch_steps, steps)
            return self._epoch_steps

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        return cls(**config)

    def _shared_by_copies(self) -> list[Any]:
        """Objects in the config that copies keep rather than copy."""
        return []

    def __deepcopy__(self, memo: dict) -> Any:
        for shared in self._shared_by_copies():
            memo[id(shared)] = shared
        clone = type(self).from_config(copy.deepcopy(self.get_config(), memo))
        memo[id(self)] = clone
        return clone

    def _sync_trained_state(self) -> None:
        """Mid-epoch on JAX, the trained state lives in the compiled step,
        not in the variables: reading a callback's `model` makes Keras write
        it there, and the next step then takes the variables back (with any
        write made in between). Only for hooks that run in step order
        (`async_safe = False`); a no-op on TensorFlow."""
        if BACKEND == "jax":
            _ = self.model
