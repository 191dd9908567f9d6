"""The loss-scaled step on JAX, as pure functions of the state.

JAX's step is stateless: every variable comes in as a value and the new
value goes out. A skipped step therefore only has to return what came in
instead of what the update computed, chosen on the device with no host
read: each write of the optimizer's update gated where it is made
(`apply_if_finite`), and one conditional over the rest of the state
(`keep_if_skipped`).
The same functions serve `MixedPrecisionModel` and a `train_step` of your
own (two optimizers of a GAN share one scale and one decision).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from mp_callbacks import _scale_state
from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import optimizer_built_variables, recording_stateless_scope
from mp_callbacks.backends.common.step import StepOutcome, check, finished_state, scale_loss, unscale

__all__ = [
    "LossScaling",
    "StepOutcome",
    "apply_if_finite",
    "check",
    "keep_if_skipped",
    "next_scale_state",
    "scale_loss",
    "unscale",
]

ops = keras.ops
#: The logs' entries a watched hand-over adds (the decision, the step's
#: number), for the model's train function alone.
WATCH_KEYS = ("_mp_applied", "_mp_step")


def keep_if_skipped(applied: Any, new: Any, old: Any) -> Any:
    """`new` where the step applies, `old` (what came in) where it is
    skipped: any structure of arrays (lists, tuples of lists), as one
    conditional. Both sides are computed before it, as stock Keras computes
    them: an elementwise select fused into the update lets XLA contract
    BatchNormalization's statistics differently (an ulp off stock in
    float32)."""
    return jax.lax.cond(applied, lambda: new, lambda: old)


#: Keras's optimizers whose update XLA rounds as stock's when each write is
#: gated (`apply_if_finite`), checked by the optimizer sweep of the JAX
#: tests. Lion's and Adafactor's are not: XLA:CPU contracts their
#: `m * b + g * (1 - b)` into a fused multiply-add the other way once a
#: select on `m` follows, an ulp off stock.
GATED_WRITES_EXACT = frozenset(
    {
        "Adadelta",
        "Adagrad",
        "Adam",
        "AdamW",
        "Adamax",
        "Ftrl",
        "Lamb",
        "Muon",
        "Nadam",
        "RMSprop",
        "SGD",
        "ScheduleFreeAdamW",
    }
)


def gates_writes_exactly(optimizer: Any) -> bool:
    """Whether `apply_if_finite` gates `optimizer`'s writes one by one: one
    of Keras's own optimizer classes in `GATED_WRITES_EXACT` (not a
    subclass, whose update may differ), without EMA (whose averages round
    differently gated, as Lion's momentum does)."""
    cls = type(optimizer)
    return (
        cls.__name__ in GATED_WRITES_EXACT
        and getattr(keras.optimizers, cls.__name__, None) is cls
        and not getattr(optimizer, "use_ema", False)
    )


def apply_if_finite(
    applied: Any,
    optimizer: Any,
    optimizer_vars: Sequence[Any],
    grads: Sequence[Any],
    trainable: Sequence[Any],
    gate_writes: bool = True,
) -> tuple[list[Any], list[Any]]:
    """`optimizer.stateless_apply(optimizer_vars, grads, trainable)` where
    `applied`, else `(trainable, optimizer_vars)` as they came in.

    For Keras's common optimizers each write of the update is gated where it
    is made: `where(applied, new, old)`, fused into the write, so each weight
    and slot is read and written once, as stock Keras writes it (Keras's
    `LossScaleOptimizer` runs the update in a conditional instead, which
    keeps it from fusing with the gradients' last ops: an ulp off stock).
    Any other optimizer updates as stock does and one conditional chooses
    after it: exact for every update, at the price of copying the weights
    and slots. That is the reference path, which `gate_writes=False` takes for
    every optimizer.
    """
    optimizer_vars, grads, trainable = list(optimizer_vars), list(grads), list(trainable)
    weights = optimizer_built_variables(optimizer)
    fits = len(trainable) == len(weights) and len(optimizer_vars) == len(optimizer.variables)
    if not (gate_writes and gates_writes_exactly(optimizer) and optimizer.built and fits):
        # (stateless_apply also raises Keras's own error for state that does not fit)
        new_trainable, new_optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
        return keep_if_skipped(
            applied, (list(new_trainable), list(new_optimizer_vars)), (trainable, optimizer_vars)
        )
    mapping = list(zip(weights, trainable)) + list(zip(optimizer.variables, optimizer_vars))
    before = {id(variable): value for variable, value in mapping}

    def gated(variable: Any, value: Any) -> Any:
        # Against the value the step came in with, however often the
        # update writes the variable.
        return jax.numpy.where(applied, value, before[id(variable)])

    with recording_stateless_scope(mapping, gated) as scope:
        optimizer.apply(grads)
    return (
        [scope.get_current_value(v) for v in weights],
        [scope.get_current_value(v) for v in optimizer.variables],
    )


def next_scale_state(
    settings: _scale_state.ScaleSettings, state: dict[str, Any], outcome: StepOutcome
) -> dict[str, Any]:
    """The loss scale's state after the step (`_scale_state.transition`,
    the one state machine every backend runs)."""
    return _scale_state.transition(settings, state, outcome.flags, outcome.applied)


class LossScaling:
    """The loss scale inside one stateless JAX step of a
    `MixedPrecisionModel`: its own step, or a `train_step` of yours
    (`model.loss_scaling(non_trainable_variables)`).

    Scale each loss inside the function you differentiate, unscale its
    gradients, check all of the step's gradients once, `apply_if_finite`
    each optimizer, `commit` the forward pass's writes, and finish: the
    scale's next state goes back into the non-trainable variables, and the
    figures into the logs. Two
    optimizers (a GAN's) share the one scale and the one decision.
    """

    def __init__(
        self,
        settings: _scale_state.ScaleSettings,
        positions: dict[str, int],
        non_trainable: Any,
        watched: bool = False,
        fast: bool = True,
    ) -> None:
        self._settings = settings
        #: Gated writes (False: the reference update, chosen after it).
        self._fast = fast
        self._at = positions
        #: Whether the model's train function watches the step's logs for
        #: the hand-over (`WATCH_KEYS`) instead of a host callback.
        self._watched = watched
        self._hand_over: dict[str, Any] = {}
        #: The scale this step multiplies by (a float32 scalar).
        self.value = non_trainable[positions["scale"]]
        #: False for a fixed scale of 1: nothing is multiplied.
        self.active = settings.is_dynamic or settings.initial_scale != 1.0

    def scale(self, loss: Any) -> Any:
        """The loss to differentiate: times the scale, in float32."""
        return scale_loss(loss, self.value) if self.active else loss

    def unscale(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        """The gradients of a scaled loss, divided by the scale once; those
        of float8 state among `variables` (the variables the gradients are
        for, in order) pass as they are (`mp_callbacks._unscale`)."""
        return unscale(grads, self.value, variables) if self.active else list(grads)

    def check(self, grads: Sequence[Any], losses: Any, variables: Sequence[Any] | None = None) -> StepOutcome:
        """The step's one decision, over all its (unscaled) gradients and
        its loss or losses: applied only if every one is finite (the norm
        leaves out float8 state among `variables`)."""
        return check(grads, losses, variables)

    def commit(self, outcome: StepOutcome, new: Any, old: Any) -> Any:
        """`new` (what the forward pass wrote: `stateless_call`'s
        non-trainable values, or any other state the step computed) if the
        step applies, else `old` (the state that came in)."""
        return keep_if_skipped(outcome.applied, new, old)

    def apply_if_finite(
        self,
        outcome: StepOutcome,
        optimizer: Any,
        optimizer_vars: Sequence[Any],
        grads: Sequence[Any],
        trainable: Sequence[Any],
    ) -> tuple[list[Any], list[Any]]:
        """`optimizer.stateless_apply(optimizer_vars, grads, trainable)`
        where the step applies, the trainable and optimizer values that came
        in where it is skipped (see `apply_if_finite`: for Keras's common
        optimizers it costs what the update alone costs)."""
        return apply_if_finite(outcome.applied, optimizer, optimizer_vars, grads, trainable, self._fast)

    def hand_over_if_skipped(
        self, outcome: StepOutcome, non_trainable: Sequence[Any], batch: Any, receive: Any
    ) -> None:
        """Calls `receive(batch, step)` on the host where the step is
        skipped, `step` being the 0-based number of the step.

        Under `fit`, `evaluate`'s sibling `train_on_batch` and one step per
        execution, the model's train function does it: `finish` puts the
        decision and the step's number in the logs (`WATCH_KEYS`, taken out
        before any callback sees them) and the train function keeps the
        batch it passed in once that step is done and skipped, reading
        nothing before. Elsewhere, a host callback in the branch only
        skipped steps take does it; XLA:CPU runs a step that holds any host
        callback 3-8 % slower (a Transformer and ResNet50, 2026-12-04, Intel
        Xeon), taken or not."""
        step = non_trainable[self._at["step_count"]]
        # (the watching train function keeps into the model's own kept batch)
        if self._watched and getattr(receive, "__name__", None) == "keep_skipped_batch":
            self._hand_over = {WATCH_KEYS[0]: outcome.applied, WATCH_KEYS[1]: step}
            return
        jax.lax.cond(outcome.applied, lambda: None, lambda: jax.debug.callback(receive, batch, step))

    def finish(
        self, outcome: StepOutcome, non_trainable: Sequence[Any], batch_size: int
    ) -> tuple[list[Any], dict[str, Any]]:
        """The non-trainable values with the scale's next state and this
        epoch's figures in them, and the logs' `loss_scale`, `grad_norm`
        and `skipped_steps`."""
        values = list(non_trainable)
        after, logs = finished_state(
            self._settings, {name: values[at] for name, at in self._at.items()}, outcome, batch_size
        )
        for name, value in after.items():
            values[self._at[name]] = value
        return values, {**logs, **self._hand_over}
