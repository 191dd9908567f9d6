"""`LossScaleOptimizer` on Keras's PyTorch backend: the shared optimizer
(`backends/common/loss_scale_optimizer.py`) with the decision read on the
host first. Keras's torch optimizers write the weights and slots in place,
even inside `stateless_apply`, so an update computed and then not chosen
would already have changed them: the update runs only where the step
applies, and a skipped step writes nothing but the scale's state."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mp_callbacks import _scale_state
from mp_callbacks._backend import keras
from mp_callbacks.backends.common.loss_scale_optimizer import VariableScaleOptimizer
from mp_callbacks.backends.torch import tensor_ops
from mp_callbacks.backends.torch.applied_step import READ_WITH_THE_DECISION, update_after_applied_step
from mp_callbacks.backends.torch.step import check_on_host

__all__ = ["LossScaleOptimizer"]

ops = keras.ops


@keras.saving.register_keras_serializable(package="mp_callbacks")
class LossScaleOptimizer(VariableScaleOptimizer):
    """Keras's `LossScaleOptimizer` on the `LossScaler` state machine, on torch.

    Takes Keras 3's arguments (`initial_scale`, `dynamic_growth_steps`),
    tf.keras's (`dynamic=False` with `initial_scale`: a fixed scale), any
    `LossScaler` setting as a keyword, or a ready `loss_scale=LossScaler(...)`.

    * Keras's `fit` (and a keras-io torch `train_step`) scales the loss with
      `scale_loss` and passes the gradients of the scaled loss to `apply`,
      which unscales them once, checks them in one pass, reads the decision
      on the host once (as `torch.amp.GradScaler` does; under
      `torch.distributed`, reduced across ranks first, so that all skip
      together) and runs the inner optimizer only where every gradient is
      finite: weights, slots and `iterations` stay on a skip.
    * tf.keras's loop and PyTorch's habit alike: `get_scaled_loss(loss)`
      (or `scale_loss`), `backward()`, `get_unscaled_gradients(grads)`,
      clip if you like, then `apply`, which takes those gradients as
      unscaled and does not divide them again (the one unscaling rule).
    * `scaler` is the `LossScaler` reading this optimizer's state.

    Under a `MixedPrecisionModel`'s own step, `compile` unwraps it and the
    model adopts its settings: the model then also keeps
    BatchNormalization's statistics and seed states on a skipped step,
    which an optimizer alone cannot see.
    """

    def _apply_if_finite(
        self, grads: list[Any], inner: list[Any], trainable: list[Any]
    ) -> tuple[Any, Any, list[Any], list[Any]]:
        outcome, reading = check_on_host(grads)
        if reading.applied:
            trainable, inner = (
                list(v) for v in self.inner_optimizer.stateless_apply(inner, grads, trainable)
            )
        return outcome.applied, outcome.flags[:-1], trainable, inner

    def apply(self, grads: Iterable[Any], trainable_variables: Iterable[Any] | None = None) -> None:
        """Keras 3's stateful apply: unscale once, check once, one host
        read, the inner optimizer's `apply` (in place) where every gradient
        is finite, and the scale's next state."""
        grads = list(grads)
        variables = self._resolved_variables(trainable_variables)
        grads = self._unscaled(grads, self._mp_state["scale"].value)
        # No loss is seen here: its flag is 0 (a skip is an overflow).
        state = {name: variable.value for name, variable in self._mp_state.items()}
        outcome, reading = check_on_host(grads, None, {name: state[name] for name in READ_WITH_THE_DECISION})
        with torch.no_grad():
            if reading.applied and reading.values is not None:
                self.inner_optimizer.apply(grads, variables)
                update_after_applied_step(
                    self.scaler.settings, state, reading.values, False, outcome.global_norm
                )
                return
            after = _scale_state.transition(
                self.scaler.settings, state, outcome.flags, outcome.applied, tensor_ops
            )
            for name, variable in self._mp_state.items():
                variable.value.copy_(after[name])  # in place, as Keras's own assign writes it
