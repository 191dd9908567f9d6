"""`LossScaleOptimizer` on Keras's JAX backend: the shared optimizer
(`backends/common/loss_scale_optimizer.py`), its update computed and then
chosen or not by one conditional, inside JAX's stateless step."""

from __future__ import annotations

from typing import Any

from mp_callbacks._backend import keras
from mp_callbacks._gradient_check import check_gradients
from mp_callbacks.backends.common.loss_scale_optimizer import VariableScaleOptimizer
from mp_callbacks.backends.jax import step as jax_step

__all__ = ["LossScaleOptimizer"]


@keras.saving.register_keras_serializable(package="mp_callbacks")
class LossScaleOptimizer(VariableScaleOptimizer):
    """Keras's `LossScaleOptimizer` on the `LossScaler` state machine, on JAX.

    Takes Keras 3's arguments (`initial_scale`, `dynamic_growth_steps`),
    tf.keras's (`dynamic=False` with `initial_scale`: a fixed scale), any
    `LossScaler` setting as a keyword (`hysteresis`, `min_scale`, ...), or
    a ready `loss_scale=LossScaler(...)`; refuses what TensorFlow's
    refuses, with the same messages.

    * Keras's `fit` (and a keras-io JAX `train_step`) scales the loss with
      `scale_loss` and passes the gradients of the scaled loss to
      `stateless_apply`, which unscales them once, checks them in one pass,
      and keeps the weights, every slot and `iterations` where a gradient
      is not finite; the scale moves as `LossScaler` describes.
    * tf.keras's loop: `get_scaled_loss(loss)`, then
      `get_unscaled_gradients(grads)`; the next apply takes those gradients
      as unscaled and does not divide them again (the one unscaling rule).
    * `scaler` is the `LossScaler` reading this optimizer's state
      (`LossScaleMonitor` and `NaNGradientMonitor` find it there).

    Under a `MixedPrecisionModel`'s own step, `compile` unwraps it and the
    model adopts its settings: the model then also keeps
    BatchNormalization's statistics and seed states on a skipped step,
    which an optimizer alone cannot see.
    """

    def _apply_if_finite(
        self, grads: list[Any], inner: list[Any], trainable: list[Any]
    ) -> tuple[Any, Any, list[Any], list[Any]]:
        checked = check_gradients(grads)
        new_trainable, new_inner = self.inner_optimizer.stateless_apply(inner, grads, trainable)
        kept_trainable, kept_inner = jax_step.keep_if_skipped(
            checked.all_finite, (list(new_trainable), list(new_inner)), (trainable, inner)
        )
        return checked.all_finite, checked.flags, kept_trainable, kept_inner
