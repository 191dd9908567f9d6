"""The loss-scaled step on Keras's PyTorch backend.

Keras's torch step is stateful: the forward pass writes BatchNormalization's
statistics and seed states, and the optimizer writes the weights, slots and
`iterations` in place (also inside `stateless_apply`). A skipped step must
write none of them, so nothing is written before the decision: the forward
pass runs in a scope that keeps its writes aside (`LossScaling.forward`),
one host read of the finite flag decides (the step's one sync, as in
`torch.amp.GradScaler`; under `torch.distributed`, after one all-reduce
of the flag, so that every rank decides alike), and only an applied step
runs the optimizer and commits the forward pass's writes. A skipped step costs no copy of any
state; a healthy one, one boolean read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mp_callbacks import _scale_state
from mp_callbacks._gradient_check import check_gradients_on_host
from mp_callbacks._keras_internals import deferring_stateless_scope
from mp_callbacks.backends.common.step import StepOutcome, finished_state, scale_loss
from mp_callbacks.backends.torch import tensor_ops

__all__ = ["LossScaling", "StepOutcome", "finite_on_every_rank", "global_norm"]


def global_norm(grads: Sequence[Any]) -> Any:
    """The gradients' global L2 norm in float32, in torch's fused
    multi-tensor kernels (`get_total_norm`, one per device and dtype): a
    kernel per gradient costs a dispatch each, a share of a small step.
    Low-precision gradients are cast first: their own norm could overflow
    where they do not. inf or NaN anywhere makes it non-finite."""
    present = [g if g.dtype == torch.float32 else g.float() for g in grads if g is not None]
    if not present:
        return torch.zeros((), dtype=torch.float32)
    return torch.nn.utils.get_total_norm(present, norm_type=2.0, foreach=True)


def _nonfinite_flag(losses: Any, dtype: torch.dtype) -> torch.Tensor:
    """1 if the loss (any of several) holds inf or NaN, else 0: what
    `_gradient_check.nonfinite_flag` gives, in torch's own functions."""
    values = losses if isinstance(losses, (list, tuple)) else [losses]
    finite = [torch.isfinite(torch.as_tensor(v)).all() for v in values if v is not None]
    if not finite:
        return torch.zeros((), dtype=dtype)
    all_finite = finite[0] if len(finite) == 1 else torch.stack(finite).all()
    return torch.logical_not(all_finite).to(dtype)


def finite_on_every_rank(finite: Any) -> Any:
    """This process's "every gradient is finite", made every process's
    under `torch.distributed` (one all-reduce of a flag, as GradScaler's
    found-inf): all ranks skip together, also where only one rank's
    gradients overflowed, so that no rank's weights drift from the others'."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()) or distributed.get_world_size() < 2:
        return finite
    not_finite = torch.logical_not(finite).to(torch.int32).reshape(1)
    distributed.all_reduce(not_finite, op=distributed.ReduceOp.MAX)
    return not_finite[0] == 0


class LossScaling:
    """The loss scale inside one torch step of a `MixedPrecisionModel`:
    its own step, or a `train_step` of yours (`model.loss_scaling()`).

    Run the forward pass and the loss in `forward()`, call `backward()` on
    `scale(loss)`, unscale the gradients once, `check` all of the step's
    gradients once, `apply_if_finite` each optimizer (the first call reads
    the decision on the host, the others reuse it), `commit` the forward
    pass's writes, and `finish`: the scale's next state and the logs. Two
    optimizers (a GAN's) share the one scale and the one decision.
    """

    def __init__(self, settings: _scale_state.ScaleSettings, variables: dict[str, Any]) -> None:
        self._settings = settings
        self._variables = variables
        #: The scale this step multiplies by (a float32 scalar).
        self.value = variables["scale"].value
        #: False for a fixed scale of 1: nothing is multiplied.
        self.active = settings.is_dynamic or settings.initial_scale != 1.0
        self._decisions: dict[int, bool] = {}

    @contextmanager
    def forward(self) -> Iterator[Any]:
        """A scope for the forward pass and the loss: the variables it
        assigns (BatchNormalization's statistics, seed states) keep their
        values until `commit`; reads in the scope see the new ones. Layer
        losses (`add_loss`, activity regularizers) are kept as usual."""
        with deferring_stateless_scope() as scope:
            yield scope

    def scale(self, loss: Any) -> Any:
        """The loss to call `backward()` on: times the scale, in float32."""
        return scale_loss(loss, self.value) if self.active else loss

    def unscale(self, grads: Sequence[Any]) -> list[Any]:
        """The gradients of a scaled loss, divided by the scale once: each
        times 1/scale in its own dtype (`backends/common/step.unscale`'s
        rule, in torch's functions)."""
        if not self.active:
            return list(grads)
        inverse = torch.reciprocal(self.value)
        by_dtype: dict[torch.dtype, torch.Tensor] = {}
        unscaled: list[Any] = []
        for grad in grads:
            if grad is None:
                unscaled.append(None)
                continue
            if grad.dtype not in by_dtype:
                by_dtype[grad.dtype] = inverse.to(grad.dtype)
            unscaled.append(grad * by_dtype[grad.dtype])
        return unscaled

    @torch.compiler.disable
    def check(self, grads: Sequence[Any], losses: Any) -> StepOutcome:
        """The step's one decision, over all its (unscaled) gradients and
        its loss or losses: applied only if every gradient is finite. Its
        host read is the step's one sync (`applies` reuses it)."""
        grads = list(grads)
        checked, finite = check_gradients_on_host(grads, global_norm(grads), finite_on_every_rank, tensor_ops)
        flags = torch.cat([checked.flags, _nonfinite_flag(losses, checked.flags.dtype).reshape(1)])
        outcome = StepOutcome(checked.all_finite, flags, checked.global_norm)
        self._decisions[id(outcome.applied)] = finite
        return outcome

    @torch.compiler.disable
    def applies(self, outcome: StepOutcome) -> bool:
        """Whether the step applies, as `check` read it (no further host read)."""
        key = id(outcome.applied)
        if key not in self._decisions:  # an outcome of another LossScaling's check
            self._decisions[key] = bool(outcome.applied)
        return self._decisions[key]

    def apply_if_finite(
        self, outcome: StepOutcome, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]
    ) -> bool:
        """`optimizer.apply(grads, variables)` where the step applies;
        nothing (no weight, slot or `iterations` written) where it is
        skipped. Returns whether it applied."""
        applied = self.applies(outcome)
        if applied:
            with torch.no_grad():
                optimizer.apply(list(grads), list(variables))
        return applied

    def commit(self, outcome: StepOutcome, forward: Any) -> None:
        """Writes what the forward pass assigned in `forward()`, where the
        step applies; a skipped step leaves those variables as they were."""
        if self.applies(outcome):
            with torch.no_grad():
                for variable, value in forward.writes():
                    variable.assign(value)

    def finish(self, outcome: StepOutcome, batch_size: int) -> dict[str, Any]:
        """Writes the scale's next state and this epoch's figures; returns
        the logs' `loss_scale`, `grad_norm` and `skipped_steps`."""
        values = {name: variable.value for name, variable in self._variables.items()}
        with torch.no_grad():
            after, logs = finished_state(self._settings, values, outcome, batch_size, tensor_ops)
            for name, value in after.items():
                # In place, as Keras's own assign writes a torch variable.
                values[name].copy_(value)
        return logs
