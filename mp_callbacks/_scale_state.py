"""The loss scale's state machine: its settings, its variables, one
transition per training step, and checked save/restore.

Contract of `transition`: given the state before a step, the step's
non-finite flags (one per variable, then the loss) and the decision
(True: every gradient was finite, the update was applied), it returns the
state after the step, as PyTorch's `GradScaler.update` and Megatron-LM's
`DynamicGradScaler` define it:

* finite step: `good_steps += 1`; when it reaches `growth_interval`, the
  scale is multiplied by `growth_factor` (capped at `max_scale`),
  `good_steps` is reset to 0 and the hysteresis budget refilled;
* overflowing step (finite loss, non-finite gradients): `good_steps` is
  reset to 0 and one unit of hysteresis is spent; once it is spent the
  scale is multiplied by `backoff_factor` (floored at `min_scale`), and
  every further overflow backs off until the next growth;
* step with a non-finite loss: skipped, but the scale, `good_steps` and
  the hysteresis budget stay as they were: the loss is computed before it
  is scaled, so the scale cannot have caused it (a NaN or inf in the
  data). PyTorch's `GradScaler`, which never sees the loss, backs off here.

A scale that is not a positive finite number (written into the variable by
hand) restarts from `initial_scale`. The counters (steps, skips, divergence,
calibration) are updated in the same transition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from mp_callbacks._backend import counter_dtype, keras
from mp_callbacks._validation import FLOAT32_MAX, check_int, check_real

__all__ = [
    "MAX_FIXED_LOSS_SCALE",
    "MIN_LOSS_SCALE",
    "STATE_VARIABLES",
    "ScaleSettings",
    "check_fixed_scale",
    "check_scale",
    "transition",
    "validated_updates",
]

_OWNER = "LossScaler"
ops = keras.ops
#: The counters' dtype: int64, except on JAX without x64 mode, where
#: Keras would truncate int64 to int32 (with a warning) anyway.
COUNTER_DTYPE = counter_dtype()

#: The smallest loss scale accepted anywhere (fixed, initial, min or max):
#: 2**-24, float16's smallest positive value. Far below it, a loss of order
#: one times the scale leaves float32 gradients that CPUs flush to zero.
MIN_LOSS_SCALE = 2.0**-24
#: The largest fixed scale given as a plain number: a fixed scale cannot
#: back off, so one that overflows does so on every step. A
#: `LossScaler` takes any float32 scale.
MAX_FIXED_LOSS_SCALE = 2.0**64
#: Skips at a scale below this are never calibration: float16 gradients
#: would need magnitudes above 256 to overflow there, which is bad data or
#: divergence, not a scale that is too high.
CALIBRATION_FLOOR = 2.0**8
SCALE_REQUIREMENT = "a finite number >= 2**-24 (5.96e-08)"
FIXED_SCALE_REQUIREMENT = "a number from 2**-24 (5.96e-08) to 2**64 (1.84e+19) when it is a fixed scale"


def check_scale(owner: str, argument: str, value: Any) -> float:
    """A loss scale (initial, min or max) as a float; raises naming
    `argument` below MIN_LOSS_SCALE or beyond float32."""
    return check_real(owner, argument, value, low=MIN_LOSS_SCALE, float32=True, requirement=SCALE_REQUIREMENT)


def check_fixed_scale(owner: str, argument: str, value: Any) -> float:
    """A fixed loss scale given as a plain number, as a float; raises
    naming `argument` outside [MIN_LOSS_SCALE, MAX_FIXED_LOSS_SCALE]."""
    return check_real(
        owner,
        argument,
        value,
        low=MIN_LOSS_SCALE,
        high=MAX_FIXED_LOSS_SCALE,
        requirement=FIXED_SCALE_REQUIREMENT,
    )


@dataclass(frozen=True)
class ScaleSettings:
    """The state machine's settings, checked (see `LossScaler`)."""

    initial_scale: float
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    min_scale: float
    max_scale: float
    hysteresis: int

    @classmethod
    def checked(
        cls,
        initial_scale: Any,
        growth_interval: Any,
        growth_factor: Any,
        backoff_factor: Any,
        min_scale: Any,
        max_scale: Any,
        hysteresis: Any,
    ) -> ScaleSettings:
        """Each setting in the dtype it is stored in (float32 scales, int64
        counters), so that no accepted value becomes inf or 0 later;
        raises naming the argument and the value."""
        initial_scale = check_scale(_OWNER, "initial_scale", initial_scale)
        min_scale = check_scale(_OWNER, "min_scale", min_scale)
        max_scale = check_scale(_OWNER, "max_scale", max_scale)
        growth_interval = check_int(_OWNER, "growth_interval", growth_interval, low=1)
        hysteresis = check_int(_OWNER, "hysteresis", hysteresis, low=1)
        growth_factor = check_real(
            _OWNER, "growth_factor", growth_factor, low=1.0, low_inclusive=False, float32=True
        )
        backoff_factor = check_real(
            _OWNER,
            "backoff_factor",
            backoff_factor,
            low=0.0,
            high=1.0,
            low_inclusive=False,
            high_inclusive=False,
            float32=True,
            requirement="a number in the open interval (0, 1)",
        )
        if min_scale > max_scale:
            raise ValueError(
                f"{_OWNER}: `min_scale` must be <= max_scale ({max_scale!r}); "
                f"received min_scale={min_scale!r}."
            )
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"{_OWNER}: `initial_scale` must be within [min_scale, max_scale] = "
                f"[{min_scale!r}, {max_scale!r}]; received initial_scale={initial_scale!r}."
            )
        return cls(
            initial_scale, growth_interval, growth_factor, backoff_factor, min_scale, max_scale, hysteresis
        )

    @property
    def is_dynamic(self) -> bool:
        return self.min_scale < self.max_scale


class StateVariable(NamedTuple):
    name: str
    dtype: Any
    doc: str


#: The one table of the state machine's variables. Their names are the keys
#: of `diagnostics()`, `get_state()`/`set_state()` and of the saved weights.
STATE_VARIABLES = (
    StateVariable("scale", "float32", "the current loss scale"),
    StateVariable("good_steps", COUNTER_DTYPE, "finite steps since the last growth or overflow"),
    StateVariable("hysteresis_left", COUNTER_DTYPE, "overflows left before the next backoff"),
    StateVariable("step_count", COUNTER_DTYPE, "steps seen (applied or skipped)"),
    StateVariable("skipped_steps", COUNTER_DTYPE, "steps skipped for non-finite gradients"),
    StateVariable("nonfinite_loss_steps", COUNTER_DTYPE, "steps whose loss was non-finite"),
    StateVariable(
        "divergent_steps",
        COUNTER_DTYPE,
        "divergent steps: a non-finite loss, or a skipped step with the scale at min_scale",
    ),
    StateVariable("divergent_run", COUNTER_DTYPE, "the current run of consecutive divergent steps"),
    StateVariable(
        "max_divergent_run",
        COUNTER_DTYPE,
        "the longest divergent run since the last reset_divergence_latches()",
    ),
    StateVariable(
        "lowest_scale",
        "float32",
        "the lowest scale a step reached since the last reset_lowest_scale()",
    ),
    StateVariable(
        "calibration_steps",
        COUNTER_DTYPE,
        "overflowing steps before the first applied one, with a finite loss: a "
        "dynamic scale calibrating down from initial_scale",
    ),
)
COUNTERS = tuple(v.name for v in STATE_VARIABLES if v.dtype == COUNTER_DTYPE)


def initial_values(settings: ScaleSettings) -> dict[str, Any]:
    values: dict[str, Any] = {spec.name: 0 for spec in STATE_VARIABLES}
    values.update(
        scale=settings.initial_scale, hysteresis_left=settings.hysteresis, lowest_scale=settings.initial_scale
    )
    return values


def transition(
    settings: ScaleSettings, state: dict[str, Any], flags: Any, applied: Any, xp: Any = None
) -> dict[str, Any]:
    """The state after one step (see the module's docstring): `state` holds
    the variables' values before it, `flags` the step's non-finite flags
    (per variable, then the loss; all-reduced), `applied` the decision.
    Returns the new value of every variable (the per-variable counters
    under "nonfinite_counts": their increments). In `keras.ops`, so that
    every backend runs the same state machine; `xp` is a namespace with the
    same functions over the backend's own tensors (torch's step passes one:
    Keras's dispatch of each scalar op costs a share of a small eager step)."""
    ops = keras.ops if xp is None else xp
    counter = COUNTER_DTYPE
    zero = ops.zeros((), counter)
    one = ops.ones((), counter)
    loss_diverged = ops.not_equal(flags[-1], 0)
    not_applied = ops.logical_not(applied)
    scale = state["scale"]
    scale = ops.where(
        ops.logical_and(ops.isfinite(scale), scale > 0.0),
        scale,
        ops.full((), settings.initial_scale, "float32"),
    )

    good = state["good_steps"] + one
    grow = ops.logical_and(applied, good >= settings.growth_interval)
    # Skipped for a non-finite loss: nothing the scale did, nothing to undo.
    overflow = ops.logical_and(not_applied, ops.logical_not(loss_diverged))
    bad_data = ops.logical_and(not_applied, loss_diverged)
    spent = ops.maximum(state["hysteresis_left"] - one, zero)
    back_off = ops.logical_and(overflow, spent <= 0)
    new_scale = ops.where(
        grow,
        ops.minimum(scale * settings.growth_factor, settings.max_scale),
        ops.where(back_off, ops.maximum(scale * settings.backoff_factor, settings.min_scale), scale),
    )
    divergent = ops.logical_or(loss_diverged, ops.logical_and(not_applied, scale <= settings.min_scale))
    run = ops.where(divergent, state["divergent_run"] + one, zero)
    new = {
        "scale": new_scale,
        "good_steps": ops.where(
            applied, ops.where(grow, zero, good), ops.where(bad_data, state["good_steps"], zero)
        ),
        "hysteresis_left": ops.where(
            applied,
            ops.where(grow, ops.full((), settings.hysteresis, counter), state["hysteresis_left"]),
            ops.where(bad_data, state["hysteresis_left"], spent),
        ),
        "step_count": state["step_count"] + one,
        "skipped_steps": state["skipped_steps"] + ops.where(applied, zero, one),
        "nonfinite_loss_steps": state["nonfinite_loss_steps"] + ops.cast(loss_diverged, counter),
        "divergent_steps": state["divergent_steps"] + ops.cast(divergent, counter),
        "divergent_run": run,
        "max_divergent_run": ops.maximum(state["max_divergent_run"], run),
        "lowest_scale": ops.minimum(state["lowest_scale"], new_scale),
        "calibration_steps": state["calibration_steps"],
        "nonfinite_counts": ops.minimum(ops.cast(flags[:-1], counter), one),
    }
    if settings.is_dynamic:
        # Overflows before any step was applied, with a finite loss, room to
        # back off and a scale high enough to overflow healthy gradients: the
        # scale finding its level, not bad data. (On some CPUs an all-inf
        # batch gives a finite loss: only the scale's level tells them apart.)
        calibrating = ops.logical_and(
            ops.logical_and(overflow, ops.equal(state["step_count"], state["skipped_steps"])),
            ops.logical_and(scale > settings.min_scale, scale >= CALIBRATION_FLOOR),
        )
        new["calibration_steps"] = state["calibration_steps"] + ops.cast(calibrating, counter)
    return new


def _valid_counter(value: np.ndarray) -> bool:
    """Non-negative integers that int64 holds: integer arrays, or floats
    that are whole numbers below 2**63 (comparing a float with INT64_MAX
    would round INT64_MAX up to 2**63 and let 2**63 through)."""
    if np.issubdtype(value.dtype, np.integer):
        return bool(np.all(value >= 0))
    if np.issubdtype(value.dtype, np.floating):
        return bool(
            np.all(np.isfinite(value))
            and np.all(value >= 0)
            and np.all(value < 2.0**63)
            and np.all(np.floor(value) == value)
        )
    return False


def validated_updates(variables: dict[str, Any], state: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(variable, value) pairs that restore `state`, all checked before any is assigned: keys that are unknown
    or of another shape are ignored; a scale that is not a finite number
    > 0, or a counter that is not a non-negative integer, raises."""
    updates = []
    for key, variable in variables.items():
        if key not in state:
            continue
        value = np.asarray(state[key])
        if value.shape != tuple(variable.shape):
            continue
        if key in ("scale", "lowest_scale"):
            number = float(value)
            if not (math.isfinite(number) and 0 < number <= FLOAT32_MAX):
                raise ValueError(
                    f"{_OWNER}: cannot restore the loss scale: the saved `{key}` "
                    f"is {number!r}, and a loss scale must be a finite number "
                    "> 0. The checkpoint or weights file holds a corrupted "
                    "loss scale; restore an earlier one, or call "
                    "set_state without this key to keep the current scale."
                )
        elif not _valid_counter(value):
            raise ValueError(
                f"{_OWNER}: cannot restore the loss scale's counter `{key}`: it "
                f"must be a non-negative integer; received {key}={value!r}."
            )
        updates.append((variable, ops.convert_to_tensor(value, variable.dtype)))
    return updates
