"""`LossScaleOptimizer`: tf.keras's and Keras 3's loss-scaling optimizer on `LossScaler`.

Two contracts meet in one class:

* tf.keras (every TF 2.x guide's custom loop): `get_scaled_loss(loss)`,
  `get_unscaled_gradients(grads)`, then `apply_gradients` of the *unscaled*
  gradients. On Keras 3 these methods are gone (keras-team/keras#19479,
  #20894).
* Keras 3 (`fit`, and `train_step`s written after Keras's own):
  `scale_loss(loss)`, then `apply`/`apply_gradients` of the gradients of
  the *scaled* loss, which the optimizer unscales.

An apply therefore unscales the gradients unless they were unscaled by
`get_unscaled_gradients` since the last apply. Either way the step is
skipped when a gradient is not finite, and the scale moves as
`LossScaler` describes. It subclasses Keras's `LossScaleOptimizer`,
so Keras (`compile` under `mixed_float16`, `TensorBoard`, `SwapEMAWeights`)
treats it as one and never wraps it a second time.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from typing import Any

from mp_callbacks._backend import keras, tf
from mp_callbacks._keras_internals import DelegatedCheckpoint
from mp_callbacks._optimizer_arguments import (
    ScaleOptimizerAttributes,
    check_inner,
    scaler_from_arguments,
)
from mp_callbacks._unscale import overwrites_with_gradient
from mp_callbacks._validation import fail
from mp_callbacks.backends.tensorflow import step as tf_step
from mp_callbacks.backends.tensorflow.unscale_stage import stage_of
from mp_callbacks.errors import MixedPrecisionWarning
from mp_callbacks.loss_scale import LossScaler

__all__ = ["LossScaleOptimizer"]

logger = logging.getLogger(__name__)

_SCALING_EXAMPLE = """
    with tf.GradientTape() as tape:
      loss = loss_fn()
      scaled_loss = opt.get_scaled_loss(loss)
    scaled_grads = tape.gradient(scaled_loss, vars)
    grads = opt.get_unscaled_gradients(scaled_grads)
    opt.apply_gradients([(grads, var)])"""


def _watchable(variables: Iterable[Any]) -> list[Any]:
    """What a `tf.GradientTape` can watch: a Keras variable's TensorFlow one."""
    return [v.value if isinstance(v, keras.Variable) else v for v in variables]


@keras.saving.register_keras_serializable(package="mp_callbacks")
class LossScaleOptimizer(ScaleOptimizerAttributes, DelegatedCheckpoint, keras.optimizers.LossScaleOptimizer):
    """Wraps a Keras 3 optimizer with dynamic loss scaling, for both the
    tf.keras and the Keras 3 ways of using one.

    Takes tf.keras's signature, so that TF 2.x code runs with only its
    import changed, and `LossScaler`'s finer settings as keywords.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer` that applies the updates. Its
            own `loss_scale_factor` is cleared (as Keras's wrapper does),
            since the gradients would otherwise be unscaled twice.
        dynamic: bool. True for a dynamic loss scale; False for a fixed
            one, which needs `initial_scale`. Defaults to `True`.
        initial_scale: float or None. The starting (or, with
            `dynamic=False`, the fixed) scale. Defaults to None: `2**15`
            for a dynamic scale.
        dynamic_growth_steps: int or None. Finite steps between growths
            (2.0 is taken as 2). Defaults to None: 2000; only for a dynamic
            scale. `growth_interval` is the same setting.
        growth_interval: int or None. As for `LossScaler` (the same setting
            as `dynamic_growth_steps`). Defaults to None: 2000.
        growth_factor: float or None. As for `LossScaler`. Defaults to
            None: 2.0.
        backoff_factor: float or None. As for `LossScaler`. Defaults to
            None: 0.5.
        min_scale: float or None. As for `LossScaler`. Defaults to None:
            1.0.
        max_scale: float or None. As for `LossScaler`. Defaults to None:
            2**24.
        hysteresis: int or None. As for `LossScaler`. Defaults to None: 1.
        loss_scale: `LossScaler`, dict, float or None. Instead of the arguments above, a ready
            `LossScaler`, its config dict, or a number in
            [2**-24, 2**64] (a fixed scale, as is `initial_scale` with
            `dynamic=False`). Defaults to None.
        name: str or None. The optimizer's name. Defaults to None.
        **kwargs: a base optimizer's argument (`clipnorm`, ...), accepted
            at its default only (set it on the inner optimizer, which
            applies the updates); any other keyword raises
            `UnsupportedArgumentError`.

    Raises:
        TypeError: `inner_optimizer` is not a Keras optimizer, or is a
            `LossScaleOptimizer`; `dynamic` is not a bool.
        ValueError: the optimizer is already wrapped; a base-optimizer
            argument (`clipnorm`, ...) is given; settings that contradict
            each other or are out of range.
        UnsupportedArgumentError: an unknown keyword argument (both a
            `TypeError` and a `ValueError`).

    Attributes (as in tf.keras and Keras 3): `inner_optimizer`, `dynamic`,
    `initial_scale`, `dynamic_growth_steps` (None when fixed),
    `dynamic_counter` and `step_counter` (the finite-step counter
    variable), `loss_scale` (the current scale, a float32 tensor),
    `dynamic_scale` (the variable holding it). Also `scaler`,
    the `LossScaler` doing the work, and `get_scale()`, the current
    scale as a Python float. `learning_rate`, `use_ema` and `ema_momentum`
    are the inner optimizer's, read and set through the wrapper; any other
    attribute is the wrapper's own (`AttributeError` if it has none).

    Gradients: `apply_gradients` and `apply` take the gradients of the
    scaled loss and unscale them, except right after
    `get_unscaled_gradients` (tf.keras's loop), whose output they take as
    it is. Inside a `MixedPrecisionModel`'s own `train_step`, the model's
    optimizer is one of these sharing the model's scale; there, gradients
    of a loss the step never scaled are not unscaled either.

    Example (the TF 2.x custom loop, unchanged but for the import):

    ```python
    import keras, tensorflow as tf
    from mp_callbacks import LossScaleOptimizer

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    loss_fn = keras.losses.MeanSquaredError()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam())

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    train_step(tf.ones((8, 4)), tf.zeros((8, 2)))
    print(optimizer.get_scale())  # 32768.0
    ```
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        *,
        growth_interval: int | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int | None = None,
        loss_scale: LossScaler | dict | float | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self_loss_scale = scaler_from_arguments(
            inner_optimizer,
            dynamic,
            initial_scale,
            dynamic_growth_steps,
            loss_scale,
            {
                "growth_interval": growth_interval,
                "growth_factor": growth_factor,
                "backoff_factor": backoff_factor,
                "min_scale": min_scale,
                "max_scale": max_scale,
                "hysteresis": hysteresis,
            },
            kwargs,
            LossScaler,
        )
        # Checked after the arguments, so that a bad argument is named first.
        if getattr(inner_optimizer, "_mp_wrapped_by_loss_scale_optimizer", False):
            raise ValueError(
                '"inner_optimizer" is already wrapped by a LossScaleOptimizer. An '
                "optimizer can only be wrapped by a single LossScaleOptimizer: "
                "two wrappers would each keep a scale and both step the same "
                "optimizer."
            )
        self._wrap(inner_optimizer, self_loss_scale, name)
        inner_optimizer._mp_wrapped_by_loss_scale_optimizer = True

    @classmethod
    def for_model(
        cls, inner_optimizer: keras.optimizers.Optimizer, loss_scale: LossScaler
    ) -> LossScaleOptimizer:
        """The optimizer a `MixedPrecisionModel` with its own `train_step`
        trains through: `inner_optimizer` with the model's `loss_scale`,
        whose state the model saves."""
        check_inner(inner_optimizer)
        wrapper = cls.__new__(cls)
        wrapper._wrap(inner_optimizer, loss_scale, "loss_scale_optimizer")
        wrapper._saves_loss_scale = False
        return wrapper

    def _wrap(self, inner: keras.optimizers.Optimizer, loss_scale: LossScaler, name: str | None) -> None:
        # Keras's LossScaleOptimizer.__init__ makes its own scale variables;
        # this class keeps its state in the LossScaler instead.
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)
        if inner.loss_scale_factor is not None:
            logger.info(
                "LossScaleOptimizer: the inner optimizer's loss_scale_factor=%r is "
                "cleared; the loss scale is this wrapper's.",
                inner.loss_scale_factor,
            )
            inner.loss_scale_factor = None
        self.inner_optimizer = inner
        self.scaler = loss_scale
        self._saves_loss_scale = True
        # A model's optimizer is saved in weights files as its inner one.
        self._saved_as_inner = False
        self._built_variables: list[Any] | None = None
        # tf.keras's warning about a forgotten scaling step: ever called?
        self._loss_has_been_scaled = False
        self._gradients_have_been_unscaled = False
        # Keras 3's way (scale_loss, then apply) asks for no such warning.
        self._keras_scales_the_loss = False
        self.__dict__["_mp_delegating"] = True

    # ------------------------------------------- tf.keras's and Keras 3's attributes
    @property
    def dynamic_counter(self) -> Any:
        """Finite steps since the last growth or overflow (None when fixed)."""
        return self.scaler._state["good_steps"] if self.dynamic else None

    @property
    def step_counter(self) -> Any:
        """Keras 3's name for the finite-step counter."""
        return self.scaler._state["good_steps"]

    @property
    def dynamic_scale(self) -> Any:
        """Keras 3's name for the variable holding the current scale."""
        return self.scaler._state["scale"]

    @property
    def loss_scale(self) -> tf.Tensor:
        """The current loss scale, a float32 tensor (as in tf.keras)."""
        return self.scaler.loss_scale

    # ---------------------------------------------------- scaling the loss
    @tf.autograph.experimental.do_not_convert
    def get_scaled_loss(self, loss: Any) -> Any:
        """`loss` multiplied by the current scale; for a callable `loss`, a
        callable that returns the scaled loss (as in tf.keras)."""
        self._loss_has_been_scaled = True
        if callable(loss):

            def scaled_loss() -> Any:
                return self.scaler.scale(loss())

            return scaled_loss
        return self.scaler.scale(loss)

    @tf.autograph.experimental.do_not_convert
    def scale_loss(self, loss: Any) -> Any:
        """`loss` multiplied by the current scale (Keras 3's name, which
        Keras's own `train_step` calls)."""
        self._keras_scales_the_loss = True
        return self.scaler.scale(loss)

    @tf.autograph.experimental.do_not_convert
    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """Each gradient divided by the current scale (None passes through);
        the next apply takes them as unscaled (`LossScaler.unscale`'s rule;
        as in tf.keras, calling it again is allowed and counts once).
        """
        self._gradients_have_been_unscaled = True
        grads = list(grads)
        unscaled = self.scaler._unscale(grads)
        stage_of(self.scaler).mark_unscaled(grads, unscaled, None, strict=False)
        return unscaled

    # ------------------------------------------- tf.keras's one-call step
    @tf.autograph.experimental.do_not_convert
    def compute_gradients(
        self, loss: Any, var_list: Any, tape: Any = None, grad_loss: Any = None
    ) -> list[tuple[Any, Any]]:
        """tf.keras's `compute_gradients`: the gradients of `loss`, computed
        on the scaled loss and unscaled, paired with their variables.

        Args:
            loss: a callable without arguments that returns the loss, or
                the loss tensor together with the `tape` that recorded it.
            var_list: the variables, or a callable that returns them.
            tape: a `tf.GradientTape`; needed for a tensor `loss`.
            grad_loss: the gradient of `loss` to start from (tf.keras's
                `grad_loss`), or None.
        """
        if not callable(loss) and tape is None:
            fail(
                "LossScaleOptimizer.compute_gradients",
                "loss",
                loss,
                "a callable that returns the loss, or a tensor passed with the `tape` that recorded it",
            )
        tape = tf.GradientTape() if tape is None else tape
        with tape:
            if callable(loss):
                if not callable(var_list):
                    tape.watch(_watchable(var_list))
                loss = loss()
            if callable(var_list):
                var_list = var_list()
            scaled = self.get_scaled_loss(loss)
        variables = list(var_list)
        grads = tape.gradient(scaled, variables, output_gradients=grad_loss)
        return list(zip(self.get_unscaled_gradients(grads), variables))

    @tf.autograph.experimental.do_not_convert
    def minimize(
        self, loss: Any, var_list: Any, grad_loss: Any = None, name: str | None = None, tape: Any = None
    ) -> Any:
        """tf.keras's `minimize`: `compute_gradients`, then `apply_gradients`
        (skipped where a gradient is not finite; the scale moves). `name`
        is accepted for tf.keras's older signature and not used. Returns
        the inner optimizer's iteration count."""
        del name
        return self.apply_gradients(self.compute_gradients(loss, var_list, tape=tape, grad_loss=grad_loss))

    # ------------------------------------------------------------- applying
    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """Applies the gradients unless one is not finite; updates the scale.

        Gradients of the scaled loss are unscaled first; the output of
        `get_unscaled_gradients` is taken as it is. Returns the inner
        optimizer's iteration count, as Keras does.
        """
        self._warn_about_scaling()
        grads, variables = zip(*grads_and_vars)
        self.apply(list(grads), list(variables))
        return self.iterations

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads: Iterable[Any], trainable_variables: Iterable[Any] | None = None) -> None:
        """Keras 3's apply: unscales `grads` (unless they come from
        `get_unscaled_gradients`), then applies them unless one is not
        finite. Without `trainable_variables`, the variables the optimizer
        was built with."""
        grads = list(grads)
        if trainable_variables is None:
            if self._built_variables is None:
                raise ValueError(
                    "LossScaleOptimizer.apply: pass `trainable_variables` with the "
                    "gradients, or build(variables) the optimizer first."
                )
            trainable_variables = self._built_variables
        variables = list(trainable_variables)
        loss_scale = self.scaler
        if self._built_variables is None:
            self._built_variables = variables
        by_hand = stage_of(loss_scale).take_unscaled(variables)
        if by_hand is None:
            if self._gradients_are_scaled():
                grads = loss_scale._unscale(grads, variables)
        elif by_hand == "without variables" and loss_scale.scaling_active:
            # get_unscaled_gradients cannot tell float8 state from gradients;
            # their values must reach the inner optimizer as computed.
            scale = loss_scale.loss_scale
            grads = [
                g * tf.cast(scale, g.dtype) if g is not None and overwrites_with_gradient(v) else g
                for g, v in zip(grads, variables)
            ]
        tf_step.apply_unscaled(loss_scale, self.inner_optimizer, grads, variables)

    def _gradients_are_scaled(self) -> bool:
        record = self.scaler._record
        if record is not None:
            # A model's own train_step: scaled only if it scaled a loss.
            return record.loss_scaled
        return True

    def get_scale(self) -> float:
        """The current loss scale as a Python float."""
        return self.scaler.get_scale()

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        raise NotImplementedError(
            "mp_callbacks.LossScaleOptimizer runs on the TensorFlow backend, "
            "which has no stateless_apply; use apply()."
        )

    def _warn_about_scaling(self) -> None:
        if (
            not self.scaler.scaling_active
            or self._keras_scales_the_loss
            or not self._saves_loss_scale
            or self.scaler._record is not None
        ):
            return
        if self._loss_has_been_scaled and self._gradients_have_been_unscaled:
            return
        if not self._loss_has_been_scaled and not self._gradients_have_been_unscaled:
            message = (
                "You forgot to call LossScaleOptimizer.get_scaled_loss() and "
                "LossScaleOptimizer.get_unscaled_gradients() before calling "
                "LossScaleOptimizer.apply_gradients(). This will likely result in "
                "worse model quality, so please call them in the correct places! "
                f"For example:{_SCALING_EXAMPLE}"
            )
        elif not self._loss_has_been_scaled:
            message = (
                "You forgot to call LossScaleOptimizer.get_scaled_loss() before "
                "calling LossScaleOptimizer.apply_gradients() (you did call "
                "get_unscaled_gradients() however). This will likely result in "
                "worse model quality, so please call get_scaled_loss() in the "
                f"correct place! For example:{_SCALING_EXAMPLE}"
            )
        else:
            message = (
                "You forgot to call LossScaleOptimizer.get_unscaled_gradients() "
                "before calling LossScaleOptimizer.apply_gradients() (you did call "
                "get_scaled_loss() however). The gradients were unscaled here, as "
                "Keras 3's apply_gradients does; call get_unscaled_gradients() to "
                f"unscale them yourself. For example:{_SCALING_EXAMPLE}"
            )
        warnings.warn(message, MixedPrecisionWarning, stacklevel=3)

    # ------------------------------------------------------- delegation
    def build(self, var_list: list[Any]) -> None:
        self._built_variables = list(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        self.scaler.build(var_list)
        self.built = True

    @property
    def variables(self) -> list[Any]:
        return self.inner_optimizer.variables

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        if "inner_optimizer" in self.__dict__:
            self.inner_optimizer.learning_rate = learning_rate

    @property
    def use_ema(self) -> bool:
        return self.inner_optimizer.use_ema

    @use_ema.setter
    def use_ema(self, use_ema: bool) -> None:
        if "inner_optimizer" in self.__dict__:  # Keras's __init__ sets its default first
            self.inner_optimizer.use_ema = use_ema

    @property
    def ema_momentum(self) -> float:
        return self.inner_optimizer.ema_momentum

    @ema_momentum.setter
    def ema_momentum(self, ema_momentum: float) -> None:
        if "inner_optimizer" in self.__dict__:
            self.inner_optimizer.ema_momentum = ema_momentum

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # ---------------------------------------------------- serialization

    def __dir__(self) -> list[str]:
        # Keras's weights files walk dir(): a MixedPrecisionModel's
        # optimizer writes its inner optimizer's variables as its own, so
        # that the files have a plain optimizer's layout whether or not the
        # model wraps it (earlier files, and the same model in bfloat16).
        names = super().__dir__()
        return [n for n in names if n != "inner_optimizer"] if self._saved_as_inner else names

    def save_own_variables(self, store: Any) -> None:
        if self._saved_as_inner:  # the model saves the loss scale itself
            keras.optimizers.Optimizer.save_own_variables(self, store)
            return
        # The inner optimizer saves its own slots as a child object.
        for key, value in self.scaler.get_state().items():
            store[key] = value

    def load_own_variables(self, store: Any) -> None:
        if self._saved_as_inner:
            keras.optimizers.Optimizer.load_own_variables(self, store)
            return
        self.scaler.set_state({key: store[key] for key in store.keys()})
