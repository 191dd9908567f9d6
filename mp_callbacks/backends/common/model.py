"""What the JAX and torch `MixedPrecisionModel`s share: the loss scale's
state in variables of the model, its settings and accessors, `compile`'s
one loss scale, the per-variable counters, the kept batch, save and load.

Each backend's class adds its `train_step` (`backends/jax/model.py`,
`backends/torch/model.py`): check once, decide once, apply or keep,
update the state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from mp_callbacks import _loss_scale_argument, _scale_state
from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import (
    LossScaleSaveable,
    keras_default_method,
)
from mp_callbacks._loss_scale_argument import AUTO
from mp_callbacks._model_base import ModelBase
from mp_callbacks._model_building import (
    LOG_KEYS,
    construct,
    default_optimizer_argument,
)
from mp_callbacks._validation import FLOAT32_MAX
from mp_callbacks.backends.common.loss_scaler import LossScaler

__all__ = ["LOG_KEYS", "VariableScaleModel", "scaler_from_argument"]

logger = logging.getLogger("mp_callbacks.model")
ops = keras.ops

_DYNAMIC = _scale_state.ScaleSettings.checked(2.0**15, 2000, 2.0, 0.5, 1.0, 2.0**24, 1)
_DISABLED = _scale_state.ScaleSettings.checked(1.0, 1, 2.0, 0.5, 1.0, 1.0, 1)
#: Per-epoch figures for the logs, kept beside the scale's state.
_EPOCH_VARIABLES = (
    ("epoch_norm_sum", "float32"),
    ("epoch_applied", "float32"),
    ("epoch_skipped", "float32"),
    ("epoch_samples", "float32"),
)


def _variable(name: str, dtype: str, value: Any) -> Any:
    return keras.Variable(value, dtype=dtype, trainable=False, autocast=False, name=f"mp_loss_scale_{name}")


def _fixed(scale: float) -> _scale_state.ScaleSettings:
    return _scale_state.ScaleSettings.checked(scale, 1, 2.0, 0.5, scale, scale, 1)


def scaler_from_argument(value: Any, owner: str = "MixedPrecisionModel") -> LossScaler | None:
    """A `loss_scale` argument as a LossScaler (None for "auto"): the one
    parser, `_loss_scale_argument.scaler_from_argument`, with this backend's class."""
    return _loss_scale_argument.scaler_from_argument(value, LossScaler, owner)


def _settings_dict(settings: _scale_state.ScaleSettings) -> dict[str, Any]:
    return {
        "initial_scale": settings.initial_scale,
        "growth_interval": settings.growth_interval,
        "growth_factor": settings.growth_factor,
        "backoff_factor": settings.backoff_factor,
        "min_scale": settings.min_scale,
        "max_scale": settings.max_scale,
        "hysteresis": settings.hysteresis,
    }


def _is_ready(value: Any) -> bool:
    """Whether an array's computation is done (JAX's `is_ready`); other
    values are."""
    is_ready = getattr(value, "is_ready", None)
    return True if is_ready is None else bool(is_ready())


class _KeptBatch:
    """The batch of the last skipped step, on the host: the step hands it
    over only where it is skipped, and a read first waits for `barrier`
    (JAX's callbacks still on their way)."""

    def __init__(self, barrier: Callable[[], None] | None = None) -> None:
        self.kept: tuple[Any, int] | None = None
        self.not_kept: str | None = None
        self._received: tuple[Any, Any] | None = None
        self._watched: list[tuple[Any, Any, Any]] = []
        self._barrier = barrier
        self._lock = threading.Lock()

    def watch(self, batch: Any, applied: Any, step: Any) -> None:
        """Notes a step's batch with its decision and number (arrays whose
        step may still run: JAX dispatches ahead), and keeps the batches
        of the noted steps that are done and were skipped: no host read
        waits on a step."""
        with self._lock:
            self._watched.append((batch, applied, step))
        self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        while True:
            with self._lock:
                if not self._watched or not (wait or all(_is_ready(a) for a in self._watched[0][1:])):
                    return
                batch, applied, step = self._watched.pop(0)
            if not bool(np.asarray(applied)):  # done: no wait
                self.receive(batch, step)

    def receive(self, batch: Any, step: Any) -> None:
        """Keeps `batch` and `step` as they are (arrays, or tensors that no
        later step writes): the copy to NumPy waits for a read, so that a
        skipped step does no host read for it."""
        with self._lock:
            self._received = (batch, step)
            self.kept = None

    def read(self) -> tuple[Any, int] | None:
        if self._barrier is not None:
            self._barrier()
        self._settle(wait=True)
        with self._lock:
            if self._received is not None:
                batch, step = self._received
                host = keras.tree.map_structure(
                    lambda t: None if t is None else np.asarray(ops.convert_to_numpy(t)), batch
                )
                self.kept = (host, int(ops.convert_to_numpy(step)))
                self._received = None
            return self.kept


class VariableScaleModel(ModelBase):
    """A `keras.Model` whose step scales the loss, skips non-finite steps
    (leaving every variable as it was) and reports `loss_scale`,
    `grad_norm` and `skipped_steps` in the training logs: what the JAX and
    torch `MixedPrecisionModel`s share (each adds its `train_step`).

    Args:
        loss_scale: "auto" (the default: a dynamic scale when the model
            computes in float16, none otherwise), a `LossScaler` (or its
            config dict), a number (a fixed scale), or None (no scaling;
            non-finite steps are still skipped).
    """

    #: Waited for before the kept batch is read (JAX's host callbacks).
    _mp_kept_barrier: Callable[[], None] | None = None
    #: The backend's `LossScaleOptimizer` (set by each backend's class).
    _mp_optimizer_class: type

    def __init__(self, *args: Any, loss_scale: Any = AUTO, **kwargs: Any) -> None:
        scaler = scaler_from_argument(loss_scale)
        # Made before the constructors below run: a KerasHub task adopted
        # by a subclass (`class MyLM(MixedPrecisionModel, GPT2CausalLM)`)
        # compiles inside its own constructor.
        object.__setattr__(self, "_mp_chosen_by", "user" if scaler is not None else None)
        initial = _scale_state.initial_values(_DYNAMIC)
        # Untracked by Keras (not the model's own weights: a plain
        # keras.Model with the same layers loads this model's weights, and
        # float32_copy copies them), yet among `non_trainable_variables`, so
        # they enter JAX's stateless step with the rest of the state.
        state = {
            spec.name: _variable(spec.name, spec.dtype, initial[spec.name])
            for spec in _scale_state.STATE_VARIABLES
        }
        epoch = {name: _variable(name, dtype, 0.0) for name, dtype in _EPOCH_VARIABLES}
        object.__setattr__(self, "_mp_state", state)
        object.__setattr__(self, "_mp_epoch", epoch)
        # Per trainable variable, steps whose gradient was not finite: made
        # once the variables are known (`_count_gradients`).
        object.__setattr__(self, "_mp_counts", {})
        object.__setattr__(self, "_mp_kept", _KeptBatch(type(self)._mp_kept_barrier))
        if scaler is not None:
            scaler.bind(state)  # in use from the start: a task compiles in its constructor
        #: The LossScaler in use, reading `_mp_state` (None: "auto" until compile).
        object.__setattr__(self, "_mp_scaler", scaler)
        construct(self, args, kwargs, lambda: super(VariableScaleModel, self).__init__(*args, **kwargs))
        self._count_gradients()

    @property
    def _mp_settings(self) -> _scale_state.ScaleSettings | None:
        return None if self._mp_scaler is None else self._mp_scaler.settings

    @property
    def non_trainable_variables(self) -> list[Any]:
        """Keras's, then the loss scale's state (untracked: see `__init__`)."""
        ours = [*self._mp_state.values(), *self._mp_epoch.values(), *self._mp_counts.values()]
        return list(super().non_trainable_variables) + ours

    @property
    def _loss_scale_state(self) -> LossScaleSaveable:
        # Keras's saver finds this attribute and stores the loss scale under
        # its own path, apart from the model's weights (as on TensorFlow).
        saveable = self.__dict__.get("_mp_loss_scale_saveable")
        if saveable is None:
            saveable = LossScaleSaveable(
                lambda: self._mp_scaler or LossScaler.viewing(_DYNAMIC, self._mp_state)
            )
            self.__dict__["_mp_loss_scale_saveable"] = saveable
        return saveable

    # ---------------------------------------------------------- loss scale
    def _optimizer_scaler(self) -> LossScaler | None:
        """The scaler of the loss-scale optimizer your own train_step
        applies through (None for the model's own step, or without one)."""
        held = getattr(getattr(self, "optimizer", None), "scaler", None)
        return held if self._has_own_train_step() and isinstance(held, LossScaler) else None

    def _scale_variables(self) -> dict[str, Any]:
        """The state variables of the scale in use (an own step's optimizer's, once built)."""
        optimizer: Any = getattr(self, "optimizer", None)
        if self._optimizer_scaler() is not None and optimizer.built:
            return dict(optimizer._mp_state)
        return self._mp_state

    @property
    def scaler(self) -> LossScaler | None:
        """The `LossScaler` that scales this model's loss (None until
        `compile` resolves "auto"): settings, `get_scale()`,
        `diagnostics()`. For your own `train_step` that applies through
        `self.optimizer`, the loss-scale optimizer's."""
        return self._optimizer_scaler() or self._mp_scaler

    @property
    def loss_scale(self) -> Any:
        """The current loss scale (a float32 scalar); None before `compile`
        resolves "auto"."""
        return None if self.scaler is None else self._scale_variables()["scale"].value

    def get_scale(self) -> float:
        """The current loss scale as a Python float (1.0: no scaling)."""
        if self.scaler is None:
            return 2.0**15 if self._computes_in_float16() else 1.0
        return float(ops.convert_to_numpy(self._scale_variables()["scale"].value))

    def loss_scale_state(self) -> dict[str, Any]:
        """The state machine's variables as Python numbers (a host read;
        `lowest_scale` is None before a step), as `LossScaler.diagnostics()`
        gives them on every backend."""
        variables = self._scale_variables()
        state: dict[str, Any] = {
            spec.name: (float if spec.dtype == "float32" else int)(
                ops.convert_to_numpy(variables[spec.name].value)
            )
            for spec in _scale_state.STATE_VARIABLES
        }
        if state["lowest_scale"] == FLOAT32_MAX:
            state["lowest_scale"] = None
        return state

    def set_loss_scale(self, loss_scale: Any) -> None:
        """Replaces the loss scale (same values as the `loss_scale`
        argument). Training resumes from a LossScaler's state; "auto" or
        settings start from their initial scale."""
        scaler = scaler_from_argument(loss_scale)
        self._mp_chosen_by = "user" if scaler is not None else None
        if scaler is None and self.compiled:
            self._mp_chosen_by = "auto"
            self._adopt(_DYNAMIC if self._computes_in_float16() else _DISABLED)
            return
        self._adopt(scaler)

    def _adopt(self, scale: LossScaler | _scale_state.ScaleSettings | None) -> None:
        """Trains with `scale` from here on: a LossScaler moves its state
        into the model's variables; settings (compile's choice) start from
        their initial scale, unless they are those already in use."""
        if scale is self._mp_scaler or (
            isinstance(scale, _scale_state.ScaleSettings) and scale == self._mp_settings
        ):
            return
        if isinstance(scale, LossScaler):
            scale.bind(self._mp_state)
        else:
            initial = _scale_state.initial_values(scale or _DYNAMIC)
            for name, variable in self._mp_state.items():
                variable.assign(initial[name])
            if scale is not None:
                scale = LossScaler.viewing(scale, self._mp_state)
        object.__setattr__(self, "_mp_scaler", scale)
        self._count_gradients()
        self.train_function = None

    def _count_gradients(self) -> None:
        """Makes the per-variable non-finite counters for the trainable
        variables (once they are known; again if they change) and shows
        them to the scaler."""
        if not self.built:
            return
        paths = [v.path for v in self.trainable_variables]
        counts = self._mp_counts.get("nonfinite_counts")
        if counts is None or tuple(counts.shape) != (len(paths),):
            counts = _variable("nonfinite_counts", _scale_state.COUNTER_DTYPE, np.zeros(len(paths)))
            self._mp_counts["nonfinite_counts"] = counts
        if self._mp_scaler is not None:
            self._mp_scaler.count_gradients(counts, paths)

    def nonfinite_gradient_counts(self) -> dict[str, int]:
        """Steps with a non-finite gradient so far, per trainable variable
        path (counted in the step; one host read, between epochs)."""
        return {} if self._mp_scaler is None else self._mp_scaler.nonfinite_gradient_counts()

    def kept_batch(self) -> tuple[tuple[Any, Any, Any], int] | None:
        """The last batch whose step was skipped, and that step's number
        (0-based), as `((x, y, sample_weight), step)` in NumPy; None when no
        step was skipped, or where no batch is kept (`kept_batch_note()`).
        `diagnose_batch(model, *batch)` replays it."""
        return self._mp_kept.read()

    def kept_batch_note(self) -> str | None:
        """Why the last skipped step's batch could not be kept, or None."""
        if self._has_own_train_step() and self._mp_kept.read() is None:
            return (
                "your own train_step keeps no batch unless it calls "
                "scaling.hand_over_if_skipped(outcome, non_trainable, batch, self.keep_skipped_batch)"
            )
        return self._mp_kept.not_kept

    def keep_skipped_batch(self, batch: Any, step: Any) -> None:
        """Receives a skipped step's batch on the host (what
        `LossScaling.hand_over_if_skipped` calls)."""
        self._mp_kept.receive(batch, step)

    # ------------------------------------------------------------- compile
    def compile(self, optimizer: Any = None, *args: Any, **kwargs: Any) -> None:
        """As `keras.Model.compile`, with one loss scale: Keras's own
        wrapping is off; a Keras `LossScaleOptimizer` is unwrapped and its
        scale adopted; `auto_scale_loss=False` turns off "auto". The
        optimizer defaults to that of the class adopted (Keras's "rmsprop",
        a KerasHub task's own)."""
        if optimizer is None:
            optimizer = default_optimizer_argument(super().compile)
        if self._has_own_train_step():
            # Your own train_step applies through self.optimizer: compiled
            # as stock Keras compiles it (a loss-scale optimizer under
            # mixed_float16, never less safe than stock), but the loss-scale
            # optimizer is ours, on the model's settings, so that the scale
            # that scales the loss is the one `scaler`, `get_scale()` and the
            # monitors report. Its `loss_scaling()` (with
            # auto_scale_loss=False) scales with the model's own variables.
            super().compile(optimizer, *args, **kwargs)
            if self._mp_chosen_by != "user":
                self._adopt(_DYNAMIC if self._computes_in_float16() else _DISABLED)
                self._mp_chosen_by = "auto"
            stock: Any = getattr(self, "optimizer", None)
            if isinstance(stock, keras.optimizers.LossScaleOptimizer) and not isinstance(
                getattr(stock, "scaler", None), LossScaler
            ):
                settings = self._mp_settings
                if self._mp_chosen_by != "user" and settings is not None:
                    settings = _scale_state.ScaleSettings.checked(
                        **{
                            **_settings_dict(settings),
                            "initial_scale": float(stock.initial_scale),
                            "growth_interval": int(stock.dynamic_growth_steps),
                        }
                    )
                self.optimizer = self._mp_optimizer_class(
                    stock.inner_optimizer, loss_scale=LossScaler(**_settings_dict(settings or _DYNAMIC))
                )
            self._build_optimizer()
            return
        auto_scale_loss = kwargs.pop("auto_scale_loss", True)
        # "auto": a KerasHub task's own choice, made by its compile below.
        if not (isinstance(optimizer, str) and optimizer == "auto"):
            optimizer = keras.optimizers.get(optimizer)
        adopted = None
        if isinstance(getattr(optimizer, "scaler", None), LossScaler):
            adopted = optimizer.scaler.settings  # mp_callbacks.LossScaleOptimizer: all of its settings
            optimizer = optimizer.inner_optimizer
        elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            adopted = _scale_state.ScaleSettings.checked(
                **{
                    **_settings_dict(_DYNAMIC),
                    "initial_scale": float(optimizer.initial_scale),
                    "growth_interval": int(optimizer.dynamic_growth_steps),
                }
            )
            optimizer = optimizer.inner_optimizer
        elif getattr(optimizer, "loss_scale_factor", None) is not None:
            adopted = _fixed(float(optimizer.loss_scale_factor))
            optimizer.loss_scale_factor = None
        super().compile(optimizer, *args, auto_scale_loss=False, **kwargs)
        if adopted is not None and self._mp_chosen_by != "user":
            self._adopt(adopted)
            self._mp_chosen_by = "user"
        elif self._mp_chosen_by != "user":
            choice = "auto" if auto_scale_loss else "off"
            if self._mp_settings is None or self._mp_chosen_by != choice:
                self._adopt(_DYNAMIC if auto_scale_loss and self._computes_in_float16() else _DISABLED)
                self._mp_chosen_by = choice
        self._build_optimizer()
        self._warn_about_findings()

    def _build_optimizer(self) -> None:
        # Built now rather than at the first fit, so that a load right after
        # compile (load_model, or resuming from a checkpoint) restores the
        # optimizer's slots and iterations too instead of skipping them.
        if self.built and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)
        self._count_gradients()  # before a load restores them

    def make_train_function(self, force: bool = False):
        if self._mp_settings is None:
            raise RuntimeError("MixedPrecisionModel must be compiled before training.")
        self._count_gradients()  # before Keras gathers the step's state
        return super().make_train_function(force=force)

    def _loss_scaling_settings(self) -> _scale_state.ScaleSettings:
        """The settings a backend's `loss_scaling()` scales with, once it
        may: compiled, and not under Keras's own LossScaleOptimizer."""
        if self._mp_settings is None:
            raise RuntimeError("MixedPrecisionModel must be compiled before training.")
        if isinstance(getattr(self, "optimizer", None), keras.optimizers.LossScaleOptimizer):
            raise RuntimeError(
                f"{type(self).__name__}.loss_scaling(): self.optimizer is Keras's LossScaleOptimizer, "
                "which scales and unscales on its own; scaling with loss_scaling() as well would "
                "unscale twice. Compile with auto_scale_loss=False to scale with loss_scaling()."
            )
        return self._mp_settings

    def epoch_sample_count(self) -> float:
        """Samples trained on in the current epoch (a host read)."""
        return float(ops.convert_to_numpy(self._mp_epoch["epoch_samples"].value))

    def reset_metrics(self) -> None:
        super().reset_metrics()
        for variable in self._mp_epoch.values():
            variable.assign(0.0)

    # ---------------------------------------------------------- save / load
    @keras_default_method
    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if self._mp_settings is None:
            config["loss_scale"] = AUTO
        else:
            config["loss_scale"] = self._mp_scaler.get_config()
        return config
