"""`MixedPrecisionModel` on Keras's JAX backend.

The loss scale's state lives in non-trainable variables of the model
(`backends/common/model.py`), so that it travels with the rest of the
state through JAX's stateless step and is saved with the weights. A step
scales the loss, unscales the gradients once, checks them in one pass,
runs the optimizer's `stateless_apply`, and keeps every piece of state
that came in (weights, optimizer slots and `iterations`,
BatchNormalization's statistics, seed states, EMA copies) where the step
is skipped.
"""

from __future__ import annotations

from typing import Any

import jax

from mp_callbacks._backend import keras
from mp_callbacks._float8 import gradient_state
from mp_callbacks._keras_internals import update_metrics_variables
from mp_callbacks._model_building import LOG_KEYS
from mp_callbacks.backends.common.model import VariableScaleModel, scaler_from_argument
from mp_callbacks.backends.jax import step as jax_step
from mp_callbacks.backends.jax.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["LOG_KEYS", "MixedPrecisionModel", "scaler_from_argument"]

ops = keras.ops


@keras.saving.register_keras_serializable(package="mp_callbacks")
class MixedPrecisionModel(VariableScaleModel):
    """A `keras.Model` whose step scales the loss, skips non-finite steps
    (leaving every variable as it was) and reports `loss_scale`,
    `grad_norm` and `skipped_steps` in the training logs; on JAX.

    Args:
        loss_scale: "auto" (the default: a dynamic scale when the model
            computes in float16, none otherwise), a `LossScaler` (or its
            config dict), a number (a fixed scale), or None (no scaling;
            non-finite steps are still skipped).
    """

    _mp_kept_barrier = staticmethod(jax.effects_barrier)

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """As `keras.Model.fit`. With an EMA optimizer, Keras ends `fit` by
        assigning each average to its weight, the same JAX buffer in both;
        the next `fit` would donate that buffer twice and fail (stock Keras
        3.15 does). Each weight gets a buffer of its own again."""
        history = super().fit(*args, **kwargs)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "use_ema", False):
            for variable in self.trainable_variables:
                variable.assign(ops.copy(variable.value))
        return history

    def loss_scaling(self, non_trainable_variables: Any) -> jax_step.LossScaling:
        """The loss scale for one stateless step, read from the step's
        `non_trainable_variables` (see `LossScaling`): what this model's
        own `train_step` uses, and yours can (a GAN's two optimizers)."""
        settings = self._loss_scaling_settings()
        positions = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
        ours = {**self._mp_state, **self._mp_epoch, **self._mp_counts}
        return jax_step.LossScaling(
            settings,
            {name: positions[id(v)] for name, v in ours.items()},
            non_trainable_variables,
            watched=self.__dict__.get("_mp_watching", False),
            fast=self.fast_step,
        )

    def make_train_function(self, force: bool = False) -> None:
        """Keras's train function, which also keeps the batch of a skipped
        step (see `LossScaling.hand_over_if_skipped`): it notes the batch it
        passes in with the decision and the step's number the step puts in
        its logs, and takes those out of the logs."""
        super().make_train_function(force)
        inner: Any = self.train_function
        if getattr(inner, "_mp_watches", False) or self.steps_per_execution != 1:
            return

        def train_function(state: Any, iterator: Any) -> Any:
            drawn: list[Any] = []

            def recorded() -> Any:
                for data in iterator:
                    drawn.append(data)
                    yield data

            object.__setattr__(self, "_mp_watching", True)  # read where the step is traced
            try:
                logs, state = inner(state, recorded())
            finally:
                object.__setattr__(self, "_mp_watching", False)
            applied, step = (logs.pop(key, None) for key in jax_step.WATCH_KEYS)
            if applied is not None and drawn:
                self._mp_kept.watch(keras.utils.unpack_x_y_sample_weight(drawn[-1]), applied, step)
            return logs, state

        train_function._mp_watches = True  # type: ignore[attr-defined]
        self.train_function = train_function  # type: ignore[assignment]

    def train_step(self, state: Any, data: Any) -> tuple[dict[str, Any], Any]:
        """Keras's JAX step, loss-scaled and skipped as one: check once,
        decide once, apply or keep, update the scale's state."""
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        scaling = self.loss_scaling(non_trainable)

        def scaled_loss(trainable_values, non_trainable_values):
            loss, aux = self.compute_loss_and_updates(
                trainable_values,
                non_trainable_values,
                metrics_vars,
                x,
                y,
                sample_weight,
                training=True,
                optimizer_variables=optimizer_vars,
            )
            return scaling.scale(loss), aux

        (_, aux), grads = jax.value_and_grad(scaled_loss, has_aux=True)(trainable, non_trainable)
        loss, y_pred, new_non_trainable, metrics_vars = aux
        grads = scaling.unscale(grads, self.trainable_variables)
        outcome = scaling.check(grads, loss, self.trainable_variables)
        if keras.distribution.distribution() is None:
            scaling.hand_over_if_skipped(
                outcome, non_trainable, (x, y, sample_weight), self.keep_skipped_batch
            )
            self._mp_kept.not_kept = None
        else:
            self._mp_kept.not_kept = (
                "under keras.distribution each device holds only its part of the batch, "
                "so no single batch is kept to replay"
            )
        trainable, optimizer_vars = scaling.apply_if_finite(
            outcome, self.optimizer, optimizer_vars, grads, trainable
        )
        non_trainable = scaling.commit(outcome, list(new_non_trainable), list(non_trainable))
        batch_size = next(t for t in keras.tree.flatten(x) if t is not None).shape[0]
        non_trainable, scale_logs = scaling.finish(outcome, non_trainable, batch_size)
        if self.float8_follows_loss_scale and scaling.active:
            ratio = scale_logs["loss_scale"] / scaling.value
            trainable = list(trainable)
            for i in gradient_state(self.trainable_variables):
                trainable[i] = trainable[i] * ops.cast(ratio, trainable[i].dtype)
        logs, metrics_vars = update_metrics_variables(self, metrics_vars, loss, x, y, y_pred, sample_weight)
        return {**logs, **scale_logs}, (trainable, non_trainable, optimizer_vars, metrics_vars)

    _mp_default_train_step = train_step
    _mp_optimizer_class = LossScaleOptimizer
