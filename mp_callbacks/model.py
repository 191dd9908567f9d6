"""`MixedPrecisionModel`: a `keras.Model` whose `train_step` scales the loss.

The step is the scaled-loss `tf.GradientTape` recipe of every TF 2.x guide,
done once and done right: forward pass, `compute_loss`, scale, gradients,
unscale, one global finiteness decision, then apply or skip. Every epoch's
logs carry `loss_scale`, `grad_norm` and `skipped_steps`.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any


from mp_callbacks._backend import keras, tf
from mp_callbacks._keras_internals import (
    LossScaleSaveable,
    first_batch_of_epoch_iterator,
    functional_class,
)
from mp_callbacks.errors import MixedPrecisionWarning
from mp_callbacks.loss_scale import AUTO, DynamicLossScale, loss_scale_from_argument
from mp_callbacks.model_checks import check_model

__all__ = ["MixedPrecisionModel", "LOG_KEYS"]

logger = logging.getLogger(__name__)

#: Keys that `MixedPrecisionModel.train_step` adds to the training logs.
LOG_KEYS = ("loss_scale", "grad_norm", "skipped_steps")

_AUTO = AUTO


def _global_norm_float32(grads: list[Any]) -> tf.Tensor:
    squares = []
    for grad in grads:
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            grad = grad.values
        squares.append(tf.reduce_sum(tf.square(tf.cast(grad, tf.float32))))
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.sqrt(tf.add_n(squares))


_FUNCTIONAL_VARIANTS: dict[type, type] = {}


def _is_functional_call(args: tuple, kwargs: dict) -> bool:
    # The same signature test as keras.Model's.
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def _functional_variant(cls: type) -> type:
    """`cls` with Functional mixed in, made once per class.

    keras.Model handles `SubClass(inputs, outputs)` by rewriting
    `SubClass.__bases__` in place, which would turn MixedPrecisionModel into
    a Functional-only class for the rest of the process and break every
    later subclass with its own `call`. A separate class per use keeps
    both ways of building a model working side by side.
    """
    Functional = functional_class()

    variant = _FUNCTIONAL_VARIANTS.get(cls)
    if variant is None:
        variant = type(
            cls.__name__,
            (cls, Functional),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        try:  # serialize under the name the user registered for `cls`
            from keras.src.saving import object_registration

            registered = keras.saving.get_registered_name(cls)
            object_registration.GLOBAL_CUSTOM_NAMES[variant] = registered
        except (ImportError, AttributeError):  # pragma: no cover
            pass
        _FUNCTIONAL_VARIANTS[cls] = variant
    return variant


def _in_multi_worker_mode(strategy: Any = None) -> bool:
    strategy = strategy or tf.distribute.get_strategy()
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        getattr(strategy.extended, "_in_multi_worker_mode", lambda: False)()
    )


def _for_multi_worker_reduction(logs: dict[str, Any]) -> dict[str, Any]:
    """Under MultiWorkerMirroredStrategy, Keras 3.15 reduces every step
    output with strategy.reduce("MEAN", value, axis=0), which fails on
    scalars; shape [1] reduces to the mean across replicas as a scalar.
    Elsewhere the logs are returned untouched."""
    if not _in_multi_worker_mode():
        return logs
    return {
        key: tf.reshape(value, [1]) if getattr(value, "shape", None) is not None and value.shape.rank == 0 else value
        for key, value in logs.items()
    }


class _KeptBatch:
    """The last batch whose step was skipped, kept for `diagnose_batch`.

    Variables of unknown shape, one per tensor of the batch, assigned only
    in the skip branch of the step: healthy steps do no work for it and it
    never holds more than one batch. Held in a plain object so that Keras
    does not count these variables as the model's weights.
    """

    def __init__(self) -> None:
        self.structure: Any = None
        self.variables: list[tf.Variable] | None = None
        self.step: tf.Variable | None = None

    def pairs(self, data: Any, step: Any) -> list[tuple[Any, Any]]:
        """(variable, value) pairs that keep `data` when assigned."""
        flat = [t for t in tf.nest.flatten(data) if t is not None]
        if self.variables is None:
            with tf.init_scope():
                self.variables = [
                    tf.Variable(tf.zeros([0] * len(t.shape), t.dtype), shape=tf.TensorShape(None),
                                trainable=False, name="kept_batch")
                    for t in flat
                ]
                self.step = tf.Variable(-1, dtype=tf.int64, trainable=False, name="kept_batch_step")
            # Only the layout (where the None entries are), not the tensors.
            self.structure = tf.nest.map_structure(lambda t: None if t is None else True, data)
        if len(flat) != len(self.variables) or any(
                t.dtype != v.dtype for t, v in zip(flat, self.variables)):
            return []  # another structure than the first batch's: keep nothing
        return list(zip(self.variables, flat)) + [(self.step, step)]

    def read(self) -> tuple[Any, int] | None:
        if self.variables is None or int(self.step.numpy()) < 0:
            return None
        values = iter(v.numpy() for v in self.variables)
        leaves = [None if leaf is None else next(values) for leaf in tf.nest.flatten(self.structure)]
        return tf.nest.pack_sequence_as(self.structure, leaves), int(self.step.numpy())


class _EpochSignals:
    """Per-epoch trackers, kept out of Keras's tracking on purpose.

    Held in a plain object so that `model.metrics` and `evaluate()` stay
    exactly as in stock Keras; `MixedPrecisionModel.reset_metrics` resets
    them at every epoch start.
    """

    def __init__(self) -> None:
        self.grad_norm = keras.metrics.Mean(name="grad_norm")
        self.skipped_steps = keras.metrics.Sum(name="skipped_steps")

    def reset(self) -> None:
        self.grad_norm.reset_state()
        self.skipped_steps.reset_state()


@keras.saving.register_keras_serializable(package="mp_callbacks")
class MixedPrecisionModel(keras.Model):
    """A Keras model that does loss scaling in its own `train_step`.

    Build it functionally, subclass it, or bring in an existing model with
    `MixedPrecisionModel.from_model(model)`.

    Args:
        loss_scale: `"auto"` (default): dynamic loss scaling when the model
            computes in float16 (`mixed_float16`), none otherwise (bfloat16
            has float32's range). A `DynamicLossScale` for full control; a
            number in [2**-24, 2**64] for a fixed scale; None for no
            scaling. Non-finite steps are skipped in every case.
        *args, **kwargs: as for `keras.Model`.

    `compile` never scales twice: a `keras.mixed_precision.LossScaleOptimizer`
    passed to it (the TF 2.x recipe) is unwrapped, its initial scale and
    growth steps taken over when `loss_scale="auto"`, and Keras's automatic
    wrapping under `mixed_float16` is turned off.

    Training logs gain `loss_scale` (current scale), `grad_norm` (mean global
    norm of the unscaled gradients over the epoch's applied steps) and
    `skipped_steps` (steps skipped in the epoch).

    Example:

    ```python
    import keras
    from mp_callbacks import MixedPrecisionModel

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(hidden)
    model = MixedPrecisionModel(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy")
    print(model.loss_scale)  # DynamicLossScale.fixed(1.0)
    # bfloat16 has float32's range: no scaling, but non-finite steps are
    # still skipped. history = model.fit(x, y) logs history.history[
    # "loss_scale"], ["grad_norm"] and ["skipped_steps"].
    ```
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "MixedPrecisionModel":  # pragma: no mutate block
        if _is_functional_call(args, kwargs) and not issubclass(cls, functional_class()):
            cls = _functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)

    # Keras reads this signature (auto-config): mutation trampolines would hide it.
    def __init__(self, *args: Any, loss_scale: Any = _AUTO, **kwargs: Any) -> None:  # pragma: no mutate block
        super().__init__(*args, **kwargs)
        self._loss_scale = loss_scale_from_argument(loss_scale)
        self._epoch_signals = _EpochSignals()
        self._kept_batch = _KeptBatch()
        self._checked_model = False

    # ------------------------------------------------------------ creation
    @classmethod
    def from_model(
        cls, model: keras.Model, loss_scale: Any = _AUTO, **kwargs: Any
    ) -> "MixedPrecisionModel":
        """Wraps an existing Sequential or functional model.

        The new model shares the original's layers and weights. If the
        original was compiled, the new one is compiled with the same
        optimizer object, losses and metrics.

        Args:
            model: a built `keras.Sequential` or functional `keras.Model`.
            loss_scale: as for `MixedPrecisionModel`.
            **kwargs: passed to the constructor (for example `name`).
        """
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            inputs = outputs = None
        if not inputs or not outputs:
            raise ValueError(
                "MixedPrecisionModel.from_model needs a model with known inputs "
                "and outputs (a functional model, or a Sequential that starts "
                f"with keras.Input); received model={model.name!r} of type "
                f"{type(model).__name__}. Subclassed models should subclass "
                "MixedPrecisionModel instead."
            )
        kwargs.setdefault("name", model.name)
        wrapped = cls(inputs=inputs, outputs=outputs, loss_scale=loss_scale, **kwargs)
        if getattr(model, "compiled", False):
            config = keras.saving.deserialize_keras_object(model.get_compile_config())
            config["optimizer"] = model.optimizer
            wrapped.compile(**config)
        return wrapped

    # ---------------------------------------------------------- loss scale
    @property
    def loss_scale(self) -> DynamicLossScale | None:
        """The `DynamicLossScale` in use (None until `compile` resolves
        `loss_scale="auto"`)."""
        return self._loss_scale

    def _computes_in_float16(self) -> bool:
        if self.dtype_policy.compute_dtype == "float16":
            return True
        return any(
            getattr(layer, "compute_dtype", None) == "float16"
            for layer in self._flatten_layers(include_self=False)
        )

    def _auto_loss_scale(self) -> DynamicLossScale:
        if self._computes_in_float16():
            return DynamicLossScale()
        return DynamicLossScale.disabled()

    def set_loss_scale(self, loss_scale: Any) -> None:
        """Replaces the loss scale (same values as the `loss_scale`
        argument), for example between keras-tuner trials. Training resumes
        from the new object's state; the next `fit` retraces."""
        self._loss_scale = loss_scale_from_argument(loss_scale)
        if self._loss_scale is None and self.compiled:
            self._loss_scale = self._auto_loss_scale()
        if self._loss_scale is not None and self.built:
            with self.distribute_strategy.scope():
                self._loss_scale.build(self.trainable_variables)
        self.train_function = None

    def get_loss_scale(self) -> float:
        """The current loss scale as a Python float (1.0: no scaling)."""
        if self._loss_scale is None:
            return 2.0**15 if self._computes_in_float16() else 1.0
        return self._loss_scale.get_scale()

    def kept_batch(self) -> tuple[tuple[Any, Any, Any], int] | None:
        """The last batch whose step was skipped, and that step's number.

        Returns `((x, y, sample_weight), step)` as NumPy values, `step`
        counting the loss scale's steps from 0, or None when no step has
        been skipped (or under a `tf.distribute` strategy or
        `jit_compile=True`, where batches are not kept). `diagnose_batch(model, *batch)` replays it.
        """
        return self._kept_batch.read()

    def nonfinite_gradient_counts(self) -> dict[str, int]:
        """Steps with a non-finite gradient so far, per trainable variable.

        Keys are variable paths in forward order; counting is done in-graph
        on every step, and this method reads the counters once (a host read:
        call it at epoch end or every N steps, not per batch).
        """
        if self._loss_scale is None:
            return {}
        return self._loss_scale.nonfinite_gradient_counts()

    # ------------------------------------------------------------- compile
    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        """As `keras.Model.compile`, with one loss scale guaranteed.

        `auto_scale_loss` is always turned off (this model scales the loss
        itself); a `LossScaleOptimizer` (Keras's or mp_callbacks') is
        unwrapped; a `loss_scale_factor`
        set on the optimizer becomes a fixed loss scale. The first compile
        runs `mp_callbacks.check_model` and warns once about what it finds.
        """
        if kwargs.pop("auto_scale_loss", False):
            logger.info(
                "MixedPrecisionModel scales the loss itself; "
                "auto_scale_loss=True is ignored."
            )
        from mp_callbacks.loss_scale_optimizer import LossScaleOptimizer

        optimizer = keras.optimizers.get(optimizer)
        adopted = None
        if isinstance(optimizer, LossScaleOptimizer):
            adopted = optimizer.dynamic_loss_scale
            optimizer = optimizer.inner_optimizer
        elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            adopted = DynamicLossScale(
                initial_scale=float(optimizer.initial_scale),
                growth_interval=int(optimizer.dynamic_growth_steps),
            )
            optimizer = optimizer.inner_optimizer
        elif getattr(optimizer, "loss_scale_factor", None) is not None:
            adopted = DynamicLossScale.fixed(float(optimizer.loss_scale_factor))
            optimizer.loss_scale_factor = None
        if adopted is not None:
            if self._loss_scale is None:
                self._loss_scale = adopted
                logger.info("MixedPrecisionModel adopted %r from compile().", adopted)
            else:
                logger.info(
                    "MixedPrecisionModel keeps its loss scale %r; the one "
                    "given to compile() (%r) is not applied on top.",
                    self._loss_scale,
                    adopted,
                )
        super().compile(optimizer, *args, auto_scale_loss=False, **kwargs)
        if self._loss_scale is None:
            self._loss_scale = self._auto_loss_scale()
        if self.built:
            self._loss_scale.build(self.trainable_variables)
            # Built now rather than at the first fit, so that load_weights
            # right after compile (resuming from a ModelCheckpoint) restores
            # the optimizer's slots too instead of skipping them.
            if not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)
        self._warn_about_findings()

    def _warn_about_findings(self) -> None:
        if self._checked_model:
            return
        self._checked_model = True
        findings = check_model(self)
        if findings:
            warnings.warn(
                f"check_model found {len(findings)} mixed-precision issue(s) in "
                f"{self.name!r}:\n" + "\n".join(f"  - {f}" for f in findings),
                MixedPrecisionWarning,
                stacklevel=3,
            )

    def compile_from_config(self, config: dict[str, Any]) -> None:
        # Keras skips compile_from_config for models that override compile.
        self.compile(**keras.saving.deserialize_keras_object(config))

    def make_train_function(self, force: bool = False):
        if self._loss_scale is None:
            raise RuntimeError(
                "MixedPrecisionModel must be compiled before training."
            )
        with self.distribute_strategy.scope():
            self._loss_scale.build(self.trainable_variables)
        return super().make_train_function(force=force)

    # ---------------------------------------------------------------- steps
    def train_step(self, data: Any) -> dict[str, Any]:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss_scale = self._loss_scale
        num_replicas = tf.distribute.get_strategy().num_replicas_in_sync

        # The forward pass updates some state itself (BatchNormalization's
        # moving statistics, RNG seeds): read it first, so that a skipped
        # step can put it back. Reads are free until a write copies.
        forward_state = self.non_trainable_variables
        state_before = [tf.identity(v.value) for v in forward_state]
        with tf.GradientTape() as tape:
            if self._call_has_training_arg:
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            batch_size = tf.shape(
                next(t for t in tf.nest.flatten(x) if t is not None)
            )[0]
            # Keras divides the loss by the replica count under tf.distribute.
            self._loss_tracker.update_state(loss * num_replicas, sample_weight=batch_size)
            scaled_loss = loss_scale.scale(loss)

        variables = self.trainable_variables
        if not variables:
            logger.warning("The model does not have any trainable weights.")
            # Nothing to apply is not a skipped step: no overflow happened.
            applied = tf.constant(True)
            grad_norm = tf.constant(0.0)
        else:
            grads = loss_scale.unscale(tape.gradient(scaled_loss, variables), variables)
            # One pass over the gradients gives both finiteness and the norm
            # (float8 state variables' "gradients" are values: not counted).
            checked = loss_scale.check_gradients(grads)
            overwrite = [bool(getattr(v, "overwrite_with_gradient", False)) for v in variables]
            grad_norm = checked.global_norm if not any(overwrite) else _global_norm_float32(
                [g for g, skip in zip(grads, overwrite) if not skip]
            )
            if num_replicas > 1:
                grad_norm = grad_norm * num_replicas
            restore = list(zip(forward_state, state_before))
            # XLA cannot reshape a variable, and under tf.distribute each
            # replica has its own shard: the batch is kept only where a
            # plain eager replay of it is meaningful.
            if num_replicas == 1 and self.jit_compile is not True:
                # The step number the batch would have had (0-based count
                # of steps seen), kept with it on a skip.
                restore += self._kept_batch.pairs(
                    (x, y, sample_weight), loss_scale._state["step_count"].read_value()
                )
            applied = loss_scale.apply_gradients(
                self.optimizer, grads, variables, loss=loss, restore_on_skip=restore,
                checked=checked,
            )
        signals = self._epoch_signals
        signals.grad_norm.update_state(
            tf.where(applied, grad_norm, 0.0),
            sample_weight=tf.cast(applied, tf.float32),
        )
        signals.skipped_steps.update_state(1.0 - tf.cast(applied, tf.float32))

        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        logs = dict(logs)
        logs["loss_scale"] = loss_scale.current_scale()
        logs["grad_norm"] = signals.grad_norm.result()
        logs["skipped_steps"] = signals.skipped_steps.result()
        return _for_multi_worker_reduction(logs)

    def test_step(self, data: Any) -> dict[str, Any]:
        return _for_multi_worker_reduction(super().test_step(data))

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras 3.15 reduces a distributed batch with strategy.reduce("MEAN")
        # only to learn its shapes and dtypes, which fails under
        # MultiWorkerMirroredStrategy; one local replica's batch has them.
        if iterator is not None and _in_multi_worker_mode(self.distribute_strategy):
            batch = first_batch_of_epoch_iterator(iterator)
            if batch is None:
                return None
            local = self.distribute_strategy.experimental_local_results
            data_batch = tf.nest.map_structure(
                lambda v: local(v)[0] if isinstance(v, tf.distribute.DistributedValues) else v,
                batch,
            )
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self._epoch_signals.reset()

    # ---------------------------------------------------------- save / load
    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if self._loss_scale is None:
            config["loss_scale"] = _AUTO
        else:
            config["loss_scale"] = keras.saving.serialize_keras_object(
                self._loss_scale
            )
        return config

    @property
    def _loss_scale_state(self) -> LossScaleSaveable:
        # Keras's saver finds this attribute and stores the loss scale under
        # its own path, apart from the model's variables, so that a plain
        # keras.Model with the same layers loads these weights (serving).
        saveable = self.__dict__.get("_mp_loss_scale_saveable")
        if saveable is None or saveable._get_loss_scale() is not self._loss_scale:
            saveable = LossScaleSaveable(lambda: self._loss_scale)
            self.__dict__["_mp_loss_scale_saveable"] = saveable
        return saveable

    def load_own_variables(self, store: Any) -> None:
        # Weights written by earlier releases kept the loss scale among the
        # model's own entries, under this prefix.
        prefix = "mp_loss_scale."
        keys = list(store.keys())
        legacy = {k[len(prefix):]: store[k] for k in keys if k.startswith(prefix)}
        super().load_own_variables({k: store[k] for k in keys if not k.startswith(prefix)})
        if legacy and self._loss_scale is not None:
            self._loss_scale.set_state(legacy)

    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """As `keras.Model.load_weights`, but all or nothing: if loading
        fails (another architecture, a corrupted loss scale), the model's
        weights, optimizer state and loss-scale state are left as they were
        and the error is raised."""
        variables = list(self.variables)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None:
            variables += [v for v in optimizer.variables if all(v is not w for w in variables)]
        saved_values = [v.numpy() for v in variables]
        saved_state = self._loss_scale.get_state() if self._loss_scale is not None else None
        try:
            super().load_weights(filepath, *args, **kwargs)
        except BaseException:
            for variable, value in zip(variables, saved_values):
                variable.assign(value)
            if saved_state is not None:
                self._loss_scale.set_state(saved_state)
            raise
