"""The loss-scaled step on TensorFlow: check once, decide once, apply or
skip, update the scale's state.

`apply_unscaled` is the one path by which every apply of a `LossScaler`
reaches the decision (its `apply_gradients` and `step`, the model's own
step, mp_callbacks' `LossScaleOptimizer`). It reads top to bottom: the
gradients are checked in one pass (`_gradient_check`), their flags
all-reduced across replicas, the decision taken, the update applied or
skipped (`skip.apply_or_skip`: gated writes, or a `tf.cond`), and the
state machine (`_scale_state.transition`) advanced once, now or at the
`update()` that ends a step of several optimizers.

A training step that a `MixedPrecisionModel` records (`recording`) defers
the state update to its end (`finish_step`). The record and the pending
applies are held by the scaler (`step_record.StepTraces`), per thread:
MirroredStrategy traces each replica's step in a thread of its own.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from mp_callbacks import _scale_state
from mp_callbacks._backend import keras, tf
from mp_callbacks._gradient_check import (
    CheckedGradients,
    applied_norm,
    check_gradients,
    decision,
    nonfinite_flag,
)
from mp_callbacks._keras_internals import strategy_supports_no_merge_call
from mp_callbacks._validation import fail
from mp_callbacks.backends.tensorflow import skip
from mp_callbacks.backends.tensorflow.skip import apply_or_skip
from mp_callbacks.backends.tensorflow.step_record import StepRecord
from mp_callbacks.errors import MixedPrecisionWarning

__all__ = [
    "apply_unscaled",
    "finish_step",
    "pending_of",
    "plain_optimizer",
    "record_of",
    "recording",
    "restore_if_skipped",
    "update",
    "update_state",
]

# The hot path branches only on Python values; AutoGraph has nothing to
# convert there, and some TensorFlow releases mis-convert it.
_no_autograph = tf.autograph.experimental.do_not_convert
_OWNER = "LossScaler"

#: One apply awaiting the state update: its variables, its flags (one per
#: variable, then the loss), and its decision when it took no all-reduce.
Entry = tuple[list[Any], Any, Any]


# ------------------------------------------------------------ step records
def record_of(scaler: Any) -> StepRecord | None:
    """The training step being traced, when a MixedPrecisionModel records it."""
    return scaler._traces.record()


def pending_of(scaler: Any) -> list[Entry]:
    """Applies of the graph being traced awaiting one `update()`."""
    return scaler._traces.this_thread().pending


@contextlib.contextmanager
def recording(scaler: Any) -> Iterator[StepRecord]:
    """Records one training step (see `step_record`): while open, applies
    defer the state update to `finish_step`."""
    trace = scaler._traces.this_thread()
    outer = trace.record
    trace.record = record = StepRecord()
    try:
        yield record
    finally:
        trace.record = outer
        if outer is None:
            # A step that raised (a bug in its metric code, Ctrl-C) left
            # its applies pending: nothing of it may reach the next step.
            scaler._traces.end_step()


def finish_step(scaler: Any, record: StepRecord) -> None:
    """Advances the state machine once for the recorded step's applies."""
    if pending_of(scaler):
        update(scaler)
    scaler._scaling_seen = record.loss_scaled


# ------------------------------------------------------------- the step
@_no_autograph
def apply_unscaled(
    scaler: Any,
    optimizer: Any,
    grads: Iterable[Any],
    variables: Iterable[Any],
    loss: Any = None,
    restore_on_skip: Sequence[tuple[Any, Any]] = (),
    update_now: bool | None = None,
    checked: CheckedGradients | None = None,
) -> Any:
    """Applies unscaled `grads` to `variables` with `optimizer` if every
    one (and `loss`) is finite, else skips; advances the state now or, with
    `update_now=False` (the default inside a recorded step), at `update`.
    Returns the decision (a boolean scalar tensor). The arguments are
    `LossScaler.apply_gradients`'s."""
    grads = list(grads)
    variables = list(variables)
    if len(grads) != len(variables):
        raise ValueError(
            f"LossScaler.apply_gradients: got {len(grads)} gradients for {len(variables)} variables."
        )
    optimizer = plain_optimizer(scaler, optimizer)
    record = record_of(scaler)
    if loss is None and record is not None and record.losses:
        loss = list(record.losses)
    if update_now is None:
        update_now = record is None
    known = {id(v) for v in scaler._built.items}
    scaler.build(scaler._built.items + [v for v in variables if id(v) not in known])
    if not optimizer.built:
        optimizer.build(variables)

    # Check once.
    if checked is None:
        checked = check_gradients(grads)
    loss_flag = nonfinite_flag(loss)
    flags = tf.concat([checked.flags, [loss_flag]], axis=0)
    # Decide once, for every replica.
    replica_context = tf.distribute.get_replica_context()
    if replica_context is None:
        raise RuntimeError(
            "LossScaler.apply_gradients must run in a replica context: call it inside `strategy.run(...)`."
        )
    replicas = replica_context.num_replicas_in_sync
    if replicas > 1:
        # One global decision: every replica sees every replica's flags.
        flags = replica_context.all_reduce(tf.distribute.ReduceOp.SUM, flags)
    applied = decision(checked, flags, replicas)
    if record is not None:
        record.note_apply(applied, applied_norm(checked, grads, variables))
    # Apply or skip.
    apply_or_skip(
        optimizer,
        grads,
        variables,
        applied,
        restore_on_skip=restore_on_skip,
        # Computed from the loss, so whatever waits for it comes after
        # every read of the forward pass.
        forward_done=None if loss is None else tf.equal(loss_flag, 0),
        mechanism="cond" if record is not None and record.reference else None,
    )
    # Update the state, now or at the step's end.
    entry = (variables, flags, applied if replicas == 1 else None)
    if update_now:
        _advance(scaler, [entry])
        scaler._traces.end_step()  # the step ends here
    else:
        pending_of(scaler).append(entry)
    return applied


@_no_autograph
def restore_if_skipped(applied: Any, pairs: Sequence[tuple[Any, Any]]) -> None:
    """Assigns each `(variable, value)` back when `applied` is False: the
    forward pass's state of a step of your own (`skip.restore_if_skipped`)."""
    skip.restore_if_skipped(applied, pairs)


def plain_optimizer(scaler: Any, optimizer: Any) -> Any:
    """The optimizer that applies the gradients: never one that would
    unscale them again."""
    # mp_callbacks' LossScaleOptimizer is the Keras one that holds a
    # LossScaler (told apart so, not by importing it: it imports this).
    ours = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and isinstance(
        getattr(optimizer, "scaler", None), type(scaler)
    )
    if ours:
        if optimizer.scaler is not scaler:
            _warn_once(
                scaler,
                optimizer,
                (
                    f"LossScaler.apply_gradients got a LossScaleOptimizer with its own loss "
                    f"scale ({optimizer.scaler!r}); this one decides the step and its "
                    "inner optimizer applies it, so that scale does not move."
                ),
            )
        optimizer = optimizer.inner_optimizer
    elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        _warn_once(
            scaler,
            optimizer,
            (
                "LossScaler.apply_gradients got Keras's LossScaleOptimizer, which "
                "compile() puts around the optimizer under mixed_float16 and which would "
                "unscale these gradients a second time. Its inner optimizer applies them "
                "instead. Compile with auto_scale_loss=False (or use MixedPrecisionModel) "
                "to pass the optimizer itself."
            ),
        )
        optimizer = optimizer.inner_optimizer
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        fail(_OWNER, "optimizer", optimizer, "a Keras optimizer", TypeError)
    factor = getattr(optimizer, "loss_scale_factor", None)
    if factor is not None:
        _warn_once(
            scaler,
            optimizer,
            (
                f"LossScaler.apply_gradients: the optimizer's loss_scale_factor={factor!r} "
                "is cleared: the gradients are unscaled by this LossScaler, and Keras "
                "would divide them by the factor again."
            ),
        )
        optimizer.loss_scale_factor = None
    return optimizer


def _warn_once(scaler: Any, about: Any, message: str) -> None:
    if id(about) not in scaler._warned_optimizers:
        scaler._warned_optimizers.add(id(about))
        warnings.warn(message, MixedPrecisionWarning, stacklevel=4)


# ------------------------------------------------------------ the state
@_no_autograph
def update(scaler: Any) -> None:
    """One state update for the pending applies of several optimizers
    (`LossScaler.update`)."""
    pending = pending_of(scaler)
    if not pending:
        raise RuntimeError(
            "LossScaler.update() was called without a pending step: call "
            "apply_gradients(optimizer, grads, variables, update=False) for each "
            "optimizer first, then update() once."
        )
    entries = list(pending)
    pending.clear()
    _advance(scaler, entries)
    scaler._traces.end_step()


def _advance(scaler: Any, entries: list[Entry]) -> None:
    """One transition for a step made of `entries`."""
    if len(entries) == 1:
        variables, flags, applied = entries[0]
        flags = _full_flags(scaler, variables, flags)
    else:
        flags, applied = _combined_flags(scaler, entries), None
    replica_context = tf.distribute.get_replica_context()
    if replica_context is None or not tf.distribute.has_strategy() or strategy_supports_no_merge_call():
        update_state(scaler, flags, applied)
        return
    replica_context.merge_call(
        lambda distribution, flags: update_state(scaler, distribution.experimental_local_results(flags)[0]),
        args=(flags,),
    )


def _combined_flags(scaler: Any, entries: list[Entry]) -> Any:
    """One flag per built variable (the worst over the entries), then the
    worst loss flag."""
    position = {id(v): i for i, v in enumerate(scaler._built.items)}
    per_variable = [tf.constant(0, tf.int64)] * len(position)
    for variables, flags, _ in entries:
        for i, variable in enumerate(variables):
            per_variable[position[id(variable)]] = tf.maximum(per_variable[position[id(variable)]], flags[i])
    loss_flags = [flags[-1] for _, flags, _ in entries]
    return tf.stack(per_variable + [tf.reduce_max(tf.stack(loss_flags))])


def _full_flags(scaler: Any, variables: list[Any], flags: Any) -> Any:
    """`flags` (one per variable, then the loss) laid out over every built
    variable, when the step covered only some of them."""
    built = scaler._built.items
    if len(variables) == len(built) and all(a is b for a, b in zip(variables, built)):
        return flags
    position = {id(v): i for i, v in enumerate(variables)}
    zero = tf.constant(0, tf.int64)
    return tf.stack([flags[position[id(v)]] if id(v) in position else zero for v in built] + [flags[-1]])


@_no_autograph
def update_state(scaler: Any, flags: Any, applied: Any = None) -> None:
    """One transition of the state machine (`_scale_state.transition`) on
    `scaler`'s variables; `flags` are all-reduced, and `applied` is the
    step's decision (taken from the flags when not given)."""
    if applied is None:
        applied = decision(None, flags)
    before = {name: variable.read_value() for name, variable in scaler._state.items()}
    after = _scale_state.transition(scaler._settings, before, flags, applied)
    for name, variable in scaler._state.items():
        variable.assign(after[name])
    assert scaler._nonfinite_counts is not None  # built by apply_unscaled
    scaler._nonfinite_counts.assign_add(after["nonfinite_counts"])
