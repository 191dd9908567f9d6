"""`MixedPrecisionModel` on Keras's PyTorch backend.

The loss scale's state lives in variables of the model
(`backends/common/model.py`), saved with the weights. A step runs the
forward pass with its writes kept aside, calls `backward()` on the scaled
loss, unscales the gradients once, checks them in one pass, reads the
decision on the host once, and only then writes: the optimizer's update
and the forward pass's writes (BatchNormalization's statistics, seed
states) where it applies, nothing where it is skipped.
"""

from __future__ import annotations

from typing import Any

import torch

from mp_callbacks._backend import keras
from mp_callbacks._float8 import gradient_state
from mp_callbacks._keras_internals import call_has_training_arg, compute_loss, loss_tracker
from mp_callbacks._model_building import LOG_KEYS
from mp_callbacks._unscale import overwrites_with_gradient
from mp_callbacks.backends.common.model import VariableScaleModel, scaler_from_argument
from mp_callbacks.backends.torch import step as torch_step
from mp_callbacks.backends.torch.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["LOG_KEYS", "MixedPrecisionModel", "scaler_from_argument"]


@keras.saving.register_keras_serializable(package="mp_callbacks")
class MixedPrecisionModel(VariableScaleModel):
    """A `keras.Model` whose step scales the loss, skips non-finite steps
    (leaving every variable as it was) and reports `loss_scale`,
    `grad_norm` and `skipped_steps` in the training logs; on PyTorch.

    Args:
        loss_scale: "auto" (the default: a dynamic scale when the model
            computes in float16, none otherwise), a `LossScaler` (or its
            config dict), a number (a fixed scale), or None (no scaling;
            non-finite steps are still skipped).
    """

    def loss_scaling(self) -> torch_step.LossScaling:
        """The loss scale for one torch step (see `LossScaling`): what this
        model's own `train_step` uses, and yours can (a GAN's two
        optimizers)."""
        settings = self._loss_scaling_settings()
        variables = {**self._mp_state, **self._mp_epoch, **self._mp_counts}
        if torch.compiler.is_compiling():  # traced: the graph holds the tensors
            return torch_step.LossScaling(settings, variables, fast=self.fast_step)
        return torch_step.LossScaling(settings, variables, self._mp_tensors_of(variables), self.fast_step)

    def _mp_tensors_of(self, variables: dict[str, Any]) -> dict[str, Any]:
        """The state variables' tensors, by name, looked up once: Keras's
        torch variables keep their tensor for life (`assign` copies into
        it), and a `.value` per variable per step is a share of a small
        step. New variables (compile's, the per-variable counters) make a
        new lookup."""
        key = tuple(id(variable) for variable in variables.values())
        cached = self.__dict__.get("_mp_tensors")
        if cached is None or cached[0] != key:
            cached = (key, {name: variable.value for name, variable in variables.items()})
            object.__setattr__(self, "_mp_tensors", cached)
        return cached[1]

    def _mp_float8_of(self, weights: list[Any]) -> tuple[bool, list[int]]:
        """Whether float8 state is among `weights`, and the positions of the
        output-gradient state (`_float8.gradient_state`), looked up once per
        list of weights, as `_mp_tensors_of` does."""
        key = tuple(id(weight) for weight in weights)
        cached = self.__dict__.get("_mp_float8")
        if cached is None or cached[0] != key:
            cached = (key, any(overwrites_with_gradient(w) for w in weights), gradient_state(weights))
            object.__setattr__(self, "_mp_float8", cached)
        return cached[1], cached[2]

    def train_step(self, data: Any) -> dict[str, Any]:
        """Keras's torch step, loss-scaled and skipped as one: check once,
        decide once (one host read), write or keep, update the scale's state."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        scaling = self.loss_scaling()
        with scaling.forward() as forward:
            y_pred = self(x, training=True) if call_has_training_arg(self) else self(x)
            self.zero_grad()
            loss = compute_loss(self, x, y, y_pred, sample_weight)
        batch_size = next(t for t in keras.tree.flatten(x) if t is not None).shape[0]
        loss_tracker(self).update_state(loss, sample_weight=batch_size)
        weights = self.trainable_weights[:]
        if weights:
            scaling.scale(loss).backward()
        float8_state, following = self._mp_float8_of(weights)
        # The variables only where float8 state is among them: each is then
        # looked at once per step (torch runs this Python every step).
        grads = scaling.unscale([w.value.grad for w in weights], weights if float8_state else None)
        outcome = scaling.check(grads, loss, weights if float8_state else None)
        scaling.apply_if_finite(outcome, self.optimizer, grads, weights)
        scaling.commit(outcome, forward)
        if not scaling.applies(outcome):
            # A copy of the counter (the scale's update writes it in place): no host read.
            self.keep_skipped_batch((x, y, sample_weight), self._mp_state["step_count"].value.clone())
        following = following if self.float8_follows_loss_scale and scaling.active else []
        scale_before = scaling.value.clone() if following else None  # finish writes it in place
        logs = scaling.finish(outcome, batch_size)
        if following:
            ratio = self._mp_state["scale"].value / scale_before
            with torch.no_grad():
                for i in following:
                    weights[i].value.mul_(ratio.to(weights[i].value.dtype))
        return {**self.compute_metrics(x, y, y_pred, sample_weight=sample_weight), **logs}

    _mp_default_train_step = train_step
    _mp_optimizer_class = LossScaleOptimizer
