"""`LossScaleOptimizer`: the Keras 2 custom-loop contract on Keras 3.

Every TF 2.x mixed-precision guide (the seed's section 3.4 included) teaches

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

from typing import Any, Iterable

from mp_callbacks._backend import keras
from mp_callbacks.loss_scale import DynamicLossScale

__all__ = ["LossScaleOptimizer"]


@keras.saving.register_keras_serializable(package="mp_callbacks")
class LossScaleOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer with the Keras 2 loss-scaling methods.

    Args:
        inner_optimizer: the optimizer that applies the updates.
        initial_scale, growth_interval, growth_factor, backoff_factor,
        min_scale, max_scale, hysteresis: as for `DynamicLossScale`.
        loss_scale: a ready `DynamicLossScale` instead of the arguments above.
        name: optimizer name.

    Attributes:
        loss_scale: the `DynamicLossScale` doing the work.

    In `model.fit`, use `MixedPrecisionModel` (whose `compile` unwraps this
    optimizer and adopts its loss scale). `scale_loss`, the hook Keras 3's
    own `train_step` calls, returns the loss unchanged so that a stock
    model cannot unscale twice; there the wrapper only skips non-finite
    steps.

    Example (the seed's loop, unchanged but for the import):

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
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        loss_scale: DynamicLossScale | dict | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "LossScaleOptimizer: `inner_optimizer` must be a Keras optimizer; "
                f"received inner_optimizer={inner_optimizer!r}."
            )
        if isinstance(inner_optimizer, (keras.optimizers.LossScaleOptimizer, LossScaleOptimizer)):
            raise ValueError(
                "LossScaleOptimizer: `inner_optimizer` is already a loss-scale "
                f"optimizer ({type(inner_optimizer).__name__}); wrapping it again "
                "would scale twice."
            )
        if kwargs:
            raise ValueError(
                "LossScaleOptimizer does not take optimizer arguments "
                f"({', '.join(sorted(kwargs))}); set them on the inner optimizer."
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        if isinstance(loss_scale, dict):
            loss_scale = DynamicLossScale.from_config(loss_scale)
        self.loss_scale = loss_scale or DynamicLossScale(
            initial_scale=initial_scale,
            growth_interval=growth_interval,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
        )

    # ---------------------------------------------------- the Keras 2 API
    def get_scaled_loss(self, loss: Any) -> Any:
        """`loss` multiplied by the current scale."""
        return self.loss_scale.scale(loss)

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """Each gradient divided by the current scale (None passes through)."""
        return self.loss_scale.unscale(grads)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """Applies *unscaled* gradients if all are finite; updates the scale.

        Returns the inner optimizer's iteration count, as Keras does.
        """
        grads, variables = zip(*grads_and_vars)
        self.apply(list(grads), list(variables))
        return self.iterations

    def apply(self, grads: Iterable[Any], trainable_variables: Iterable[Any] | None = None) -> None:
        if trainable_variables is None:
            raise ValueError(
                "LossScaleOptimizer.apply needs `trainable_variables` alongside the gradients."
            )
        self.loss_scale.apply_gradients(self.inner_optimizer, grads, trainable_variables)

    def get_scale(self) -> float:
        """The current loss scale as a Python float."""
        return self.loss_scale.get_scale()

    def scale_loss(self, loss: Any) -> Any:
        # Keras 3's stock train_step would pass scaled gradients to
        # apply_gradients, which here takes unscaled ones: do not scale.
        return loss

    # ------------------------------------------------------- delegation
    def build(self, var_list: list[Any]) -> None:
        self.inner_optimizer.build(var_list)
        self.loss_scale.build(var_list)
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
        self.inner_optimizer.learning_rate = learning_rate

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    # ---------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": self.loss_scale.get_config(),
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
        self.loss_scale.save_to_store(store)

    def load_own_variables(self, store: Any) -> None:
        self.loss_scale.load_from_store(store)
