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

from dataclasses import dataclass, field
from typing import Any

from mp_callbacks._backend import tf

__all__ = ["StepRecord"]


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
    """

    losses: list[Any] = field(default_factory=list)
    loss_scaled: bool = False
    applied: list[tf.Tensor] = field(default_factory=list)
    norms: list[tf.Tensor] = field(default_factory=list)
    norm_factor: int = 1

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
