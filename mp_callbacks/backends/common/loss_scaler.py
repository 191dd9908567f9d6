"""`LossScaler` on Keras's JAX and PyTorch backends: the public loss-scale object.

The same settings, checks, config and state as TensorFlow's `LossScaler`,
for a JAX or torch `MixedPrecisionModel`. The scale's state is Keras
variables of the model (JAX's stateless step carries them through the
step; torch's step writes them), and the step scales with
`model.loss_scaling(...)`, not with this object: it is the scale's
settings, and between epochs its read-out and restore. During an epoch on
JAX the variables hold no value: the callbacks read the step's logs
instead.
"""

from __future__ import annotations

from typing import Any

from mp_callbacks import _scale_state
from mp_callbacks._backend import BACKEND, keras
from mp_callbacks._scale_config import ScaleConfig
from mp_callbacks._validation import FLOAT32_MAX
from mp_callbacks.errors import BackendNotSupportedError

__all__ = ["LossScaler"]

#: TensorFlow's `LossScaler` methods that work inside a TensorFlow step
#: (stateful, with a tape); on JAX and torch their place is `model.loss_scaling()`.
_TENSORFLOW_STEP_METHODS = (
    "apply_gradients",
    "build",
    "check_gradients",
    "finish_step",
    "recording",
    "scale",
    "step",
    "unscale",
    "update",
)


def _variables(settings: _scale_state.ScaleSettings) -> dict[str, Any]:
    initial = _scale_state.initial_values(settings)
    return {
        spec.name: keras.Variable(
            initial[spec.name],
            dtype=spec.dtype,
            trainable=False,
            autocast=False,
            name=f"mp_loss_scale_{spec.name}",
        )
        for spec in _scale_state.STATE_VARIABLES
    }


class LossScaler(ScaleConfig):
    """The loss scale of a JAX or torch `MixedPrecisionModel`: dynamic by default,
    fixed with `LossScaler.fixed(s)`, none with `LossScaler.disabled()`
    (non-finite steps are skipped in every case).

    Pass it as `MixedPrecisionModel(..., loss_scale=LossScaler(...))` or to
    `model.set_loss_scale`; `model.scaler` is then this object, and reads
    the model's state. Its arguments, their checks and its config are
    TensorFlow's `LossScaler`'s (see there), so the same code chooses the
    same scale on both backends. Inside a stateless `train_step` of your
    own, scale with `model.loss_scaling(non_trainable_variables)`. It
    serves one model: given to a second, it takes its current state there
    and reads that model's from then on.

    Args:
        initial_scale: float. Defaults to `2**15`.
        growth_interval: int. Defaults to `2000`.
        growth_factor: float > 1. Defaults to `2.0`.
        backoff_factor: float in (0, 1). Defaults to `0.5`.
        min_scale: float. Defaults to `1.0`.
        max_scale: float. Defaults to `2**24`.
        hysteresis: int >= 1. Defaults to `1`.
        name: str. Defaults to `"dynamic_loss_scale"`.

    Raises:
        ValueError: an argument out of its range (named, with the value).
        TypeError: an argument of the wrong type (a bool, a string).
    """

    def __init__(
        self,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        name: str = "dynamic_loss_scale",
    ) -> None:
        settings = _scale_state.ScaleSettings.checked(
            initial_scale, growth_interval, growth_factor, backoff_factor, min_scale, max_scale, hysteresis
        )
        self._settle(settings, str(name), _variables(settings))

    @classmethod
    def viewing(
        cls, settings: _scale_state.ScaleSettings, variables: dict[str, Any], name: str = "dynamic_loss_scale"
    ) -> LossScaler:
        """A scaler of checked `settings` over existing state variables (a
        model's, when compile chooses the scale)."""
        scaler = cls.__new__(cls)
        scaler._settle(settings, name, variables)
        return scaler

    def _settle(self, settings: _scale_state.ScaleSettings, name: str, variables: dict[str, Any]) -> None:
        self._take_settings(settings)
        self.name = name
        self._variables = variables
        # The model's per-variable counters and their paths (see `count_gradients`).
        self._counts: Any = None
        self._paths: list[str] = []

    def bind(self, variables: dict[str, Any]) -> None:
        """Moves this scaler's state into `variables` (a model's) and reads
        them from then on: the model adopting it carries them through its
        step."""
        if variables is self._variables:
            return
        for name, variable in variables.items():
            variable.assign(keras.ops.copy(self._variables[name].value))
        self._variables = variables

    def count_gradients(self, counts: Any, paths: list[str]) -> None:
        """Reads the per-variable non-finite counters `counts` (a model's
        int vector, one entry per trainable variable at `paths`)."""
        self._counts, self._paths = counts, list(paths)

    # ------------------------------------------------------------------ config
    @property
    def scales_losses(self) -> bool:
        """Whether the model's step multiplies the loss by the scale."""
        return self.scaling_active

    # ------------------------------------------------------------------- state
    def get_scale(self) -> float:
        """The current loss scale (one host read)."""
        return float(keras.ops.convert_to_numpy(self._variables["scale"].value))

    def diagnostics(self) -> dict[str, Any]:
        """The state machine's variables as Python numbers, in one host
        read, keyed by the names in `STATE_VARIABLES`."""
        names = [spec.name for spec in _scale_state.STATE_VARIABLES]
        read = [keras.ops.convert_to_numpy(self._variables[name].value) for name in names]
        state: dict[str, Any] = {
            name: int(value) if name in _scale_state.COUNTERS else float(value)
            for name, value in zip(names, read)
        }
        if state["lowest_scale"] == FLOAT32_MAX:
            state["lowest_scale"] = None  # no step since reset_lowest_scale(), as on TensorFlow
        return state

    def nonfinite_gradient_counts(self) -> dict[str, int]:
        """Steps with a non-finite gradient, per trainable variable path, in
        the model's order (empty until the model is built; one host read)."""
        if self._counts is None:
            return {}
        counts = keras.ops.convert_to_numpy(self._counts.value).tolist()
        return dict(zip(self._paths, (int(c) for c in counts)))

    def reset_divergence_latches(self) -> None:
        """Forgets earlier divergence: the current and the longest divergent
        run restart from 0 (a new `fit` starts from here)."""
        for name in ("divergent_run", "max_divergent_run"):
            self._variables[name].assign(keras.ops.zeros_like(self._variables[name].value))

    def reset_max_divergent_run(self) -> None:
        """Restarts the `max_divergent_run` latch from the current run. During
        an epoch, Keras's JAX trainer keeps a write only after a callback has
        read its `model` (which puts the trained state into the variables)."""
        self._variables["max_divergent_run"].assign(keras.ops.copy(self._variables["divergent_run"].value))

    def _state_variables(self) -> dict[str, Any]:
        state = dict(self._variables)
        if self._counts is not None:
            state["nonfinite_counts"] = self._counts
        return state

    def get_state(self) -> dict[str, Any]:
        """The state as NumPy values, keyed as TensorFlow's `get_state()`
        (with `nonfinite_counts` once the model is built)."""
        return {name: keras.ops.convert_to_numpy(v.value) for name, v in self._state_variables().items()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state()`'s values, all checked before any is set
        (counters of another shape are ignored)."""
        for variable, value in _scale_state.validated_updates(self._state_variables(), state):
            variable.assign(value)

    def reset_lowest_scale(self) -> None:
        """Restarts the lowest-scale latch: the next step's scale is the
        lowest, and `diagnostics()` says None until then (as on TensorFlow)."""
        self._variables["lowest_scale"].assign(keras.ops.full((), FLOAT32_MAX, "float32"))

    def __getattr__(self, name: str) -> Any:
        if name in _TENSORFLOW_STEP_METHODS:
            where = (
                "use model.loss_scaling(non_trainable_variables) of a MixedPrecisionModel"
                if BACKEND == "jax"
                else "use model.loss_scaling() of a MixedPrecisionModel"
            ) + " (scale, unscale, check, apply_if_finite, commit, finish)"
            raise BackendNotSupportedError(
                f"LossScaler.{name} runs inside a TensorFlow step and Keras's backend is "
                f"{BACKEND!r}: inside your own train_step, {where}."
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
