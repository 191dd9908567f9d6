"""`LossScaleOptimizer`: the Keras 2 custom-loop contract on Keras 3.

Every TF 2.x mixed-precision guide teaches, for hand-written loops,

    scaled_loss = optimizer.get_scaled_loss(loss)
    scaled_grads = tape.gradient(scaled_loss, variables)
    grads = optimizer.get_unscaled_gradients(scaled_grads)
    optimizer.apply_gradients(zip(grads, variables))

and on Keras 3 that fails with AttributeError: `get_scaled_loss` and
`get_unscaled_gradients` are gone (keras-team/keras#19479, #20894). This
wrapper brings them back on top of `DynamicLossScale`: `apply_gradients`
takes *unscaled* gradients (no double unscaling), skips the step when any
is non-finite and updates the dynamic scale.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable

from mp_callbacks._backend import keras, tf
from mp_callbacks._validation import check_int, fail
from mp_callbacks.errors import MixedPrecisionWarning
from mp_callbacks.loss_scale import DynamicLossScale, check_fixed_scale, loss_scale_from_argument

__all__ = ["LossScaleOptimizer"]

logger = logging.getLogger(__name__)

_OWNER = "LossScaleOptimizer"
# Keras's base-optimizer arguments: accepted at their defaults (configs
# written by Keras carry them), refused otherwise: set them on the inner one.
_BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
# Hyperparameters Keras's base optimizer stores on the wrapper too; after
# construction they are read from and written to the inner optimizer.
_DELEGATED = frozenset(set(_BASE_DEFAULTS) - {"loss_scale_factor"})
_SCALING_EXAMPLE = """
    with tf.GradientTape() as tape:
      loss = loss_fn()
      scaled_loss = opt.get_scaled_loss(loss)
    scaled_grads = tape.gradient(scaled_loss, vars)
    grads = opt.get_unscaled_gradients(scaled_grads)
    opt.apply_gradients([(grads, var)])"""


def _overwrites_with_gradient(variable: Any) -> bool:
    # float8 layers' scale and amax-history variables: their "gradient" is
    # their next value, which must be neither unscaled nor optimized.
    return bool(getattr(variable, "overwrite_with_gradient", False))


@keras.saving.register_keras_serializable(package="mp_callbacks")
class LossScaleOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer with the Keras 2 loss-scaling methods.

    Takes tf.keras's signature, so that TF 2.x code runs with only its
    import changed, and `DynamicLossScale`'s finer settings as keywords.

    Args:
        inner_optimizer: the Keras optimizer that applies the updates. Its
            own `loss_scale_factor` is cleared (as Keras's wrapper does),
            since the gradients would otherwise be unscaled twice.
        dynamic: True (default) for a dynamic loss scale; False for a
            fixed one, which needs `initial_scale`.
        initial_scale: the starting (or, with `dynamic=False`, the fixed)
            scale; default 2**15 for a dynamic scale.
        dynamic_growth_steps: finite steps between growths (default 2000);
            only for a dynamic scale. `growth_interval` is the same.
        growth_interval, growth_factor, backoff_factor, min_scale,
        max_scale, hysteresis: keywords, as for `DynamicLossScale`.
        loss_scale: instead of the arguments above, a ready
            `DynamicLossScale`, its config dict, or a number in
            [2**-24, 2**64] (a fixed scale, as is `initial_scale` with
            `dynamic=False`).
        name: optimizer name.

    Attributes (as in tf.keras): `inner_optimizer`, `dynamic`,
    `initial_scale`, `dynamic_growth_steps` (None when fixed),
    `dynamic_counter` (the finite-step counter variable, None when fixed),
    `loss_scale` (the current scale, a float32 tensor). Also
    `dynamic_loss_scale`, the `DynamicLossScale` doing the work, and
    `get_scale()`, the current scale as a Python float. Hyperparameters
    (`learning_rate`, `use_ema`, `clipnorm`, the inner optimizer's own such
    as `momentum`) are read from and set on the inner optimizer.

    In `model.fit`, use `MixedPrecisionModel` (whose `compile` unwraps this
    optimizer and adopts its loss scale). `scale_loss`, the hook Keras 3's
    own `train_step` calls, returns the loss unchanged so that a stock
    model cannot unscale twice; there the wrapper only skips non-finite
    steps.

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
        loss_scale: DynamicLossScale | dict | float | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(inner_optimizer, (keras.optimizers.LossScaleOptimizer, LossScaleOptimizer)):
            raise TypeError(
                "LossScaleOptimizer cannot wrap another LossScaleOptimizer, but got: "
                f"{inner_optimizer!r}: it would scale the loss twice."
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                '"inner_optimizer" must be an instance of keras.optimizers.Optimizer, '
                f"but got: {inner_optimizer!r}."
            )
        if getattr(inner_optimizer, "_mp_wrapped_by_loss_scale_optimizer", False):
            raise ValueError(
                '"inner_optimizer" is already wrapped by a LossScaleOptimizer. An '
                "optimizer can only be wrapped by a single LossScaleOptimizer: "
                "two wrappers would each keep a scale and both step the same "
                "optimizer."
            )
        if not isinstance(dynamic, bool):
            raise TypeError(
                '"dynamic" argument to LossScaleOptimizer.__init__ must be a bool, '
                f"but got: {dynamic!r}"
            )
        for argument, default in _BASE_DEFAULTS.items():
            if argument in kwargs:
                value = kwargs.pop(argument)
                if value != default:
                    raise ValueError(
                        f"LossScaleOptimizer does not take `{argument}`; set "
                        f"{argument}={value!r} on the inner optimizer instead."
                    )
        if kwargs:
            raise TypeError(
                "LossScaleOptimizer got unexpected keyword argument(s) "
                f"{', '.join(map(repr, sorted(kwargs)))}."
            )
        settings = {
            "initial_scale": initial_scale,
            "growth_interval": growth_interval,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "min_scale": min_scale,
            "max_scale": max_scale,
            "hysteresis": hysteresis,
        }
        if dynamic_growth_steps is not None:
            if not dynamic:
                raise ValueError(
                    '"dynamic_growth_steps" must be None if "dynamic" is False, '
                    f"but got: {dynamic_growth_steps!r}"
                )
            dynamic_growth_steps = check_int(_OWNER, "dynamic_growth_steps", dynamic_growth_steps, low=1)
            if growth_interval is not None and growth_interval != dynamic_growth_steps:
                raise ValueError(
                    f"{_OWNER}: `dynamic_growth_steps` and `growth_interval` are the same "
                    f"setting and disagree; received dynamic_growth_steps="
                    f"{dynamic_growth_steps!r}, growth_interval={growth_interval!r}."
                )
            settings["growth_interval"] = dynamic_growth_steps
        given = {key: value for key, value in settings.items() if value is not None}
        if loss_scale is not None:
            if given or not dynamic:
                names = sorted(given) + ([] if dynamic else ["dynamic"])
                raise ValueError(
                    f"{_OWNER}: pass either `loss_scale` or the scale's settings "
                    f"({', '.join(names)}), not both; received loss_scale={loss_scale!r} "
                    f"with {', '.join(f'{k}={v!r}' for k, v in given.items()) or 'dynamic=False'}."
                )
            self_loss_scale = _loss_scale_from_argument(loss_scale)
        elif dynamic:
            self_loss_scale = DynamicLossScale(**given)
        else:
            extra = sorted(set(given) - {"initial_scale"})
            if initial_scale is None:
                raise ValueError(
                    '"initial_scale" must be specified if "dynamic" is False: it is '
                    "the fixed loss scale."
                )
            if extra:
                raise ValueError(
                    f"{_OWNER}: {', '.join(extra)} only apply to a dynamic loss scale, "
                    "but dynamic=False."
                )
            self_loss_scale = DynamicLossScale.fixed(
                check_fixed_scale(_OWNER, "initial_scale", initial_scale)
            )
        super().__init__(learning_rate=0.0, name=name)
        if inner_optimizer.loss_scale_factor is not None:
            logger.info(
                "LossScaleOptimizer: the inner optimizer's loss_scale_factor=%r is "
                "cleared; the loss scale is this wrapper's.",
                inner_optimizer.loss_scale_factor,
            )
            inner_optimizer.loss_scale_factor = None
        self.inner_optimizer = inner_optimizer
        self.dynamic_loss_scale = self_loss_scale
        inner_optimizer._mp_wrapped_by_loss_scale_optimizer = True
        self._loss_has_been_scaled = False
        self._gradients_have_been_unscaled = False
        for attribute in _DELEGATED:  # from now on read from the inner optimizer
            self.__dict__.pop(attribute, None)
        self.__dict__["_mp_delegating"] = True

    # ------------------------------------------- tf.keras's attributes
    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic."""
        return self.dynamic_loss_scale.is_dynamic

    @property
    def initial_scale(self) -> float:
        return self.dynamic_loss_scale.initial_scale

    @property
    def dynamic_growth_steps(self) -> int | None:
        return self.dynamic_loss_scale.growth_interval if self.dynamic else None

    @property
    def dynamic_counter(self) -> Any:
        """Finite steps since the last growth or overflow (None when fixed)."""
        return self.dynamic_loss_scale._state["good_steps"] if self.dynamic else None

    @property
    def loss_scale(self) -> tf.Tensor:
        """The current loss scale, a float32 tensor (as in tf.keras)."""
        return self.dynamic_loss_scale.current_scale()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the wrapper lacks: the inner
        # optimizer's hyperparameters (momentum, beta_1, use_ema, ...).
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_mp_delegating") and not name.startswith("_") and (
            name in _DELEGATED
            or (name not in self.__dict__ and not hasattr(type(self), name)
                and hasattr(self.__dict__["inner_optimizer"], name))
        ):
            setattr(self.__dict__["inner_optimizer"], name, value)
            return
        super().__setattr__(name, value)

    # ---------------------------------------------------- the Keras 2 API
    @tf.autograph.experimental.do_not_convert
    def get_scaled_loss(self, loss: Any) -> Any:
        """`loss` multiplied by the current scale; for a callable `loss`, a
        callable that returns the scaled loss (as in tf.keras)."""
        self._loss_has_been_scaled = True
        if callable(loss):
            def scaled_loss() -> Any:
                return self.dynamic_loss_scale.scale(loss())

            return scaled_loss
        return self.dynamic_loss_scale.scale(loss)

    @tf.autograph.experimental.do_not_convert
    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """Each gradient divided by the current scale (None passes through)."""
        self._gradients_have_been_unscaled = True
        return self.dynamic_loss_scale.unscale(grads)

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """Applies *unscaled* gradients if all are finite; updates the scale.

        Returns the inner optimizer's iteration count, as Keras does.
        """
        self._warn_about_scaling()
        grads, variables = zip(*grads_and_vars)
        grads, variables = list(grads), list(variables)
        if self._gradients_have_been_unscaled and self.dynamic_loss_scale.scaling_active:
            # get_unscaled_gradients cannot tell float8 state from gradients;
            # their values must reach the inner optimizer as computed.
            scale = self.dynamic_loss_scale.current_scale()
            grads = [
                g * tf.cast(scale, g.dtype) if g is not None and _overwrites_with_gradient(v) else g
                for g, v in zip(grads, variables)
            ]
        self.apply(grads, variables)
        return self.iterations

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads: Iterable[Any], trainable_variables: Iterable[Any] | None = None) -> None:
        if trainable_variables is None:
            raise ValueError(
                "LossScaleOptimizer.apply needs `trainable_variables` alongside the gradients."
            )
        self.dynamic_loss_scale.apply_gradients(self.inner_optimizer, grads, trainable_variables)

    def get_scale(self) -> float:
        """The current loss scale as a Python float."""
        return self.dynamic_loss_scale.get_scale()

    def scale_loss(self, loss: Any) -> Any:
        # Keras 3's stock train_step would pass scaled gradients to
        # apply_gradients, which here takes unscaled ones: do not scale.
        # Being asked means Keras's own fit drives this wrapper, which then
        # only skips non-finite steps: not a forgotten scaling.
        self._driven_by_keras_fit = True
        return loss

    def _warn_about_scaling(self) -> None:
        if not self.dynamic_loss_scale.scaling_active or self.__dict__.get("_driven_by_keras_fit"):
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
                "get_scaled_loss() however). This will likely result in worse model "
                "quality, so please call get_unscaled_gradients() in the correct "
                f"place! For example:{_SCALING_EXAMPLE}"
            )
        warnings.warn(message, MixedPrecisionWarning, stacklevel=3)

    # ------------------------------------------------------- delegation
    def build(self, var_list: list[Any]) -> None:
        self.inner_optimizer.build(var_list)
        self.dynamic_loss_scale.build(var_list)
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

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------ checkpoints
    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict[str, Any]:
        # As tf.keras does: the wrapper shows the inner optimizer's own
        # checkpoint entries, plus its loss scale, so that a checkpoint of a
        # plain optimizer restores into a wrapped one (iterations, slots) and
        # the other way round.
        if not self.__dict__.get("_mp_delegating"):
            return super()._trackable_children(save_type, **kwargs)
        children = dict(self.inner_optimizer._trackable_children(save_type, **kwargs))
        children["loss_scale"] = self.dynamic_loss_scale
        return children

    def _lookup_dependency(self, name: str, cached_dependencies: Any = None) -> Any:
        if not self.__dict__.get("_mp_delegating"):
            return super()._lookup_dependency(name, cached_dependencies)
        if name == "loss_scale":
            return self.dynamic_loss_scale
        return self.inner_optimizer._lookup_dependency(name, cached_dependencies)

    # ---------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": self.dynamic_loss_scale.get_config(),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> "LossScaleOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)

    def save_own_variables(self, store: Any) -> None:
        # The inner optimizer saves its own slots as a child object.
        for key, value in self.dynamic_loss_scale.get_state().items():
            store[key] = value

    def load_own_variables(self, store: Any) -> None:
        prefix = "mp_loss_scale."  # earlier releases' key names
        self.dynamic_loss_scale.set_state(
            {key[len(prefix):] if key.startswith(prefix) else key: store[key] for key in store.keys()}
        )


def _loss_scale_from_argument(value: Any) -> DynamicLossScale:
    if isinstance(value, str) or (isinstance(value, dict) and not value):
        fail(_OWNER, "loss_scale", value,
             "a DynamicLossScale, its config dict, or a number in [2**-24, 2**64] (fixed scale)",
             ValueError if isinstance(value, (str, dict)) else TypeError)
    if isinstance(value, dict):
        return DynamicLossScale.from_config(value)
    return loss_scale_from_argument(value, owner=_OWNER)
