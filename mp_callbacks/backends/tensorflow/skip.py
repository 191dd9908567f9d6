"""How a step's update is applied or skipped: the one place that chooses.

Contract of `apply_or_skip`: when `decision` is True the optimizer applies
the gradients, exactly as `optimizer.apply_gradients` would; when it is
False nothing the optimizer owns changes (weights, slots, iteration count)
and each `restore_on_skip` pair is assigned back. Four mechanisms keep it:

* ``"compiled"``: the update and its cond compiled by XLA as one call
  (`mp_callbacks.backends.tensorflow.compiled_update`), for the optimizers
  whose compiled update equals TensorFlow's bit for bit. It reads and
  writes each variable and slot about once, under half of TensorFlow's
  op-by-op traffic for Adam, which pays for the wait for the decision
  (docs/design.md, "The update compiled by XLA"). Graph mode without a
  strategy or XLA.
* ``"cond"``, the reference: the update inside `tf.cond(decision, ...)`,
  as Keras's own `LossScaleOptimizer` does it. Used eagerly (where a cond is
  a Python `if`), under XLA (`jit_compile=True`, Keras's default on a GPU),
  for an update that cannot be gated, and under a strategy that needs no
  `merge_call`.
* ``"gated"``: for any other update, no cond; the update runs and each
  write it makes is gated on the decision
  (`mp_callbacks.backends.tensorflow.gated_update`), so healthy steps do not
  wait behind the cond (`benchmarks/skip_mechanics.py` measures the cond's
  cost). Graph mode without a strategy or XLA. Tested bit for bit against
  "cond". XLA compiles a cond's branch into the step and fuses the update
  there, where the gated writes measured 1 to 2 points slower
  (docs/design.md, "Under XLA").
* ``"cross_replica"``: under a strategy whose optimizer update
  `merge_call`s, the cond is taken in cross-replica context, since a cond
  whose branch `merge_call`s cannot run in a replica context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mp_callbacks._backend import tf
from mp_callbacks._keras_internals import compiling_with_xla, strategy_supports_no_merge_call
from mp_callbacks.backends.tensorflow.compiled_update import compiled_apply
from mp_callbacks.backends.tensorflow.gated_update import gated_apply, gradients_after

__all__ = ["MECHANISMS", "apply_or_skip", "restore_if_skipped"]

MECHANISMS = ("compiled", "gated", "cond", "cross_replica")


def _apply(optimizer: Any, grads: list[Any], variables: list[Any]) -> None:
    # apply_gradients rather than apply: an optimizer subclass that
    # overrides apply_gradients is honoured (Keras's calls apply).
    optimizer.apply_gradients(list(zip(grads, variables)))


def _assign(variables: Sequence[Any], values: Sequence[Any]) -> None:
    for variable, value in zip(variables, values):
        variable.assign(value)


def _needs_merge_call() -> bool:
    return tf.distribute.has_strategy() and not strategy_supports_no_merge_call()


def apply_or_skip(
    optimizer: Any,
    grads: list[Any],
    variables: list[Any],
    decision: tf.Tensor,
    restore_on_skip: Sequence[tuple[Any, Any]] = (),
    forward_done: tf.Tensor | None = None,
    mechanism: str | None = None,
) -> str:
    """Applies `grads` to `variables` with `optimizer` where `decision` is
    True, else skips and restores; returns the mechanism used.

    Args:
        optimizer: a Keras optimizer (not a loss-scale wrapper).
        grads, variables: unscaled gradients and their variables.
        decision: boolean scalar, the step's decision.
        restore_on_skip: `(variable, value)` pairs assigned on a skip.
        forward_done: a boolean scalar computed from the loss, which lets a
            gated sparse write go ahead without waiting for `decision`.
        mechanism: force one of `MECHANISMS` (tests compare them); default
            None chooses: "cross_replica" under a `merge_call` strategy,
            "cond" under XLA, else "compiled" when the update is one XLA
            reproduces exactly, else "gated" when it can be gated, else
            "cond". A forced form that does not apply falls back in that
            order.
    """
    restore_on_skip = list(restore_on_skip)
    restore_variables = [variable for variable, _ in restore_on_skip]
    restore_values = [value for _, value in restore_on_skip]
    if mechanism is None:
        if _needs_merge_call():
            mechanism = "cross_replica"
        else:
            mechanism = "cond" if compiling_with_xla() else "compiled"
    if mechanism == "compiled":
        if not tf.distribute.has_strategy() and compiled_apply(optimizer, grads, variables, decision):
            if restore_on_skip:
                # Off the update's path: nothing waits for this cond.
                restore_if_skipped(decision, restore_on_skip)
            return "compiled"
        mechanism = "gated"
    if mechanism == "gated":
        if not tf.distribute.has_strategy() and gated_apply(
            optimizer,
            lambda: _apply(optimizer, gradients_after(optimizer, grads, variables, decision), variables),
            decision,
            forward_done=forward_done,
            restore_on_skip=restore_on_skip,
        ):
            return "gated"
        mechanism = "cond"
    if mechanism == "cond" and not _needs_merge_call():
        tf.cond(
            decision,
            lambda: _apply(optimizer, grads, variables),
            lambda: _assign(restore_variables, restore_values),
        )
        return "cond"

    def decide(distribution: Any, decision: Any, grads: Any, restore_values: Any) -> None:
        decision = distribution.experimental_local_results(decision)[0]
        tf.cond(
            decision,
            lambda: distribution.extended.call_for_each_replica(_apply, args=(optimizer, grads, variables)),
            lambda: distribution.extended.call_for_each_replica(
                _assign, args=(restore_variables, restore_values)
            ),
        )

    tf.distribute.get_replica_context().merge_call(decide, args=(decision, grads, restore_values))
    return "cross_replica"


def restore_if_skipped(applied: tf.Tensor, pairs: Sequence[tuple[Any, Any]]) -> None:
    """Assigns each `(variable, value)` back when `applied` is False (in
    cross-replica context under a `merge_call` strategy, as above)."""
    variables = [variable for variable, _ in pairs]
    values = [value for _, value in pairs]
    if not _needs_merge_call() or tf.distribute.get_replica_context() is None:
        tf.cond(applied, lambda: None, lambda: _assign(variables, values))
        return

    def restore(distribution: Any, applied: Any, values: Any) -> None:
        applied = distribution.experimental_local_results(applied)[0]
        tf.cond(
            applied,
            lambda: None,
            lambda: distribution.extended.call_for_each_replica(_assign, args=(variables, values)),
        )

    tf.distribute.get_replica_context().merge_call(restore, args=(applied, values))
