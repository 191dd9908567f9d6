"""`HeadroomMonitor`: each layer's activation range, watched before it
overflows."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import numpy as np

from mp_callbacks._backend import keras
from mp_callbacks._callback_support import ConfigCopyMixin
from mp_callbacks._validation import check_int, check_real
from mp_callbacks.diagnosis import dtype_max, layer_output_ranges
from mp_callbacks.errors import MixedPrecisionWarning

__all__ = ["HeadroomMonitor"]

logger = logging.getLogger(__name__)


class HeadroomMonitor(ConfigCopyMixin, keras.callbacks.Callback):
    """Records how much of its compute dtype's range each layer's output uses.

    Every `every_n_steps` training steps, and at the end of an epoch that
    had no probe, one fixed probe batch (for example a slice of the
    validation data) runs forward through the model in inference mode with
    every layer's output recorded: nothing is added to the training step
    itself. Each layer's figure is its largest |output| divided by the
    largest finite value of its compute dtype (65504 for float16), so 1.0
    is overflow. The epoch logs get `headroom/<layer>` (the highest figure of
    the epoch), so `History`, `CSVLogger` and TensorBoard show a layer
    drifting toward float16's limit before it overflows, and a
    `MixedPrecisionWarning` names a float16 layer the first time it passes
    `warn_above`.

    Args:
        probe: the probe inputs (what `model(probe)` accepts), a few samples.
        every_n_steps: probe every this many training steps (default 1000;
            each probe is one forward pass of the probe batch).
        warn_above: warn when a float16 layer uses more than this share of
            float16's range (0 < warn_above <= 1).
        layers: names of the layers to log (default: every layer).

    Attributes:
        history: one `{"epoch", "step", "headroom": {layer: share}}` record
            per probe.

    Example:

    ```python
    import keras, numpy as np
    import mp_callbacks as mp

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    x = np.ones((32, 4), "float32")
    monitor = mp.HeadroomMonitor(probe=x[:4], every_n_steps=2)
    history = model.fit(x, np.zeros((32, 1)), batch_size=8, epochs=1, verbose=0,
                        callbacks=[monitor])
    print(len(monitor.history), "headroom/hidden" in history.history)  # 2 True
    ```
    """

    def __init__(
        self,
        probe: Any,
        every_n_steps: int = 1000,
        warn_above: float = 0.5,
        layers: list[str] | None = None,
    ) -> None:
        super().__init__()
        owner = "HeadroomMonitor"
        if probe is None:
            raise TypeError(f"{owner}: `probe` must be a batch of model inputs; received probe=None.")
        self.probe = probe
        self.every_n_steps = check_int(owner, "every_n_steps", every_n_steps, low=1)
        self.warn_above = check_real(owner, "warn_above", warn_above, low=0.0, high=1.0,
                                     low_inclusive=False, requirement="a number in (0, 1]")
        if layers is not None and (isinstance(layers, str) or not all(isinstance(n, str) for n in layers)):
            raise TypeError(f"{owner}: `layers` must be None or a list of layer names; "
                            f"received layers={layers!r}.")
        self.layers = list(layers) if layers is not None else None
        self.history: list[dict[str, Any]] = []
        self.async_safe = True  # pragma: no mutate (a scheduling hint)
        self._steps = 0
        self._epoch = 0
        self._epoch_max: dict[str, float] = {}
        self._warned: set[str] = set()

    def get_config(self) -> dict[str, Any]:
        return {"probe": self.probe, "every_n_steps": self.every_n_steps,
                "warn_above": self.warn_above, "layers": self.layers}

    def on_train_begin(self, logs=None):
        self.history = []
        self._steps = 0
        self._warned = set()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_max = {}

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._steps % self.every_n_steps == 0:
            self._probe()

    def on_epoch_end(self, epoch, logs=None):
        if not self._epoch_max:
            self._probe()
        if logs is not None:
            for name, share in self._epoch_max.items():
                logs[f"headroom/{name}"] = share

    def _probe(self) -> None:
        ranges = layer_output_ranges(self.model, self.probe)
        shares: dict[str, float] = {}
        for name, (dtype, value) in ranges.items():
            if self.layers is not None and name not in self.layers:
                continue
            share = value / dtype_max(dtype) if math.isfinite(value) else math.inf
            shares[name] = share
            previous = self._epoch_max.get(name, -1.0)
            self._epoch_max[name] = share if not share <= previous else previous
            if dtype == "float16" and share > self.warn_above and name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"Layer {name!r} computes in float16 and its output reached "
                    f"{'overflow' if not math.isfinite(share) else f'{share:.0%} of float16 range'} "
                    f"(largest |output| {value:.4g}, float16 max 65504) on the probe batch at "
                    f"step {self._steps}. Compute it in float32: "
                    f"mp_callbacks.with_float32_layers(model, [{name!r}]).",
                    MixedPrecisionWarning,
                    stacklevel=2,
                )
        self.history.append({"epoch": self._epoch, "step": self._steps, "headroom": shares})

    def __deepcopy__(self, memo: dict) -> "HeadroomMonitor":
        clone = type(self)(probe=np.array(self.probe, copy=True) if isinstance(self.probe, np.ndarray)
                           else self.probe, every_n_steps=self.every_n_steps,
                           warn_above=self.warn_above, layers=self.layers)
        memo[id(self)] = clone
        return clone
