"""The loss-scaled step on Keras's PyTorch backend.

Keras's torch step is stateful: the forward pass writes BatchNormalization's
statistics and seed states, and the optimizer writes the weights, slots and
`iterations` in place (also inside `stateless_apply`). A skipped step must
write none of them, so nothing is written before the decision: the forward
pass runs in a scope that keeps its writes aside (`LossScaling.forward`),
one host read decides (the step's one sync, as in `torch.amp.GradScaler`;
under `torch.distributed`, after one all-reduce of the gradients' and the
loss's finite flags, so that every rank decides and counts alike), and
only an applied step runs the optimizer and commits the forward pass's
writes. A skipped step costs no copy of any state. The same read brings
back what a healthy step's update of the scale's state needs
(`applied_step.py`), which then writes only what changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from mp_callbacks import _scale_state
from mp_callbacks._backend import counter_dtype
from mp_callbacks._keras_internals import deferring_stateless_scope
from mp_callbacks._unscale import overwrites_with_gradient, unscale
from mp_callbacks.backends.common.step import StepOutcome, finished_state, scale_loss
from mp_callbacks.backends.torch import tensor_ops
from mp_callbacks.backends.torch.applied_step import (
    EPOCH_READ,
    READ_WITH_THE_DECISION,
    update_after_applied_step,
)

__all__ = [
    "HostReading",
    "LossScaling",
    "StepOutcome",
    "check_on_host",
    "finite_on_every_rank",
    "global_norm",
    "read_on_host",
]

_FLAG = getattr(torch, counter_dtype())
_READ = READ_WITH_THE_DECISION + EPOCH_READ


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


def _all_finite(values: Sequence[Any]) -> torch.Tensor:
    """True where every value (a 0-d or larger tensor) holds no inf or NaN."""
    return torch.stack([torch.isfinite(v).all() for v in values]).all()


def finite_on_every_rank(finite: Any) -> Any:
    """This process's finite flags (a bool tensor), made every process's
    under `torch.distributed` (one all-reduce, as GradScaler's found-inf):
    all ranks decide alike, also where only one rank's gradients or loss
    were not finite, so that no rank's weights or scale drift from the
    others'."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()) or distributed.get_world_size() < 2:
        return finite
    everywhere = finite.to(torch.int32)
    distributed.all_reduce(everywhere, op=distributed.ReduceOp.MIN)
    return everywhere.to(torch.bool)


class HostReading(NamedTuple):
    """What the step's one host read found (the decision on every rank)."""

    applied: bool  #: every gradient finite: the update applies
    #: the loss (any of several) held inf or NaN; None where not read (an
    #: outcome of another `LossScaling`'s check, whose decision is read alone)
    loss_diverged: bool | None
    #: the values of the state read with it (and "global_norm"), by name
    values: dict[str, float] | None = None


def _loss_value(losses: Any) -> torch.Tensor:
    """The loss as one float32 scalar whose finiteness is the losses'."""
    values = [v for v in (losses if isinstance(losses, (list, tuple)) else [losses]) if v is not None]
    values = [v.detach() if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
    if len(values) == 1 and values[0].ndim == 0 and values[0].dtype == torch.float32:
        return values[0]  # the usual one float32 scalar loss
    if not values:
        return torch.zeros((), dtype=torch.float32)
    return torch.where(_all_finite(values), 0.0, float("nan"))


def read_on_host(
    global_norm: torch.Tensor, losses: Any, state: dict[str, torch.Tensor] | None = None
) -> HostReading:
    """Whether the gradients (their global norm) and the loss are finite
    on every rank, and the values of `state`, in one host read: the step's
    one sync. The finiteness is judged on the host, from the values: no op
    on the device for it."""
    head = [global_norm, _loss_value(losses)]
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
        # NaN where any rank's value is not finite; the value itself elsewhere.
        everywhere = finite_on_every_rank(torch.isfinite(torch.stack(head)))
        head = list(torch.stack(head) + torch.where(everywhere, 0.0, float("nan")))
    state = state or {}
    names = list(state)
    # float64: exact for the float32 values and the int64 counters below 2**53.
    read = torch.stack([head[0].double(), head[1], *(state[name] for name in names)]).tolist()
    values = dict(zip(["global_norm", "loss", *names], read))
    return HostReading(math.isfinite(read[0]), not math.isfinite(read[1]), values)


def check_on_host(
    grads: Sequence[Any],
    losses: Any = None,
    state: dict[str, torch.Tensor] | None = None,
    overwrite: Sequence[bool] | None = None,
) -> tuple[StepOutcome, HostReading]:
    """One pass over the (unscaled) gradients and the one host read (of
    the decision and of `state`): the outcome (the flags, exact per
    gradient only where a gradient is not finite, then the loss's) and what
    the host read. The gradients marked in `overwrite` (float8 state, whose
    "gradients" are their next values) count for the decision, not the norm."""
    grads = list(grads)
    if overwrite is not None and any(overwrite):
        # + 0 * their norm: the applied norm exactly where they are finite, NaN elsewhere.
        state_norm = global_norm([g for g, kept in zip(grads, overwrite) if kept])
        norm = global_norm([g for g, kept in zip(grads, overwrite) if not kept]) + 0.0 * state_norm
    else:
        norm = global_norm(grads)
    reading = read_on_host(norm, losses, state)
    if reading.applied:
        flags = torch.zeros((len(grads) + 1,), dtype=_FLAG)
    else:  # a skipped step only
        nonfinite = [
            torch.zeros(()) if g is None else torch.logical_not(torch.isfinite(g).all()) for g in grads
        ]
        flags = torch.stack([*nonfinite, torch.zeros(())]).to(_FLAG)
    if reading.loss_diverged:
        flags[-1] = 1
    return StepOutcome(torch.tensor(reading.applied), flags, norm), reading


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

    def __init__(
        self,
        settings: _scale_state.ScaleSettings,
        variables: dict[str, Any],
        tensors: dict[str, torch.Tensor] | None = None,
        fast: bool = True,
    ) -> None:
        self._settings = settings
        #: The host's share of the scale's update (False: all in tensors).
        self._fast = fast
        self._variables = variables
        #: The variables' tensors by name (each variable's `.value` if not given).
        self._tensors = tensors
        #: The scale this step multiplies by (a float32 scalar).
        self.value = variables["scale"].value if tensors is None else tensors["scale"]
        #: False for a fixed scale of 1: nothing is multiplied.
        self.active = settings.is_dynamic or settings.initial_scale != 1.0
        self._readings: dict[int, HostReading] = {}

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

    def unscale(self, grads: Sequence[Any], variables: Sequence[Any] | None = None) -> list[Any]:
        """The gradients of a scaled loss, divided by the scale once; those
        of float8 state among `variables` (the variables the gradients are
        for, in order) pass as they are (`mp_callbacks._unscale`)."""
        return unscale(grads, self.value, variables) if self.active else list(grads)

    @torch.compiler.disable
    def check(self, grads: Sequence[Any], losses: Any, variables: Sequence[Any] | None = None) -> StepOutcome:
        """The step's one decision, over all its (unscaled) gradients and
        its loss or losses: applied only if every gradient is finite (the
        norm leaves out float8 state among `variables`). Its host read is
        the step's one sync (`applies` and `finish` reuse it)."""
        tensors = self._state_tensors()
        overwrite = None if variables is None else [overwrites_with_gradient(v) for v in variables]
        read = {name: tensors[name] for name in _READ} if self._fast else None
        outcome, reading = check_on_host(grads, losses, read, overwrite)
        self._readings[id(outcome.applied)] = reading
        return outcome

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = {name: variable.value for name, variable in self._variables.items()}
        return self._tensors

    @torch.compiler.disable
    def applies(self, outcome: StepOutcome) -> bool:
        """Whether the step applies, as `check` read it (no further host read)."""
        key = id(outcome.applied)
        if key not in self._readings:  # an outcome of another LossScaling's check
            self._readings[key] = HostReading(bool(outcome.applied), None)
        return self._readings[key].applied

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
        values = self._state_tensors()
        reading = None if torch.compiler.is_compiling() else self._readings.get(id(outcome.applied))
        with torch.no_grad():
            if self._fast and reading is not None and reading.applied and reading.values is not None:
                # Nearly every step: the host's reading leaves a few writes.
                return update_after_applied_step(
                    self._settings,
                    values,
                    reading.values,
                    bool(reading.loss_diverged),
                    outcome.global_norm,
                    batch_size,
                )
            after, logs = finished_state(self._settings, values, outcome, batch_size, tensor_ops)
            for name, value in after.items():
                # In place, as Keras's own assign writes a torch variable.
                values[name].copy_(value)
        return logs
