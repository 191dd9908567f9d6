"""`StepRecord`: what one training step did with its loss scale.

A `MixedPrecisionModel` opens one record around every training step,
its own or a subclass's `train_step`, on the model's `LossScaler`.
While it is open, the scale notes the losses the step computed and scaled,
and the outcome of every apply
(applied or skipped, gradient norm); the model then advances the state
machine once and reports the step. Everything here happens while the
step is traced (or, eagerly, while it runs): it holds tensors of that
trace and Python flags, never a value read from the device.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from mp_callbacks._backend import tf

__all__ = ["StepRecord", "StepTraces"]


@dataclass
class StepRecord:
    """The trace-time record of one training step.

    Attributes:
        losses: the unscaled losses the step computed (`compute_loss`) or
            scaled (`LossScaler.scale`, `LossScaleOptimizer.scale_loss`
            or `get_scaled_loss`).
        loss_scaled: True once a loss was multiplied by the scale.
        applied: one boolean tensor per apply through the scale.
        norms: the global norm of each apply's unscaled gradients.
        norm_factor: multiplies the reported norm (the replica count, for
            the model's own step, whose loss Keras divides by it).
        reference: every apply of the step takes the reference path, the
            update inside one `tf.cond` (`MixedPrecisionModel.fast_step`
            False), not the compiled or gated update.
    """

    losses: list[Any] = field(default_factory=list)
    loss_scaled: bool = False
    applied: list[tf.Tensor] = field(default_factory=list)
    norms: list[tf.Tensor] = field(default_factory=list)
    norm_factor: int = 1
    reference: bool = False

    def note_loss(self, loss: Any) -> None:
        if loss is not None and all(loss is not seen for seen in self.losses):
            self.losses.append(loss)

    def note_apply(self, applied: tf.Tensor, norm: tf.Tensor) -> None:
        self.applied.append(applied)
        self.norms.append(norm)

    @property
    def stepped(self) -> bool:
        """True when some update went through the loss scale."""
        return bool(self.applied)

    def all_applied(self) -> tf.Tensor:
        """True when no apply of the step was skipped."""
        if len(self.applied) == 1:
            return self.applied[0]
        return tf.reduce_all(tf.stack(self.applied))

    def global_norm(self) -> tf.Tensor:
        """The norm of every gradient the step applied, together."""
        if len(self.norms) == 1:
            norm = self.norms[0]
        else:
            norm = tf.sqrt(tf.add_n([tf.square(n) for n in self.norms]))
        return norm * self.norm_factor if self.norm_factor != 1 else norm


class _ThreadTrace:
    """One thread's trace of a scaler's step."""

    def __init__(self) -> None:
        self.record: StepRecord | None = None
        # What the entries below belong to: "eager", or a weak reference
        # to the graph being traced (a failed trace's leftovers belong to
        # no step, and a graph must not outlive its trace for them).
        self.key: Any = None
        self.pending: list[Any] = []
        self.stage: Any = None


class StepTraces:
    """What a `LossScaler`'s step remembers while it is traced, held by the
    scaler so that it dies with it: the open record, the applies awaiting
    one state update, the gradients unscaled by hand. One set per thread:
    MirroredStrategy traces each replica's step in a thread of its own."""

    def __init__(self) -> None:
        self._by_thread: dict[int, _ThreadTrace] = {}

    def this_thread(self) -> _ThreadTrace:
        """This thread's trace, emptied of another graph's leftovers."""
        trace = self._by_thread.setdefault(threading.get_ident(), _ThreadTrace())
        key = "eager" if tf.executing_eagerly() else weakref.ref(tf.compat.v1.get_default_graph())
        if trace.key != key:
            trace.key, trace.pending, trace.stage = key, [], None
        return trace

    def record(self) -> StepRecord | None:
        trace = self._by_thread.get(threading.get_ident())
        return None if trace is None else trace.record

    def end_step(self) -> None:
        """Drops the pending applies and the unscale stage (a step's end, or
        a step that raised)."""
        trace = self._by_thread.get(threading.get_ident())
        if trace is not None:
            trace.pending = []
            trace.stage = None
