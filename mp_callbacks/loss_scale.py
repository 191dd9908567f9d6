"""The loss-scale state machine: `DynamicLossScale`.

One object holds the loss scale and its counters in TensorFlow variables and
makes the one decision a mixed-precision step needs: were all gradients
finite? If so they are applied and the scale may grow; if not, the step is
skipped and the scale may back off. `MixedPrecisionModel.train_step` uses it,
and it works alone in a hand-written `tf.function` loop.

State transitions (per call of `apply_gradients`), as in PyTorch's
`GradScaler` and Megatron-LM's `DynamicGradScaler`:

* finite step: the optimizer is applied and `good_steps += 1`. When
  `good_steps` reaches `growth_interval`, the scale is multiplied by
  `growth_factor` (capped at `max_scale`), `good_steps` is reset to 0 and the
  hysteresis budget is refilled to `hysteresis`.
* non-finite step: nothing is applied (weights and optimizer state, including
  its iteration count, stay as they were), `good_steps` is reset to 0 and one
  unit of the hysteresis budget is spent. When the budget is exhausted the
  scale is multiplied by `backoff_factor` (floored at `min_scale`); the budget
  then stays at 0, so every further overflow backs off until the next growth.

A fixed scale is the degenerate machine with `min_scale == max_scale`
(`DynamicLossScale.fixed(128.0)`); no scaling is the fixed scale 1.0
(`DynamicLossScale.disabled()`). Both still skip non-finite steps, since a
NaN update would destroy the weights.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import threading
import warnings
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from mp_callbacks._backend import keras, tf
from mp_callbacks._gated_update import gated_apply
from mp_callbacks._step_record import StepRecord
from mp_callbacks._validation import FLOAT32_MAX, check_int, check_real, fail
from mp_callbacks.errors import MixedPrecisionWarning

__all__ = ["CheckedGradients", "DynamicLossScale", "STATE_VARIABLES"]

logger = logging.getLogger(__name__)

_ONLY_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA
# The hot-path methods branch only on Python values; AutoGraph has nothing
# to convert there, and some TensorFlow releases mis-convert them.
_no_autograph = tf.autograph.experimental.do_not_convert
_OWNER = "DynamicLossScale"

#: The smallest loss scale accepted anywhere (fixed, initial, min or max):
#: 2**-24, float16's smallest positive value. A scale exists to move
#: gradients into the compute dtype's range; far below this, a loss of order
#: one times the scale leaves float32 gradients that CPUs flush to zero, and
#: every step silently applies zeros.
MIN_LOSS_SCALE = 2.0**-24
#: The largest fixed scale given as a plain number. A fixed scale cannot back
#: off, so one that overflows does so on every step; up to 2**64, gradients
#: keep 2**64 of float32's range (about as much as the floor leaves below).
#: A `DynamicLossScale` takes any float32 scale, e.g. 2**127 to provoke
#: overflows on purpose.
MAX_FIXED_LOSS_SCALE = 2.0**64
SCALE_REQUIREMENT = "a finite number >= 2**-24 (5.96e-08)"
FIXED_SCALE_REQUIREMENT = "a number from 2**-24 (5.96e-08) to 2**64 (1.84e+19) when it is a fixed scale"


def check_scale(owner: str, argument: str, value: Any) -> float:
    """A loss scale (initial, min or max) as a float; raises naming
    `argument` below MIN_LOSS_SCALE or beyond float32."""
    return check_real(owner, argument, value, low=MIN_LOSS_SCALE, float32=True,
                      requirement=SCALE_REQUIREMENT)


def check_fixed_scale(owner: str, argument: str, value: Any) -> float:
    """A fixed loss scale given as a plain number, as a float; raises
    naming `argument` outside [MIN_LOSS_SCALE, MAX_FIXED_LOSS_SCALE]."""
    return check_real(owner, argument, value, low=MIN_LOSS_SCALE, high=MAX_FIXED_LOSS_SCALE,
                      requirement=FIXED_SCALE_REQUIREMENT)


class _StateVariable(NamedTuple):
    name: str
    dtype: Any
    doc: str


#: The one table of the state machine's variables. Their names are the keys
#: of `diagnostics()`, `get_state()`/`set_state()` and of the saved weights.
STATE_VARIABLES = (
    _StateVariable("scale", tf.float32, "the current loss scale"),
    _StateVariable("good_steps", tf.int64, "finite steps since the last growth or overflow"),
    _StateVariable("hysteresis_left", tf.int64, "overflows left before the next backoff"),
    _StateVariable("step_count", tf.int64, "steps seen (applied or skipped)"),
    _StateVariable("skipped_steps", tf.int64, "steps skipped for non-finite gradients"),
    _StateVariable("nonfinite_loss_steps", tf.int64, "steps whose loss was non-finite"),
    _StateVariable(
        "divergent_steps", tf.int64,
        "divergent steps: a non-finite loss, or a skipped step with the scale at min_scale",
    ),
    _StateVariable("divergent_run", tf.int64, "the current run of consecutive divergent steps"),
    _StateVariable(
        "max_divergent_run", tf.int64,
        "the longest divergent run since the last reset_divergence_latches()",
    ),
    _StateVariable(
        "lowest_scale", tf.float32,
        "the lowest scale a step reached since the last reset_lowest_scale()",
    ),
    _StateVariable(
        "calibration_steps", tf.int64,
        "overflowing steps before the first applied one, with a finite loss: a "
        "dynamic scale calibrating down from initial_scale",
    ),
)
_COUNTERS = tuple(v.name for v in STATE_VARIABLES if v.dtype == tf.int64)
# Names used by earlier releases in saved weights.
_LEGACY_NAMES = {
    "skipped_count": "skipped_steps",
    "nonfinite_loss_count": "nonfinite_loss_steps",
    "divergent_count": "divergent_steps",
}


def _dense(value: Any) -> Any:
    return value.values if isinstance(value, tf.IndexedSlices) else value


def _half_sum_of_squares(grad: Any) -> tf.Tensor:
    """sum(grad**2) / 2 in float32, one fused kernel (L2Loss); 0 for None."""
    if grad is None:
        return tf.constant(0.0, tf.float32)
    grad = _dense(grad)
    if grad.dtype != tf.float32:
        grad = tf.cast(grad, tf.float32)  # float16 squares overflow at 256
    return tf.nn.l2_loss(grad)


def _valid_counter(value: np.ndarray) -> bool:
    """Non-negative integers that int64 holds: integer arrays, or floats
    that are whole numbers below 2**63 (comparing a float with INT64_MAX
    would round INT64_MAX up to 2**63 and let 2**63 through)."""
    if np.issubdtype(value.dtype, np.integer):
        return bool(np.all(value >= 0))
    if np.issubdtype(value.dtype, np.floating):
        return bool(np.all(np.isfinite(value)) and np.all(value >= 0)
                    and np.all(value < 2.0**63) and np.all(np.floor(value) == value))
    return False


_THREAD_STATE = threading.local()


def _per_thread(name: str) -> dict[int, Any]:
    """A dict of this thread's own, for trace-time state keyed by object id."""
    table = getattr(_THREAD_STATE, name, None)
    if table is None:
        table = {}
        setattr(_THREAD_STATE, name, table)
    return table


def _applied_norm(checked: "CheckedGradients", grads: list[Any], variables: list[Any]) -> tf.Tensor:
    """The global norm of the gradients, leaving out float8 state variables,
    whose "gradients" are their next values."""
    overwrite = [bool(getattr(v, "overwrite_with_gradient", False)) for v in variables]
    if not any(overwrite):
        return checked.global_norm
    squares = [_half_sum_of_squares(g) for g, skip in zip(grads, overwrite) if not skip]
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.sqrt(2.0 * tf.add_n(squares))


class _Untracked:
    """Holds the model's variables without making them the loss scale's:
    a list set on a tf.Module would be walked into its `variables` and
    written into its checkpoints."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items


class CheckedGradients(NamedTuple):
    """What one pass over the gradients found (see `check_gradients`)."""

    flags: tf.Tensor  #: int64 [n]: 1 where a gradient holds inf or NaN
    global_norm: tf.Tensor  #: float32: global L2 norm (meaningful when all flags are 0)
    #: bool: True when every gradient is finite (all flags 0). Given
    #: directly so that the skip decision does not wait on the flags.
    all_finite: tf.Tensor | None = None


def _nonfinite_flag(value: Any) -> tf.Tensor:
    """1 if `value` holds any inf or NaN, else 0 (int64; 0 for None; the
    largest flag for a list of losses)."""
    if value is None:
        return tf.constant(0, tf.int64)
    if isinstance(value, (list, tuple)):
        flags = [_nonfinite_flag(v) for v in value]
        return flags[0] if len(flags) == 1 else tf.reduce_max(tf.stack(flags))
    if isinstance(value, tf.IndexedSlices):
        value = value.values
    return tf.cast(
        tf.logical_not(tf.reduce_all(tf.math.is_finite(value))), tf.int64
    )


@keras.saving.register_keras_serializable(package="mp_callbacks")
class DynamicLossScale(tf.Module):
    """Dynamic loss scaling for mixed-precision training.

    Args:
        initial_scale: the scale to start from. A high value is best: a
            scale that is too high is lowered in a few skipped steps, one that
            is too low is raised only every `growth_interval` steps.
        growth_interval: number of consecutive finite steps after which the
            scale grows.
        growth_factor: factor (> 1) by which the scale grows.
        backoff_factor: factor in (0, 1) by which the scale shrinks after
            an overflow.
        min_scale: the scale never falls below this.
        max_scale: the scale never grows above this. All three scales are at
            least 2**-24: below it, gradients underflow to zero.
        hysteresis: number of overflowing steps tolerated before backing off
            (Megatron-LM and DeepSpeed's `hysteresis`); 1 backs off on every
            overflow.
        name: name of the TensorFlow module holding the variables.

    The variables are created when the object is made; under a
    `tf.distribute` strategy, make it inside `strategy.scope()`.

    Example (a hand-written loop):

    ```python
    import keras, tensorflow as tf
    from mp_callbacks import DynamicLossScale

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    loss_scale = DynamicLossScale(initial_scale=2.0**10)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, model(x))
            loss = tf.reduce_mean(loss)
            scaled_loss = loss_scale.scale(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = loss_scale.unscale(grads)
        return loss_scale.apply_gradients(
            optimizer, grads, model.trainable_variables, loss=loss)

    applied = train_step(tf.ones((8, 4)), tf.zeros((8, 1)))
    print(bool(applied), loss_scale.get_scale())  # True 1024.0
    ```
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
        initial_scale, min_scale, max_scale = (
            check_scale(_OWNER, argument, value)
            for argument, value in (
                ("initial_scale", initial_scale),
                ("min_scale", min_scale),
                ("max_scale", max_scale),
            )
        )
        # int64 counters: good_steps + 1 must not overflow.
        growth_interval = check_int(_OWNER, "growth_interval", growth_interval, low=1)
        hysteresis = check_int(_OWNER, "hysteresis", hysteresis, low=1)
        growth_factor = check_real(
            _OWNER, "growth_factor", growth_factor, low=1.0, low_inclusive=False, float32=True
        )
        backoff_factor = check_real(
            _OWNER, "backoff_factor", backoff_factor, low=0.0, high=1.0,
            low_inclusive=False, high_inclusive=False, float32=True,
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
        super().__init__(name=name)
        self.initial_scale = initial_scale
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.hysteresis = hysteresis

        initial_values = {
            "scale": initial_scale,
            "hysteresis_left": hysteresis,
            "lowest_scale": initial_scale,
        }
        self._state: dict[str, tf.Variable] = {}
        # The state must not be replicated per device: one value, updated
        # identically by every replica after one all-reduced decision.
        with tf.init_scope(), self.name_scope:
            for spec in STATE_VARIABLES:
                self._state[spec.name] = tf.Variable(
                    initial_values.get(spec.name, 0),
                    dtype=spec.dtype,
                    trainable=False,
                    aggregation=_ONLY_FIRST,
                    name=spec.name,
                )
        self._scale = self._state["scale"]
        # Per-variable non-finite counts need the variable list: see build().
        self._nonfinite_counts = None
        self._variable_paths: list[str] = []
        self._variable_ids: tuple[int, ...] = ()
        # Whether the last recorded step scaled its loss (None: none traced yet).
        self._scaling_seen: bool | None = None
        self._warned_optimizers: set[int] = set()

    # ------------------------------------------------------------------ config
    @classmethod
    def fixed(cls, scale: float, name: str = "fixed_loss_scale") -> "DynamicLossScale":
        """A constant loss scale (still skips non-finite steps)."""
        return cls(initial_scale=scale, min_scale=scale, max_scale=scale, name=name)

    @classmethod
    def disabled(cls, name: str = "no_loss_scale") -> "DynamicLossScale":
        """No loss scaling: scale 1.0, non-finite steps still skipped."""
        return cls.fixed(1.0, name=name)

    @property
    def is_dynamic(self) -> bool:
        """True when the scale can change (`min_scale < max_scale`)."""
        return self.min_scale < self.max_scale

    @property
    def scaling_active(self) -> bool:
        """False when the scale is fixed at 1.0 (multiplying is skipped)."""
        return self.is_dynamic or self.initial_scale != 1.0

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_scale": self.initial_scale,
            "growth_interval": self.growth_interval,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DynamicLossScale":
        return cls(**config)

    def __repr__(self) -> str:
        if not self.is_dynamic:
            return f"DynamicLossScale.fixed({self.initial_scale!r})"
        return (
            f"DynamicLossScale(initial_scale={self.initial_scale!r}, "
            f"growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis})"
        )

    # ----------------------------------------------------------------- build
    @property
    def built(self) -> bool:
        return self._nonfinite_counts is not None

    def build(self, variables: Sequence[Any]) -> None:
        """Creates the per-variable non-finite counters for `variables`.

        Called by `MixedPrecisionModel` before training, and lazily by the
        first `apply_gradients`. Under a `tf.distribute` strategy call it
        once inside `strategy.scope()` before the first step. Calling it again
        with the same variables is a no-op; with the same variables followed
        by new ones (as `apply_gradients` does when a call brings new
        variables) it keeps their counts and adds zeros; with other variables
        it starts new counters.
        """
        variables = list(variables)
        ids = tuple(id(v) for v in variables)
        if self.built and (ids == self._variable_ids or set(ids) <= set(self._variable_ids)):
            return
        with tf.init_scope(), self.name_scope:
            counts = np.zeros([len(variables)], np.int64)
            known = len(self._variable_ids)
            if self.built and ids[:known] == self._variable_ids:
                counts[:known] = self._nonfinite_counts.numpy()
            self._nonfinite_counts = tf.Variable(
                counts,
                trainable=False,
                aggregation=_ONLY_FIRST,
                name="nonfinite_gradient_counts",
            )
        self._variable_ids = ids
        self._built = _Untracked(variables)
        self._variable_paths = [
            getattr(v, "path", None) or v.name for v in variables
        ]

    # -------------------------------------------------------------- hot path
    @property
    def loss_scale(self) -> tf.Tensor:
        """The current scale as a float32 tensor (no host sync)."""
        return tf.identity(self._scale)

    # ------------------------------------------------------- step records
    # Per thread: MirroredStrategy traces each replica's step in a thread of
    # its own, and each replica keeps its own record and pending applies.
    @property
    def _record(self) -> StepRecord | None:
        """The training step being traced, when a MixedPrecisionModel records it."""
        return _per_thread("records").get(id(self))

    @property
    def _pending(self) -> list[tuple[list[Any], tf.Tensor, tf.Tensor | None]]:
        """Applies awaiting one update() (variables, flags, and the decision
        when it needed no all-reduce)."""
        return _per_thread("pending").setdefault(id(self), [])

    @contextlib.contextmanager
    def recording(self) -> Iterator[StepRecord]:
        """Records one training step (see `mp_callbacks._step_record`):
        while open, applies defer the state update to `finish_step`."""
        records = _per_thread("records")
        outer = records.get(id(self))
        records[id(self)] = record = StepRecord()
        try:
            yield record
        finally:
            records[id(self)] = outer

    def finish_step(self, record: StepRecord) -> None:
        """Advances the state machine once for the recorded step's applies."""
        if self._pending:
            self.update()
        self._scaling_seen = record.loss_scaled

    @property
    def scales_losses(self) -> bool:
        """True when this scale multiplies the losses it trains on: it is
        not fixed at 1.0 and the last recorded step (if any) scaled its
        loss. False for a model's own `train_step` that never calls
        `scale`, whose gradients are then not scaled either."""
        return self.scaling_active and self._scaling_seen is not False

    # -------------------------------------------------------------- hot path
    @_no_autograph
    def scale(self, loss: Any) -> tf.Tensor:
        """Returns `loss * scale`, in the dtype of `loss`.

        Step 1 of 2 in your own training step: scale the loss inside the
        `GradientTape`, then pass the gradients of the scaled loss to `step`.
        """
        if self._record is not None:
            self._record.note_loss(loss)
            self._record.loss_scaled = True
        elif self._scaling_seen is None:
            self._scaling_seen = True
        if not self.scaling_active:
            return loss
        loss = tf.convert_to_tensor(loss)
        return loss * tf.cast(self._scale, loss.dtype)

    @_no_autograph
    def unscale(self, grads: Iterable[Any], variables: Iterable[Any] | None = None) -> list[Any]:
        """Divides each gradient by the scale; None gradients pass through.

        With `variables`, the "gradients" of variables that Keras overwrites
        with their gradient (`overwrite_with_gradient`: float8 layers' scales
        and amax histories) pass through unchanged, as in Keras's own
        `LossScaleOptimizer`. Inside a `MixedPrecisionModel`'s training
        step, the model's optimizer then takes these gradients as unscaled.
        """
        if self._record is not None:
            self._record.unscaled_by_hand = True
        return self._unscale(grads, variables)

    def _unscale(self, grads: Iterable[Any], variables: Iterable[Any] | None = None) -> list[Any]:
        grads = list(grads)
        if not self.scaling_active:
            return grads
        inverse = tf.math.reciprocal(self._scale)
        overwrite = (
            [bool(getattr(v, "overwrite_with_gradient", False)) for v in variables]
            if variables is not None else [False] * len(grads)
        )

        def unscale_one(grad, keep):
            if grad is None or keep:
                return grad
            if isinstance(grad, tf.IndexedSlices):
                return tf.IndexedSlices(
                    grad.values * tf.cast(inverse, grad.values.dtype),
                    grad.indices,
                    grad.dense_shape,
                )
            return grad * tf.cast(inverse, grad.dtype)

        return [unscale_one(g, keep) for g, keep in zip(grads, overwrite)]

    @_no_autograph
    def check_gradients(self, grads: Sequence[Any]) -> CheckedGradients:
        """One pass over `grads`: which hold inf or NaN, and their global norm.

        Each gradient is read once, by one fused sum-of-squares kernel
        (`tf.nn.l2_loss`), which gives the norm and, since inf and NaN
        propagate through it, finiteness. Only when some sum is not finite
        (an overflow, or squares beyond float32's range) does a second,
        exact pass run, inside a `tf.cond`, to tell which gradients hold
        inf or NaN; healthy steps never pay for it.
        """
        grads = list(grads)
        if not grads:
            return CheckedGradients(
                tf.zeros([0], tf.int64), tf.constant(0.0, tf.float32), tf.constant(True)
            )
        # The sums are non-negative: their total is finite only if each is.
        total = tf.add_n([_half_sum_of_squares(g) for g in grads])

        def exact_check():
            flags = tf.stack([_nonfinite_flag(g) for g in grads])
            return flags, tf.equal(tf.reduce_max(flags), 0)

        # Every update of the step waits on this decision: the healthy
        # branch hands it over without going through the flags.
        flags, all_finite = tf.cond(
            tf.math.is_finite(total),
            lambda: (tf.zeros([len(grads)], tf.int64), tf.constant(True)),
            exact_check,
        )
        return CheckedGradients(flags, tf.sqrt(2.0 * total), all_finite)

    @_no_autograph
    def apply_gradients(
        self,
        optimizer: keras.optimizers.Optimizer,
        grads: Iterable[Any],
        variables: Iterable[Any],
        loss: Any = None,
        restore_on_skip: Sequence[tuple[Any, Any]] = (),
        update: bool | None = None,
        checked: CheckedGradients | None = None,
    ) -> tf.Tensor:
        """Applies unscaled `grads` if all are finite; updates the state.

        `step` is the same for the gradients of a scaled loss (it unscales
        them first); this method is for gradients you unscaled yourself
        (to clip them, say).

        Several optimizers, one scale (a GAN's generator and discriminator):
        call this once per optimizer with `update=False`, then `update()`
        once. Each optimizer is skipped only if its own gradients are not
        all finite (PyTorch's `GradScaler.step(optimizer)`), and the scale
        moves once per training step: it backs off if any optimizer's
        gradients overflowed (`GradScaler.update()`). Inside a
        `MixedPrecisionModel`'s training step this is the default: the
        model calls `update()` once at the end of the step. The variables
        of all the optimizers are counted together: `build` them all at
        once, or let the calls do it on the first step.

        Args:
            optimizer: a Keras optimizer. A `LossScaleOptimizer` is
                unwrapped: its inner optimizer applies the gradients
                (Keras's own, which `compile` adds under `mixed_float16`,
                with a `MixedPrecisionWarning`: it would unscale them a
                second time). A `loss_scale_factor` set on the optimizer is
                cleared, with a warning, for the same reason.
            grads: unscaled gradients, one per variable (None allowed).
            variables: the variables the gradients belong to.
            loss: the unscaled loss the gradients come from, or None
                (default; inside a `MixedPrecisionModel`'s step, the losses
                the step computed or scaled). A non-finite loss counts as
                divergence for `NaNGradientMonitor`, and sparse writes wait
                for it.
            restore_on_skip: `(variable, value)` pairs assigned back when
                the step is skipped: state that the forward pass already
                changed, such as BatchNormalization's moving statistics,
                read before the forward pass. Nothing is assigned on an
                applied step. Defaults to none.
            update: advance the state machine now (True), or leave it to
                one `update()` call after every optimizer of the step
                (False). None (default): False inside a
                `MixedPrecisionModel`'s training step, True elsewhere.
            checked: the result of `check_gradients(grads)`, when the caller
                already made that pass: it is not made twice. Defaults to
                None (the pass is made here).

        Returns:
            A boolean scalar tensor: True if the gradients were applied.

        Under a `tf.distribute` strategy call it inside `strategy.run`: the
        finiteness of every replica's gradients is all-reduced, so all
        replicas take the same decision and keep the same scale.

        Inside a `tf.function` without a strategy, the update is not put in
        a `tf.cond`: each write the optimizer makes keeps the old value when
        the step is skipped, which healthy steps do not pay for. With
        `loss`, a sparse increment (SGD on an Embedding) does not wait for
        the decision: it is written once the loss is known to be finite,
        and the rows it touched are put back on a skip. An update that
        writes state in ways that cannot be gated (see
        `mp_callbacks._gated_update`) is put in a `tf.cond` instead.
        """
        grads = list(grads)
        variables = list(variables)
        if len(grads) != len(variables):
            raise ValueError(
                "DynamicLossScale.apply_gradients: got "
                f"{len(grads)} gradients for {len(variables)} variables."
            )
        optimizer = self._plain_optimizer(optimizer)
        record = self._record
        if loss is None and record is not None and record.losses:
            loss = list(record.losses)
        if update is None:
            update = record is None
        if self.built and not set(map(id, variables)) <= set(self._variable_ids):
            known = {id(v) for v in self._built.items}
            self.build(self._built.items + [v for v in variables if id(v) not in known])
        else:
            self.build(variables)
        if not optimizer.built:
            optimizer.build(variables)

        if checked is None:
            checked = self.check_gradients(grads)
        loss_flag = _nonfinite_flag(loss)
        flags = tf.concat([checked.flags, [loss_flag]], axis=0)
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:
            raise RuntimeError(
                "DynamicLossScale.apply_gradients must run in a replica "
                "context: call it inside `strategy.run(...)`."
            )
        if replica_context.num_replicas_in_sync > 1:
            # One global decision: every replica sees every replica's flags.
            flags = replica_context.all_reduce(
                tf.distribute.ReduceOp.SUM, flags
            )
        local_decision = None
        if replica_context.num_replicas_in_sync == 1 and checked.all_finite is not None:
            grads_finite = local_decision = checked.all_finite
        else:
            grads_finite = tf.equal(tf.reduce_sum(flags[:-1]), 0)
        if record is not None:
            record.note_apply(grads_finite, _applied_norm(checked, grads, variables))

        restore_on_skip = list(restore_on_skip)
        restore_variables = [variable for variable, _ in restore_on_skip]
        restore_values = [value for _, value in restore_on_skip]
        if (
            not tf.distribute.has_strategy()
            or tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            # Without a strategy the update is gated write by write, which
            # healthy steps do not pay for; otherwise (or for an optimizer
            # whose writes cannot be gated) the whole update sits in a cond.
            gated = not tf.distribute.has_strategy() and gated_apply(
                optimizer,
                lambda: self._apply(optimizer, grads, variables),
                grads_finite,
                # Computed from the loss, so whatever waits for it comes
                # after every read of the forward pass.
                forward_done=None if loss is None else tf.equal(loss_flag, 0),
                restore_on_skip=restore_on_skip,
            )
            if not gated:
                tf.cond(
                    grads_finite,
                    lambda: self._apply(optimizer, grads, variables),
                    lambda: self._restore(restore_variables, restore_values),
                )
            if update:
                self._update_state(self._full_flags(variables, flags), grads_finite)
            else:
                self._pending.append((variables, flags, local_decision))
        else:
            # A cond whose branch calls optimizer.apply (which merge_calls)
            # cannot run in a replica context: decide in cross-replica context,
            # as Keras's own LossScaleOptimizer._tf_apply does.
            def decide(distribution, grads, flags, restore_values):
                flags = distribution.experimental_local_results(flags)[0]

                def apply_on_every_replica():
                    distribution.extended.call_for_each_replica(
                        self._apply, args=(optimizer, grads, variables)
                    )

                def restore_on_every_replica():
                    distribution.extended.call_for_each_replica(
                        self._restore, args=(restore_variables, restore_values)
                    )

                tf.cond(
                    tf.equal(tf.reduce_sum(flags[:-1]), 0),
                    apply_on_every_replica,
                    restore_on_every_replica,
                )
                if update:
                    self._update_state(self._full_flags(variables, flags))

            replica_context.merge_call(decide, args=(grads, flags, restore_values))
            if not update:
                self._pending.append((variables, flags, None))
        return grads_finite

    @_no_autograph
    def step(
        self,
        optimizer: keras.optimizers.Optimizer,
        grads: Iterable[Any],
        variables: Iterable[Any],
        loss: Any = None,
        update: bool | None = None,
    ) -> tf.Tensor:
        """Unscales the gradients of a scaled loss and applies them, unless
        one is not finite (PyTorch's `GradScaler.step(optimizer)`).

        Step 2 of 2 in your own training step, after `scale`:

            with tf.GradientTape() as tape:
                loss = ...
                scaled_loss = loss_scale.scale(loss)
            grads = tape.gradient(scaled_loss, variables)
            loss_scale.step(optimizer, grads, variables, loss=loss)

        Args and Returns: as for `apply_gradients`, with `grads` the
        gradients of the scaled loss.
        """
        variables = list(variables)
        return self.apply_gradients(
            optimizer, self._unscale(grads, variables), variables, loss=loss, update=update
        )

    def _plain_optimizer(self, optimizer: Any) -> Any:
        """The optimizer that applies the gradients: never one that would
        unscale them again."""
        from mp_callbacks.loss_scale_optimizer import LossScaleOptimizer

        if isinstance(optimizer, LossScaleOptimizer):
            if optimizer.scaler is not self:
                self._warn_once(optimizer, (
                    f"DynamicLossScale.apply_gradients got a LossScaleOptimizer with its own loss "
                    f"scale ({optimizer.scaler!r}); this one decides the step and its "
                    "inner optimizer applies it, so that scale does not move."
                ))
            optimizer = optimizer.inner_optimizer
        elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            self._warn_once(optimizer, (
                "DynamicLossScale.apply_gradients got Keras's LossScaleOptimizer, which "
                "compile() puts around the optimizer under mixed_float16 and which would "
                "unscale these gradients a second time. Its inner optimizer applies them "
                "instead. Compile with auto_scale_loss=False (or use MixedPrecisionModel) "
                "to pass the optimizer itself."
            ))
            optimizer = optimizer.inner_optimizer
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            fail(_OWNER, "optimizer", optimizer, "a Keras optimizer", TypeError)
        factor = getattr(optimizer, "loss_scale_factor", None)
        if factor is not None:
            self._warn_once(optimizer, (
                f"DynamicLossScale.apply_gradients: the optimizer's loss_scale_factor={factor!r} "
                "is cleared: the gradients are unscaled by this DynamicLossScale, and Keras "
                "would divide them by the factor again."
            ))
            optimizer.loss_scale_factor = None
        return optimizer

    def _warn_once(self, about: Any, message: str) -> None:
        if id(about) not in self._warned_optimizers:
            self._warned_optimizers.add(id(about))
            warnings.warn(message, MixedPrecisionWarning, stacklevel=4)

    @_no_autograph
    def update(self) -> None:
        """Advances the state machine once for the steps of several
        optimizers made with `apply_gradients(..., update=False)`.

        The step counts as overflowing (skipped, backing off) if any of
        those optimizers' gradients were non-finite, and as divergent if
        any loss was non-finite. Call it in the same `tf.function` as those
        calls, once per training step (a `MixedPrecisionModel` calls it at
        the end of its training steps).
        """
        if not self._pending:
            raise RuntimeError(
                "DynamicLossScale.update() was called without a pending step: call "
                "apply_gradients(optimizer, grads, variables, update=False) for each "
                "optimizer first, then update() once."
            )
        pending = self._pending
        _per_thread("pending")[id(self)] = []
        if len(pending) == 1 and pending[0][2] is not None:
            # One apply without a strategy: its decision is the step's.
            variables, flags, decision = pending[0]
            self._update_state(self._full_flags(variables, flags), decision)
            return
        position = {id(v): i for i, v in enumerate(self._built.items)}
        per_variable = [tf.constant(0, tf.int64)] * len(position)
        loss_flags = []
        for variables, flags, _ in pending:
            for i, variable in enumerate(variables):
                per_variable[position[id(variable)]] = tf.maximum(
                    per_variable[position[id(variable)]], flags[i]
                )
            loss_flags.append(flags[-1])
        combined = tf.stack(per_variable + [tf.reduce_max(tf.stack(loss_flags))])
        replica_context = tf.distribute.get_replica_context()
        if (
            replica_context is None
            or not tf.distribute.has_strategy()
            or tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            self._update_state(combined)
        else:
            replica_context.merge_call(
                lambda distribution, flags: self._update_state(
                    distribution.experimental_local_results(flags)[0]
                ),
                args=(combined,),
            )

    @_no_autograph
    def _full_flags(self, variables: list[Any], flags: tf.Tensor) -> tf.Tensor:
        """`flags` (one per variable, then the loss) laid out over every
        built variable, when the step covered only some of them."""
        if len(variables) == len(self._built.items) and all(
            a is b for a, b in zip(variables, self._built.items)
        ):
            return flags
        position = {id(v): i for i, v in enumerate(variables)}
        zero = tf.constant(0, tf.int64)
        return tf.stack(
            [flags[position[id(v)]] if id(v) in position else zero for v in self._built.items]
            + [flags[-1]]
        )

    @staticmethod
    def _apply(optimizer, grads, variables):
        # apply_gradients rather than apply: an optimizer subclass that
        # overrides apply_gradients is honoured (Keras's calls apply).
        optimizer.apply_gradients(list(zip(grads, variables)))

    @staticmethod
    def _restore(variables, values):
        for variable, value in zip(variables, values):
            variable.assign(value)

    @_no_autograph
    def _restore_if_skipped(self, applied: tf.Tensor, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Assigns each `(variable, value)` back when `applied` is False."""
        variables = [variable for variable, _ in pairs]
        values = [value for _, value in pairs]
        replica_context = tf.distribute.get_replica_context()
        if (
            replica_context is None
            or not tf.distribute.has_strategy()
            or tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            tf.cond(applied, lambda: None, lambda: self._restore(variables, values))
            return

        # As in apply_gradients: a cond that writes replicated state is
        # taken in cross-replica context.
        def restore(distribution, applied, values):
            applied = distribution.experimental_local_results(applied)[0]

            def on_every_replica():
                distribution.extended.call_for_each_replica(self._restore, args=(variables, values))

            tf.cond(applied, lambda: None, on_every_replica)

        replica_context.merge_call(restore, args=(applied, values))

    @_no_autograph
    def _update_state(self, flags: tf.Tensor, grads_finite: tf.Tensor | None = None) -> None:
        """Advances the state machine; `flags` are already all-reduced.
        `grads_finite`, when given, is the decision the step took (all of
        `flags[:-1]` zero), passed in so as not to be derived again.

        Each variable's next value is worked out for both outcomes from the
        state and the loss alone, and the decision only picks one (a
        `tf.where` per write), so that little waits on the decision, which
        comes late in the step (after the last gradient's check). Measured
        on a two-thread Transformer, this is no cheaper than deriving the
        values after the decision, and no dearer.
        """
        state = self._state
        per_variable = tf.minimum(flags[:-1], 1)
        if grads_finite is None:
            grads_finite = tf.equal(tf.reduce_sum(per_variable), 0)
        loss_diverged = tf.not_equal(flags[-1], 0)
        scale = state["scale"].read_value()
        # A scale that is not a positive finite number (written into the
        # variable by hand) could never recover: start again from initial.
        scale = tf.where(
            tf.logical_and(tf.math.is_finite(scale), scale > 0.0),
            scale,
            tf.constant(self.initial_scale, tf.float32),
        )
        zero = tf.constant(0, tf.int64)

        # Finite gradients: one more good step; after growth_interval of
        # them the scale grows and the hysteresis is restored.
        good = state["good_steps"] + 1
        grow = good >= self.growth_interval
        hysteresis_left = state["hysteresis_left"].read_value()
        if_finite = {
            "scale": tf.where(grow, tf.minimum(scale * self.growth_factor, self.max_scale), scale),
            "good_steps": tf.where(grow, zero, good),
            "hysteresis_left": tf.where(
                grow, tf.constant(self.hysteresis, tf.int64), hysteresis_left
            ),
            "skipped": zero,
            "divergent": loss_diverged,
        }
        # An overflow: the streak ends, the hysteresis is spent, and once it
        # is gone the scale backs off. At the floor, an overflow is divergence.
        spent = tf.maximum(hysteresis_left - 1, 0)
        if_overflow = {
            "scale": tf.where(
                spent <= 0, tf.maximum(scale * self.backoff_factor, self.min_scale), scale
            ),
            "good_steps": zero,
            "hysteresis_left": spent,
            "skipped": tf.constant(1, tf.int64),
            "divergent": tf.logical_or(loss_diverged, scale <= self.min_scale),
        }
        # Overflows before any step was applied, with a finite loss and room
        # to back off: a dynamic scale finding its level from initial_scale,
        # which every dynamic scaler does at first (not bad data).
        if self.is_dynamic:
            if_overflow["calibration"] = tf.cast(tf.logical_and(
                tf.equal(state["step_count"], state["skipped_steps"]),
                tf.logical_and(tf.logical_not(loss_diverged), scale > self.min_scale),
            ), tf.int64)
        lowest = state["lowest_scale"].read_value()
        run = state["divergent_run"].read_value()
        max_run = state["max_divergent_run"].read_value()
        for outcome in (if_finite, if_overflow):
            outcome["lowest_scale"] = tf.minimum(lowest, outcome["scale"])
            outcome["divergent_run"] = tf.where(outcome["divergent"], run + 1, 0)
            outcome["max_divergent_run"] = tf.maximum(max_run, outcome["divergent_run"])
            outcome["divergent"] = tf.cast(outcome["divergent"], tf.int64)

        def taken(name: str) -> tf.Tensor:
            return tf.where(grads_finite, if_finite[name], if_overflow[name])

        for name in ("scale", "lowest_scale", "good_steps", "hysteresis_left",
                     "divergent_run", "max_divergent_run"):
            state[name].assign(taken(name))
        state["step_count"].assign_add(1)
        state["skipped_steps"].assign_add(taken("skipped"))
        state["nonfinite_loss_steps"].assign_add(tf.cast(loss_diverged, tf.int64))
        state["divergent_steps"].assign_add(taken("divergent"))
        if self.is_dynamic:
            state["calibration_steps"].assign_add(tf.where(grads_finite, zero, if_overflow["calibration"]))
        self._nonfinite_counts.assign_add(per_variable)

    # ------------------------------------------------------ host-side reads
    def get_scale(self) -> float:
        """The current scale as a Python float (reads from the device)."""
        return float(self._scale.numpy())

    def diagnostics(self) -> dict[str, Any]:
        """The state as Python numbers, in one host read.

        Keys are the names in `STATE_VARIABLES`: `scale` and `lowest_scale`
        (floats; `lowest_scale` is None when no step was taken since
        `reset_lowest_scale()`), and the counters `good_steps`, `hysteresis_left`,
        `step_count`, `skipped_steps` (total skipped), `nonfinite_loss_steps`,
        `divergent_steps` (a non-finite loss, or a skipped step with the scale
        at `min_scale`), `divergent_run` (current run of consecutive divergent
        steps), `max_divergent_run` (longest run since the last
        `reset_divergence_latches`) and `calibration_steps` (skipped steps
        before the first applied one, while a dynamic scale comes down from
        `initial_scale`).
        """
        names = [spec.name for spec in STATE_VARIABLES]
        # One device-to-host transfer; float64 holds the counters exactly
        # up to 2**53, far beyond any training run.
        values = tf.stack(
            [tf.cast(self._state[name], tf.float64) for name in names]
        ).numpy()
        state: dict[str, float | int | None] = {
            name: int(value) if name in _COUNTERS else float(value)
            for name, value in zip(names, values)
        }
        if state["lowest_scale"] == FLOAT32_MAX:
            state["lowest_scale"] = None  # no step since reset_lowest_scale()
        return state

    def reset_divergence_latches(self) -> None:
        """Forgets earlier divergence: the current and the longest divergent
        run restart from 0. A new `fit` starts from here, so that a run that
        diverged earlier is not reported again on clean data."""
        self._state["divergent_run"].assign(0)
        self._state["max_divergent_run"].assign(0)

    def reset_max_divergent_run(self) -> None:
        """Restarts the `max_divergent_run` latch from the current run."""
        self._state["max_divergent_run"].assign(self._state["divergent_run"])

    def reset_lowest_scale(self) -> None:
        """Restarts the `lowest_scale` latch: it then holds the lowest scale
        that a step reaches from here on (float32's maximum until one does),
        so a collapse before the reset is not reported again."""
        self._state["lowest_scale"].assign(FLOAT32_MAX)

    def nonfinite_gradient_counts(self) -> dict[str, int]:
        """Steps with a non-finite gradient, per variable path, in order.

        The order is that of the variables passed to `build` (for a model,
        its trainable variables: forward order for functional models).
        """
        if not self.built:
            return {}
        counts = self._nonfinite_counts.numpy().tolist()
        return dict(zip(self._variable_paths, (int(c) for c in counts)))

    # ------------------------------------------------------- save / restore
    def _state_variables(self) -> dict[str, tf.Variable]:
        state = dict(self._state)
        if self.built:
            state["nonfinite_counts"] = self._nonfinite_counts
        return state

    def get_state(self) -> dict[str, Any]:
        """The state as NumPy values, keyed by the names in `STATE_VARIABLES`
        (plus `nonfinite_counts` once built)."""
        return {k: v.numpy() for k, v in self._state_variables().items()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a state from `get_state` (or a weights file).

        Restores state, not hyperparameters. Unknown keys, and per-variable
        counts of another shape, are ignored (a state saved before `build`
        still restores the scale). A scale that is not a finite number > 0,
        or a negative counter, is refused with a ValueError and nothing is
        changed: a loss scale restored as NaN, inf, 0 or negative could never
        recover.
        """
        state = {_LEGACY_NAMES.get(k, k): v for k, v in state.items()}
        updates = []
        for key, variable in self._state_variables().items():
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
            updates.append((variable, tf.convert_to_tensor(value, variable.dtype)))
        for variable, value in updates:
            variable.assign(value)


AUTO = "auto"


def loss_scale_from_argument(value: Any, owner: str = "MixedPrecisionModel") -> DynamicLossScale | None:
    """Turns a `loss_scale` argument into a DynamicLossScale.

    Accepts "auto" (returns None: the model decides at compile), None (no
    scaling), a DynamicLossScale, its config dict, or a number in
    [2**-24, 2**64] (a fixed scale); anything else raises naming `loss_scale` and `owner`."""
    requirement = (
        "'auto', a DynamicLossScale, a number in [2**-24, 2**64] (fixed scale) or None "
        "(no scaling)"
    )
    if isinstance(value, str):
        if value != AUTO:
            fail(owner, "loss_scale", value, requirement)
        return None
    if value is None:
        return DynamicLossScale.disabled()
    if isinstance(value, DynamicLossScale):
        return value
    if isinstance(value, dict) and value:
        return keras.saving.deserialize_keras_object(value)
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return DynamicLossScale.fixed(check_fixed_scale(owner, "loss_scale", value))
    fail(owner, "loss_scale", value, requirement, TypeError)
