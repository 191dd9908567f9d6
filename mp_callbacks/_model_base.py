"""What `MixedPrecisionModel` is on every backend, written once: its
switches, `from_model`, the float8 repair at `fit`, and `check_model`'s
warning at the first `compile`. Each backend's class (TensorFlow's
`model.py`, JAX's and torch's through `backends/common/model.py`) derives
from it and adds the loss scale's state and its step."""

from __future__ import annotations

from typing import Any

from mp_callbacks._backend import keras
from mp_callbacks._float8 import repair_amax_histories
from mp_callbacks._keras_internals import all_layers
from mp_callbacks._loss_scale_argument import AUTO
from mp_callbacks._model_building import warn_about_findings, wrap_model

__all__ = ["ModelBase"]


class ModelBase(keras.Model):
    """The backend-neutral part of `MixedPrecisionModel`."""

    #: float8 layers' output-gradient scale and amax history follow the loss
    #: scale when it changes (they hold scaled gradients' values); False
    #: leaves them as stock Keras does, a binade or more off after a change.
    float8_follows_loss_scale = True
    #: The speed work of the step: on TensorFlow the update compiled by XLA
    #: or gated write by write (`backends/tensorflow/skip.py`); on JAX each
    #: write of the update gated; on torch the host's share of the scale's
    #: update. False runs the reference step instead (TensorFlow: the update
    #: inside one `tf.cond`, as Keras's `LossScaleOptimizer`; JAX: the update
    #: computed, then chosen with `where`; torch: the scale's state updated
    #: in tensors), bit for bit the same training, for a bug report or a
    #: comparison.
    fast_step = True
    #: The backend's own `train_step` (each backend's class sets it after
    #: defining it): a subclass that overrides it brings its own step.
    _mp_default_train_step: Any

    def _has_own_train_step(self) -> bool:
        return type(self).train_step is not type(self)._mp_default_train_step

    @classmethod
    def from_model(cls, model: keras.Model, loss_scale: Any = AUTO, **kwargs: Any) -> Any:
        """Wraps an existing Sequential or functional model.

        The new model shares the original's layers and weights, and takes
        its inputs and outputs in the same structure (a single input stays
        a single tensor). If the original was compiled, the new one is
        compiled with the same optimizer object, losses and metrics.

        A model built under float32, with a mixed policy set as the global
        policy afterwards (`keras.mixed_precision.set_global_policy`), is
        brought into that policy: every layer that was built with the
        default policy then computes in the global one (in place: the
        layers are shared), except the layers that produce the model's
        outputs, which stay float32 as `check_model` advises. Layers given
        a dtype of their own keep it.

        Args:
            model: a built `keras.Sequential` or functional `keras.Model`.
            loss_scale: as for `MixedPrecisionModel`. Defaults to "auto".
            **kwargs: passed to the constructor (for example `name`).

        Returns:
            The new `MixedPrecisionModel`.

        Raises:
            ValueError: `model` has no known inputs and outputs (a
                subclassed model: subclass `MixedPrecisionModel` instead).
        """
        return wrap_model(cls, model, loss_scale, kwargs)

    def _computes_in_float16(self) -> bool:
        if self.dtype_policy.compute_dtype == "float16":
            return True
        return any(getattr(layer, "compute_dtype", None) == "float16" for layer in all_layers(self))

    def _loss_scale_is_auto(self) -> bool:
        """Whether compile chose the scale for the policy ("auto"), so that
        a copy under another policy (PrecisionPlan.apply) chooses again.
        `_mp_chosen_by`: who chose the loss scale, the user ("user") or
        compile ("auto", or "off" for auto_scale_loss=False; None before)."""
        return self.__dict__.get("_mp_chosen_by") in (None, "auto")

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """As `keras.Model.fit`; a float8 layer's amax history that holds
        inf or NaN (a checkpoint of a run that diverged) is repaired first,
        with a warning naming it (`_float8.repair_amax_histories`)."""
        repair_amax_histories(self)
        return super().fit(*args, **kwargs)

    def _warn_about_findings(self) -> None:
        """`check_model`'s findings, warned once, at the first compile."""
        if self.__dict__.get("_mp_checked"):
            return
        self.__dict__["_mp_checked"] = True
        warn_about_findings(self, self.__dict__.get("_mp_loading", False))

    def compile_from_config(self, config: dict[str, Any]) -> None:
        # Keras skips compile_from_config for models that override compile.
        self.__dict__["_mp_loading"] = True
        try:
            self.compile(**keras.saving.deserialize_keras_object(config))
        finally:
            self.__dict__["_mp_loading"] = False
