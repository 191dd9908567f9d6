"""The one unscaling rule: each step's gradients are divided by the scale once.

Contract: `unscale` (LossScaler's, or `LossScaleOptimizer.get_unscaled_gradients`)
marks gradients as unscaled by hand; the next apply through the same scale
(`LossScaler.step`, `LossScaleOptimizer.apply` / `apply_gradients`) of the
same variables, or the next apply when `unscale` was given no variables,
takes its gradients as already unscaled and does not divide them again
(PyTorch's `GradScaler`: `unscale_(optimizer)`, clip, `step(optimizer)`).
Otherwise those applies unscale the gradients themselves.
`LossScaler.apply_gradients` always takes unscaled gradients. Unscaling the
same gradients twice before they are applied raises, naming what to do.

Like GradScaler's per-optimizer stage (ready / unscaled / stepped), the
stage lives as long as the step, held by the scaler (`StepTraces`): one per
traced graph (a failed trace leaves nothing behind) and per thread
(MirroredStrategy traces each replica in a thread of its own); a step's end
(`LossScaler.update`, or the end of a recorded training step) clears it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["UnscaleStage", "stage_of"]

_TWICE = (
    "LossScaler.unscale: these gradients were already unscaled in this step ({what}). A step's "
    "gradients are divided by the scale once: call unscale() once, after the backward pass "
    "(then clip if you like), and pass its result to step() or to the optimizer's apply, "
    "which then do not divide again."
)


def _same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@dataclass
class UnscaleStage:
    """Gradients unscaled by hand in the current step, not yet applied."""

    #: One entry per `unscale` call not yet consumed by an apply: the
    #: variables it was given (None: not given).
    pending: list[Sequence[Any] | None] = field(default_factory=list)
    #: The tensors `unscale` took and gave this step (held, not by id: an id
    #: may be reused once a tensor is freed).
    tensors: list[Any] = field(default_factory=list)

    def mark_unscaled(
        self,
        grads: Sequence[Any],
        unscaled: Sequence[Any],
        variables: Sequence[Any] | None,
        strict: bool = True,
    ) -> None:
        """Notes one `unscale` call; raises if these gradients (or these
        variables' gradients) were unscaled already and not yet applied.

        `strict=False` is tf.keras's `get_unscaled_gradients`, a pure
        function there that code may call more than once: it never raises,
        and calls before one apply count once."""
        present = [g for g in grads if g is not None]
        if not strict:
            if None not in self.pending:
                self.pending.append(None)
            return
        if any(any(g is seen for seen in self.tensors) for g in present):
            raise RuntimeError(_TWICE.format(what="the same tensors"))
        if variables is not None and any(
            entry is not None and _same(entry, variables) for entry in self.pending
        ):
            raise RuntimeError(_TWICE.format(what="the same variables' gradients"))
        self.pending.append(None if variables is None else list(variables))
        self.tensors.extend(present + [g for g in unscaled if g is not None])

    def take_unscaled(self, variables: Sequence[Any]) -> str | None:
        """Whether an apply of `variables` gets gradients unscaled by hand:
        consumes the `unscale` call for these variables ("with variables"),
        or else the oldest one given none ("without variables"); None when
        there is no such call."""
        for i, entry in enumerate(self.pending):
            if entry is not None and _same(entry, variables):
                del self.pending[i]
                self._forget_if_done()
                return "with variables"
        for i, entry in enumerate(self.pending):
            if entry is None:
                del self.pending[i]
                self._forget_if_done()
                return "without variables"
        return None

    def _forget_if_done(self) -> None:
        if not self.pending:
            self.tensors.clear()


def stage_of(scaler: Any) -> UnscaleStage:
    """The stage of `scaler` in the graph being traced (or eagerly)."""
    trace = scaler._traces.this_thread()
    if trace.stage is None:
        trace.stage = UnscaleStage()
    return trace.stage
