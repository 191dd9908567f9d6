"""`HeadroomMonitor`: each low-precision layer's limits on a probe batch:
float16's range before it overflows, bfloat16's lost precision, float8's
saturation and underflow."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from typing import Any

from mp_callbacks._backend import keras
from mp_callbacks._callback_support import MixedPrecisionCallback
from mp_callbacks._float8 import FLOAT8_SATURATION_WARNING, float8_layers
from mp_callbacks._keras_internals import global_seed_generator_state
from mp_callbacks._layer_epoch_plot import DEFAULT_FIGURES, FIGURES, layer_epoch_tables, plot_tables
from mp_callbacks._validation import check_int, check_real, fail
from mp_callbacks.diagnosis import diagnose_batch, dtype_max, float8_figures, layer_output_ranges
from mp_callbacks.errors import MixedPrecisionWarning
from mp_callbacks.layer_selection import MAX_RELATIVE_ERROR, own_precision_loss

__all__ = ["HeadroomMonitor"]

logger = logging.getLogger(__name__)

# Compute dtypes whose range a layer can run out of (bfloat16 and float32
# both reach 3.4e38, which no activation comes near).
_LIMITED_RANGE = ("float16",)


def _sub_models(model: keras.Model) -> list[str]:
    return sorted(
        name
        for name, value in vars(model).items()
        if isinstance(value, keras.Model) and not name.startswith("_")
    )


def _has_call(model: Any) -> bool:
    return type(model).call is not keras.Model.call


class HeadroomMonitor(MixedPrecisionCallback):
    """Records how much of float16's range each float16 layer's output
    uses, and what each bfloat16 layer's own computation loses.

    Every `every_n_steps` training steps, and at the end of an epoch that
    had no probe, one fixed probe batch (for example a slice of the
    validation data) runs forward through the model in inference mode with
    every layer's output recorded: nothing is added to the training step
    itself, and the probe leaves the model as it found it (random seeds,
    `SeedGenerator`s and other state are put back). Each layer's figure is
    its largest |output| divided by the largest finite value of its compute
    dtype (65504 for float16), so 1.0 is overflow. The epoch logs get
    `headroom/<layer>` (the highest figure of the epoch), so `History`,
    `CSVLogger` and TensorBoard show a layer drifting toward float16's
    limit before it overflows, and a `MixedPrecisionWarning` names a
    float16 layer the first time it passes `warn_above`. A layer whose
    output is not finite because its inputs or weights are not is said to
    be so, not called an overflow.

    bfloat16 has float32's range but 8 significant bits: it fails by losing
    precision, not by overflowing. On the same probe, each bfloat16 layer
    is computed again in float32 on the inputs it received, and the epoch
    logs get `bfloat16/<layer>/error` (the relative L2 error of its output)
    and `bfloat16/<layer>/underflow` (the share of the float32 output's
    nonzero values that bfloat16 flushed to 0); a `MixedPrecisionWarning`
    names a layer the first time its error passes `warn_error`. A layer
    whose name repeats in the model is named by its path (`block2/proj`).

    float8 layers (`quantize("float8")`) fail by saturating, silently: for
    each one's `inputs` and `kernel` the logs get
    `float8/<layer>/<tensor>/saturation`, `.../underflow`,
    `.../amax_ratio` and the what-if `.../current_underflow` and
    `.../mx_underflow`, and `float8/<layer>/history_nonfinite`; with
    `probe_targets`, one backward pass of the probe adds the
    `outputs_grad` tensor. A warning names a tensor the first time
    more than 5 % of it saturates. `plot()` draws the figures by layer
    and epoch.

    Args:
        probe: array, tensor or structure of them. The probe inputs (what
            `model(probe)` accepts), a few samples.
        every_n_steps: int >= 1. Probe every this many training steps (with
            `steps_per_execution`, after the execution that reaches the
            step); each probe is one forward pass of the probe batch.
            Defaults to `1000`.
        warn_above: float in (0, 1]. Warn when a float16 layer uses more
            than this share of float16's range. Defaults to `0.5`.
        layers: list of str or None. Names of the layers to log. Defaults to
            None: every layer that computes in float16 or bfloat16.
        warn_error: float in (0, 1]. Warn when a bfloat16 layer's output
            differs from float32's by more than this relative error.
            Defaults to `0.05` (ordinary layers stay well under 1 %).
        target: str, `keras.Model` or None. The model to run the probe
            through: the name of one of the trained model's attributes, or a
            model, for a model without `call()` such as a GAN (`"generator"`).
            Defaults to None: the model being trained.
        probe_targets: array or None. Targets for `probe`, as `fit` takes
            `y`: the probe then also runs one backward pass (the model's
            loss times its loss scale, as in training) for the float8
            layers' output-gradient figures. Defaults to None (forward
            only).

    Raises:
        ValueError: an argument out of its range (named, with the value).
        TypeError: an argument of the wrong type (a string for a number).

    Attributes:
        history: one `{"epoch", "step", "headroom": {layer: share},
            "bfloat16": {layer: {"error", "underflow"}}}` record per probe.

    Example:

    ```python
    import keras, numpy as np
    import mp_callbacks as mp

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden", dtype="mixed_float16")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    x = np.ones((32, 4), "float32")
    monitor = mp.HeadroomMonitor(probe=x[:4], every_n_steps=2)
    history = model.fit(x, np.zeros((32, 1)), batch_size=8, epochs=1, verbose=0,
                        callbacks=[monitor])
    print(len(monitor.history), [k for k in history.history if k.startswith("headroom")])  # 2 ['headroom/hidden']
    ```
    """

    def __init__(
        self,
        probe: Any,
        every_n_steps: int = 1000,
        warn_above: float = 0.5,
        layers: list[str] | None = None,
        target: str | keras.Model | None = None,
        warn_error: float = MAX_RELATIVE_ERROR,
        probe_targets: Any = None,
    ) -> None:
        super().__init__()
        # Its probe runs the model between steps: never on Keras's thread
        # pool (JAX), where the next step would donate the weights it reads.
        self.async_safe = False
        owner = "HeadroomMonitor"
        if probe is None:
            raise TypeError(f"{owner}: `probe` must be a batch of model inputs; received probe=None.")
        self.probe = probe
        self.probe_targets = probe_targets
        self.every_n_steps = check_int(owner, "every_n_steps", every_n_steps, low=1)
        self.warn_above = check_real(
            owner,
            "warn_above",
            warn_above,
            low=0.0,
            high=1.0,
            low_inclusive=False,
            requirement="a number in (0, 1]",
        )
        self.warn_error = check_real(
            owner,
            "warn_error",
            warn_error,
            low=0.0,
            high=1.0,
            low_inclusive=False,
            requirement="a number in (0, 1]",
        )
        if layers is not None and (isinstance(layers, str) or not all(isinstance(n, str) for n in layers)):
            raise TypeError(
                f"{owner}: `layers` must be None or a list of layer names; received layers={layers!r}."
            )
        if target is not None and not isinstance(target, (str, keras.Model)):
            fail(owner, "target", target, "None, an attribute name of the model, or a Keras model", TypeError)
        self.layers = list(layers) if layers is not None else None
        self.target = target
        self.history: list[dict[str, Any]] = []
        self._steps = 0
        self._steps_before_epoch = 0
        self._probed_in_epoch = False
        self._epoch = 0
        self._epoch_max: dict[str, float] = {}
        self._warned: set[str] = set()
        self._probed_model: Any = None

    def get_config(self) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "every_n_steps": self.every_n_steps,
            "warn_above": self.warn_above,
            "layers": self.layers,
            "target": self.target,
            "warn_error": self.warn_error,
            "probe_targets": self.probe_targets,
        }

    def on_train_begin(self, logs=None):
        self.history = []
        self._steps = 0
        self._warned = set()
        self._probed_model = self._resolve_target()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_max = {}
        self._epoch_steps = 0
        self._steps_before_epoch = self._steps
        self._probed_in_epoch = False

    def on_train_batch_end(self, batch, logs=None):
        # Counted in steps, not calls: with steps_per_execution one call
        # ends several steps, and a multiple of every_n_steps among them probes.
        before = self._steps
        self._steps = self._steps_before_epoch + self._note_batch(batch)
        if self._steps // self.every_n_steps > before // self.every_n_steps:
            self._probed_in_epoch = True
            self._probe()

    def on_epoch_end(self, epoch, logs=None):
        if not self._probed_in_epoch:
            self._probe()
        if logs is not None:
            for name, share in self._epoch_max.items():
                logs[name if name.startswith(("bfloat16/", "float8/")) else f"headroom/{name}"] = share

    # ------------------------------------------------------------ helpers
    def _resolve_target(self) -> Any:
        """The model the probe runs through, or None (said once) if none can."""
        target = self.target
        if isinstance(target, str):
            resolved = getattr(self.model, target, None)
            if not isinstance(resolved, keras.Model):
                fail(
                    "HeadroomMonitor",
                    "target",
                    target,
                    f"the name of a model attribute of {self.model.name!r} "
                    f"(it has: {', '.join(map(repr, _sub_models(self.model))) or 'none'})",
                )
            target = resolved
        target = target if target is not None else self.model
        if _has_call(target):
            return target
        names = _sub_models(target)
        warnings.warn(
            f"HeadroomMonitor: model {target.name!r} has no call() to run the probe "
            "through, so no headroom is recorded. Pass one of its sub-models as "
            f"target= ({', '.join(repr(n) for n in names) or 'none found'}), for example "
            f"HeadroomMonitor(probe, target={names[0] if names else 'generator'!r}).",
            MixedPrecisionWarning,
            stacklevel=2,
        )
        return None

    def _probe(self) -> None:
        if self._probed_model is None:
            return
        self._sync_trained_state()
        model = self._probed_model
        try:
            ranges = _leaving_state_as_it_was(model, lambda: layer_output_ranges(model, self.probe))
            lost = {}
            if any(measured.dtype == "bfloat16" for measured in ranges.values()):
                lost = _leaving_state_as_it_was(
                    model, lambda: own_precision_loss(model, self.probe, training=False)
                )
            quantized = {}
            if float8_layers(model):
                quantized = _leaving_state_as_it_was(model, lambda: float8_figures(model, self.probe))
                if self.probe_targets is not None:
                    quantized = self._with_output_gradients(model, quantized)
        except Exception as error:
            # A monitor never stops training: the model cannot run the probe
            # in inference (stock Keras 3.15's RandomCrop keeps the uncropped
            # size there), so it is said once and the probing stops.
            first = (str(error).strip().splitlines() or [""])[0]
            warnings.warn(
                f"HeadroomMonitor: the probe batch cannot run through {self._probed_model.name!r} "
                f"in inference ({type(error).__name__}: {first}); no headroom is recorded for "
                "this fit. Training goes on.",
                MixedPrecisionWarning,
                stacklevel=3,
            )
            self._probed_model = None
            return
        shares: dict[str, float] = {}
        for name, measured in ranges.items():
            if self.layers is not None:
                if name not in self.layers:
                    continue
            elif measured.dtype not in _LIMITED_RANGE:
                continue
            finite = math.isfinite(measured.largest)
            share = measured.largest / dtype_max(measured.dtype) if finite else math.inf
            shares[name] = share
            previous = self._epoch_max.get(name, -1.0)
            self._epoch_max[name] = share if not share <= previous else previous
            if measured.dtype == "float16" and share > self.warn_above and name not in self._warned:
                self._warn(name, measured, share)
        precision: dict[str, dict[str, float]] = {}
        for name, loss in lost.items():
            if loss.dtype != "bfloat16" or (self.layers is not None and name not in self.layers):
                continue
            precision[name] = {"error": loss.error, "underflow": loss.underflow}
            for figure in ("error", "underflow"):
                key = f"bfloat16/{name}/{figure}"
                self._epoch_max[key] = max(self._epoch_max.get(key, 0.0), precision[name][figure])
            if loss.error > self.warn_error and f"bfloat16/{name}" not in self._warned:
                self._warned.add(f"bfloat16/{name}")
                warnings.warn(
                    f"Layer {name!r} computes in bfloat16 and its output differs from float32's by "
                    f"{loss.error:.1%} (relative error; {loss.underflow:.1%} of its nonzero values "
                    f"flushed to 0) on the probe batch at step {self._steps}: bfloat16 keeps 8 "
                    "significant bits. Compute it in float32: "
                    f"mp_callbacks.with_float32_layers(model, [{name!r}]).",
                    MixedPrecisionWarning,
                    stacklevel=3,
                )
        for name, entry in quantized.items():
            if self.layers is not None and name not in self.layers:
                continue
            self._note_float8(name, entry)
        self.history.append(
            {
                "epoch": self._epoch,
                "step": self._steps,
                "headroom": shares,
                "bfloat16": precision,
                "float8": quantized,
            }
        )

    def _with_output_gradients(self, model: Any, quantized: dict[str, Any]) -> dict[str, Any]:
        """`quantized` with each float8 layer's `outputs_grad` figures, from
        `diagnose_batch`'s backward pass of the probe (it leaves the model's
        state as it found it)."""
        report = diagnose_batch(model, self.probe, self.probe_targets)
        for name, figures in report.float8.items():
            if name in quantized and "outputs_grad" in figures:
                quantized[name]["outputs_grad"] = figures["outputs_grad"]
        return quantized

    def _note_float8(self, name: str, entry: dict[str, Any]) -> None:
        """A float8 layer's figures into the epoch's logs, and a warning the
        first time a tensor saturates or a history holds inf or NaN."""
        for tensor in ("inputs", "kernel", "outputs_grad"):
            for figure, value in entry.get(tensor, {}).items():
                key = f"float8/{name}/{tensor}/{figure}"
                self._epoch_max[key] = max(self._epoch_max.get(key, 0.0), value)
            saturation = entry.get(tensor, {}).get("saturation", 0.0)
            if saturation > FLOAT8_SATURATION_WARNING and f"float8/{name}/{tensor}" not in self._warned:
                self._warned.add(f"float8/{name}/{tensor}")
                warnings.warn(
                    f"float8 layer {name!r}: {saturation:.1%} of its {tensor} saturate on the probe "
                    f"batch at step {self._steps} (clipped to the format's range, silently: no inf, "
                    f"no skipped step); their amax is {entry[tensor]['amax_ratio']:.3g}x the amax its "
                    "scale was computed from. Compute it without float8, or let its amax history "
                    "catch up (a shorter history).",
                    MixedPrecisionWarning,
                    stacklevel=4,
                )
        key = f"float8/{name}/history_nonfinite"
        self._epoch_max[key] = max(self._epoch_max.get(key, 0.0), float(entry["history_nonfinite"]))
        if entry["history_nonfinite"] and key not in self._warned:
            self._warned.add(key)
            warnings.warn(
                f"float8 layer {name!r}: an amax history holds inf or NaN at step {self._steps}: its "
                "scale stays frozen until the value rolls out (fit repairs it when it starts).",
                MixedPrecisionWarning,
                stacklevel=4,
            )

    def _warn(self, name: str, measured: Any, share: float) -> None:
        self._warned.add(name)
        if math.isfinite(share):
            reached = f"{share:.0%} of float16 range"
        elif not measured.inputs_finite:
            return  # it inherits a non-finite input: the layer that made it is named
        elif not measured.weights_finite:
            warnings.warn(
                f"Layer {name!r}'s output is not finite on the probe batch at step "
                f"{self._steps} because its weights are not finite: training has "
                "diverged (NaNGradientMonitor tells where); this is not a float16 overflow.",
                MixedPrecisionWarning,
                stacklevel=3,
            )
            return
        else:
            reached = "overflow"
        warnings.warn(
            f"Layer {name!r} computes in float16 and its output reached {reached} "
            f"(largest |output| {measured.largest:.4g}, float16 max 65504) on the probe batch at "
            f"step {self._steps}. Compute it in float32: "
            f"mp_callbacks.with_float32_layers(model, [{name!r}]).",
            MixedPrecisionWarning,
            stacklevel=3,
        )

    def plot(
        self, path: str, figures: Sequence[str] | None = None
    ) -> dict[str, tuple[list[str], list[int], Any]]:
        """Draws each figure as a heat map of layer (rows) by epoch
        (columns), the epoch's highest value as the logs hold it, and saves
        it to `path` (.png, .svg or .pdf). Needs matplotlib
        (`pip install "mp_callbacks[plot]"`).

        Args:
            path: str. The file to write.
            figures: list of str or None. Among `"headroom"` (float16),
                `"bfloat16/error"`, `"bfloat16/underflow"`,
                `"float8/saturation"`, `"float8/underflow"`,
                `"float8/amax_ratio"`, `"float8/current_underflow"`,
                `"float8/mx_underflow"`, `"float8/history_nonfinite"`
                (float8 rows are a layer's tensor: `dense/inputs`).
                Defaults to None: the first four, those with values.

        Returns:
            What was drawn: for each figure, its rows, its epochs (from 0,
            as `fit` counts them) and the rows x epochs NumPy array (NaN
            where a row has no value).

        Raises:
            ValueError: nothing probed yet, an unknown figure, or no value
                for any figure asked.
            ImportError: matplotlib is not installed.
        """
        chosen = tuple(figures) if figures is not None else DEFAULT_FIGURES
        unknown = [f for f in chosen if f not in FIGURES]
        if isinstance(figures, str) or unknown:
            fail("HeadroomMonitor.plot", "figures", figures, f"a list of names among {list(FIGURES)}")
        if not self.history:
            raise ValueError("HeadroomMonitor.plot: nothing probed yet; call it after fit().")
        tables = layer_epoch_tables(self.history, chosen)
        if not tables:
            raise ValueError(
                f"HeadroomMonitor.plot: no layer has a value for figures={list(chosen)} (the "
                "model's layers compute in other formats)."
            )
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise ImportError(
                'HeadroomMonitor.plot needs matplotlib: pip install "mp_callbacks[plot]"'
            ) from error
        plot_tables(tables, path)
        return tables

    def _shared_by_copies(self) -> list[Any]:
        # A target model is the user's: copies probe it, not a copy of it.
        return [self.target] if isinstance(self.target, keras.Model) else []


def _leaving_state_as_it_was(model: keras.Model, run: Any) -> Any:
    """Runs `run()` and puts back every non-trainable variable of `model`
    (random seeds, `SeedGenerator`s, statistics) and Keras's global seed,
    so that the probe changes nothing the training reads."""
    state = list(model.non_trainable_variables)
    global_seed = global_seed_generator_state()
    if global_seed is not None:
        state.append(global_seed)
    saved = [keras.ops.copy(v.value) for v in state]  # a copy: JAX donates the buffers it trains on
    try:
        return run()
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)
