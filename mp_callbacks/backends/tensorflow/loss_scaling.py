"""`LossScaling` on TensorFlow: the verbs of the one recipe for a
`train_step` of your own, as on JAX and torch.

Run the forward pass and the loss in `forward()`, take the gradients of
`scale(loss)`, `unscale` them once, `check` all of the step's gradients
once, `apply_if_finite` each optimizer, `commit` the forward pass's writes,
and `finish`. TensorFlow writes as the forward pass runs, so `forward()`
reads the state it may write first and `commit` puts it back where the step
is skipped. Inside `fit` the model's train function advances the scale once
at the step's end and adds the figures to the logs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mp_callbacks._backend import tf
from mp_callbacks._gradient_check import applied_norm, check_gradients, decision, nonfinite_flag
from mp_callbacks.backends.common.step import StepOutcome
from mp_callbacks.backends.tensorflow import step as tf_step
from mp_callbacks.backends.tensorflow.skip import apply_or_skip, restore_if_skipped

__all__ = ["LossScaling", "StepOutcome"]


class LossScaling:
    """The loss scale inside one TensorFlow step of a `MixedPrecisionModel`
    (`model.loss_scaling()`): two optimizers (a GAN's) share the one scale
    and the one decision."""

    def __init__(self, scaler: Any, forward_variables: Sequence[Any]) -> None:
        self._scaler = scaler
        self._forward_variables = list(forward_variables)
        #: The variables of the checked gradients, in order (per-variable counts).
        self._checked: list[Any] | None = None
        self._applied: list[Any] = []
        #: The scale this step multiplies by (a float32 scalar).
        self.value = scaler.loss_scale
        #: False for a fixed scale of 1: nothing is multiplied.
        self.active = scaler.scaling_active

    @contextmanager
    def forward(self) -> Iterator[list[tuple[Any, Any]]]:
        """A scope for the forward pass and the loss: the values of the
        state it may write (BatchNormalization's statistics, seed states),
        read before it, for `commit`."""
        yield [(v, tf.identity(v.value)) for v in self._forward_variables]

    def scale(self, loss: Any) -> Any:
        """The loss to differentiate: times the scale."""
        return self._scaler.scale(loss)

    def unscale(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        """The gradients of a scaled loss, divided by the scale once; those
        of float8 state among `variables` pass as they are."""
        return self._scaler._unscale(grads, variables)

    def check(self, grads: Sequence[Any], losses: Any, variables: Sequence[Any] | None = None) -> StepOutcome:
        """The step's one decision, over all its (unscaled) gradients and
        its loss or losses, the same on every replica: applied only if every
        gradient is finite. With `variables` (those of the gradients, in
        order) non-finite gradients are counted per variable and float8
        state is left out of the norm."""
        grads = list(grads)
        checked = check_gradients(grads)
        flags = tf.concat([checked.flags, [nonfinite_flag(losses)]], axis=0)
        context = tf.distribute.get_replica_context()
        replicas = 1 if context is None else context.num_replicas_in_sync
        if replicas > 1:
            flags = context.all_reduce(tf.distribute.ReduceOp.SUM, flags)
        applied = decision(checked, flags, replicas)
        norm = checked.global_norm
        if variables is not None:
            self._checked = list(variables)
            self._build(self._checked)
            norm = applied_norm(checked, grads, self._checked)
        record = self._scaler._record
        if record is not None:
            for loss in losses if isinstance(losses, (list, tuple)) else [losses]:
                record.note_loss(loss)
            record.note_apply(applied, norm)
        return StepOutcome(applied, flags, norm)

    def applies(self, outcome: StepOutcome) -> Any:
        """Whether the step applies (a boolean tensor: no host read)."""
        return outcome.applied

    def apply_if_finite(
        self, outcome: StepOutcome, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]
    ) -> Any:
        """`optimizer.apply(grads, variables)` where the step applies;
        nothing (no weight, slot or `iterations` written) where it is
        skipped. Returns the decision."""
        grads, variables = list(grads), list(variables)
        optimizer = tf_step.plain_optimizer(self._scaler, optimizer)
        self._build(variables)
        if not optimizer.built:
            optimizer.build(variables)
        record = self._scaler._record
        reference = record is not None and record.reference
        apply_or_skip(optimizer, grads, variables, outcome.applied, mechanism="cond" if reference else None)
        self._applied += variables
        return outcome.applied

    def commit(self, outcome: StepOutcome, forward: list[tuple[Any, Any]]) -> None:
        """Keeps what the forward pass wrote where the step applies; puts
        the values read by `forward()` back where it is skipped."""
        restore_if_skipped(outcome.applied, forward)

    def finish(self, outcome: StepOutcome, batch_size: int) -> dict[str, Any]:
        """Advances the scale's state once for the step (inside `fit`, the
        train function does, at the step's end, and adds `loss_scale`,
        `grad_norm` and `skipped_steps` to the logs: nothing is returned
        then); returns `loss_scale` elsewhere."""
        del batch_size  # counted by the train function
        variables = self._checked
        if variables is None and len(self._applied) == int(outcome.flags.shape[0]) - 1:
            variables = self._applied  # the gradients were checked in the order they were applied
        if variables is None:  # no per-variable counts: the loss's flag alone
            variables, flags = [], outcome.flags[-1:]
        else:
            flags = outcome.flags
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        tf_step.pending_of(self._scaler).append(
            (variables, flags, outcome.applied if replicas == 1 else None)
        )
        if self._scaler._record is not None:
            return {}
        tf_step.update(self._scaler)
        return {"loss_scale": self._scaler.loss_scale}

    def _build(self, variables: list[Any]) -> None:
        known = {id(v) for v in self._scaler._built.items}
        self._scaler.build(self._scaler._built.items + [v for v in variables if id(v) not in known])
