"""`MixedPrecisionModel`: a `keras.Model` whose `train_step` scales the loss.

The step is the scaled-loss `tf.GradientTape` recipe of every TF 2.x guide,
done once and done right: forward pass, `compute_loss`, scale, gradients,
unscale, one global finiteness decision, then apply or skip. Every epoch's
logs carry `loss_scale`, `grad_norm` and `skipped_steps`.

A subclass's own `train_step` is kept just as safe: the model trains
through a `LossScaleOptimizer` sharing its loss scale, and the train
function runs every training step as one recorded step
(`recorded_train_step`, `mp_callbacks.backends.tensorflow.step_record`):
the scale moves once at its end, and the step is reported in the same log
keys.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from mp_callbacks._backend import keras, tf
from mp_callbacks._float8 import gradient_state
from mp_callbacks._keras_internals import (
    LossScaleSaveable,
    MultiWorkerSymbolicBuild,
    call_has_training_arg,
    compute_loss,
    in_multi_worker_mode,
    keras_default_method,
    loss_tracker,
    make_step_function,
)
from mp_callbacks._loss_scale_argument import AUTO
from mp_callbacks._model_base import ModelBase
from mp_callbacks._model_building import (
    LOG_KEYS,
    construct,
    default_optimizer_argument,
)
from mp_callbacks.backends.tensorflow import step as tf_step
from mp_callbacks.backends.tensorflow.forward_writes import written_variables
from mp_callbacks.backends.tensorflow.loss_scaling import LossScaling
from mp_callbacks.backends.tensorflow.step_record import StepRecord
from mp_callbacks.errors import MixedPrecisionWarning
from mp_callbacks.loss_scale import LossScaler, loss_scale_from_argument
from mp_callbacks.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["LOG_KEYS", "MixedPrecisionModel"]

logger = logging.getLogger(__name__)

_AUTO = AUTO


_SCALE_THE_LOSS = (
    "add `loss = self.optimizer.scale_loss(loss)` inside the GradientTape, as Keras's "
    "own train_step does (or, for another optimizer, `scaled_loss = "
    "self.scaler.scale(loss)` there and `self.scaler.step(optimizer, "
    "tape.gradient(scaled_loss, variables), variables)`)"
)


def _batch_size(data: Any) -> tf.Tensor:
    """The number of samples in a batch: its first tensor's first dimension."""
    first = next(t for t in tf.nest.flatten(data) if t is not None)
    if isinstance(first, tf.SparseTensor):
        return first.dense_shape[0]
    if isinstance(first, tf.RaggedTensor):
        return first.nrows()
    return tf.shape(first)[0]


def _in_float32(loss: Any) -> Any:
    dtype = keras.backend.standardize_dtype(loss.dtype)
    if dtype in ("float16", "bfloat16"):
        return keras.ops.cast(loss, "float32")
    return loss


def _in_multi_worker_mode(strategy: Any = None) -> bool:
    strategy = strategy or tf.distribute.get_strategy()
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and in_multi_worker_mode(strategy)


def _for_multi_worker_reduction(logs: dict[str, Any]) -> dict[str, Any]:
    """Under MultiWorkerMirroredStrategy, Keras 3.15 reduces every step
    output with strategy.reduce("MEAN", value, axis=0), which fails on
    scalars; shape [1] reduces to the mean across replicas as a scalar.
    Elsewhere the logs are returned untouched."""
    if not _in_multi_worker_mode():
        return logs
    return {
        key: tf.reshape(value, [1])
        if getattr(value, "shape", None) is not None and value.shape.rank == 0
        else value
        for key, value in logs.items()
    }


class _KeptBatch:
    """The last batch whose step was skipped, kept for `diagnose_batch`.

    Variables, one per tensor of the batch, assigned only in the skip
    branch of the step: healthy steps do no work for it. Without XLA they
    have no fixed shape, so one set holds any batch; XLA cannot give a
    variable a new shape, so under `jit_compile=True` there is one set per
    batch shape (a full batch and an epoch's last, smaller one: XLA traces
    each shape anyway), each with the step it was kept at, and `read` gives
    the latest. Held in a plain object so that Keras does not count these
    variables as the model's weights.
    """

    def __init__(self) -> None:
        self.structure: Any = None
        # key -> (variables, step variable); key None: the shapeless set.
        self.sets: dict[Any, tuple[list[Any], Any]] = {}
        self.not_kept: str | None = None

    def pairs(self, data: Any, step: Any, fixed_shapes: bool = False) -> list[tuple[Any, Any]]:
        """(variable, value) pairs that keep `data` when assigned; none for
        a batch with sparse or ragged tensors, which a variable cannot hold,
        or (with `fixed_shapes`, for XLA) one whose shapes are not static
        (`not_kept` then says so)."""
        flat = [t for t in tf.nest.flatten(data) if t is not None]
        if any(isinstance(t, (tf.SparseTensor, tf.RaggedTensor)) for t in flat):
            self.not_kept = "its inputs are sparse or ragged tensors, which are not kept"
            return []
        if fixed_shapes and not all(t.shape.is_fully_defined() for t in flat):
            self.not_kept = (
                "with jit_compile=True its shapes are not static, and XLA keeps only static shapes"
            )
            return []
        if self.structure is None:
            # Only the layout (where the None entries are), not the tensors.
            self.structure = tf.nest.map_structure(lambda t: None if t is None else True, data)
        first = next(iter(self.sets.values()), None)
        if first is not None and [t.dtype for t in flat] != [v.dtype for v in first[0]]:
            # Checked before any variable is made: a retrace (a new batch
            # structure) may not create variables in Keras's tf.function.
            self.not_kept = "its structure differs from the first batch's, and only that one is kept"
            return []
        key = tuple((tuple(t.shape), t.dtype.name) for t in flat) if fixed_shapes else None
        if key not in self.sets:
            try:
                with tf.init_scope():
                    variables = [
                        tf.Variable(
                            tf.zeros(t.shape if fixed_shapes else [0] * len(t.shape), t.dtype),
                            shape=t.shape if fixed_shapes else tf.TensorShape(None),
                            trainable=False,
                            name="kept_batch",
                        )
                        for t in flat
                    ]
                    step_variable = tf.Variable(-1, dtype=tf.int64, trainable=False, name="kept_batch_step")
            except ValueError:
                # tf.function refuses variables made after its first call
                # (XLA retracing for a new static shape): keep nothing then.
                self.not_kept = (
                    "with jit_compile=True a batch of a new shape after the first step is not kept"
                )
                return []
            self.sets[key] = (variables, step_variable)
        variables, step_variable = self.sets[key]
        return list(zip(variables, flat)) + [(step_variable, step)]

    def read(self) -> tuple[Any, int] | None:
        kept = [(int(step.numpy()), variables) for variables, step in self.sets.values()]
        kept = [entry for entry in kept if entry[0] >= 0]
        if not kept:
            return None
        step, variables = max(kept, key=lambda entry: entry[0])
        values = iter(v.numpy() for v in variables)
        leaves = [None if leaf is None else next(values) for leaf in tf.nest.flatten(self.structure)]
        return tf.nest.pack_sequence_as(self.structure, leaves), step


class _EpochSignals:
    """Per-epoch trackers, kept out of Keras's tracking on purpose.

    Held in a plain object so that `model.metrics` and `evaluate()` stay
    exactly as in stock Keras; `MixedPrecisionModel.reset_metrics` resets
    them at every epoch start.
    """

    def __init__(self) -> None:
        self.grad_norm = keras.metrics.Mean(name="grad_norm")
        self.skipped_steps = keras.metrics.Sum(name="skipped_steps")
        self.samples = keras.metrics.Sum(name="samples")

    def reset(self) -> None:
        self.grad_norm.reset_state()
        self.skipped_steps.reset_state()
        self.samples.reset_state()


@keras.saving.register_keras_serializable(package="mp_callbacks")
class MixedPrecisionModel(MultiWorkerSymbolicBuild, ModelBase):
    """A Keras model that does loss scaling in its own `train_step`.

    Build it functionally, subclass it (with your own `call`, or your own
    graph built in `__init__`), or bring in an existing model with
    `MixedPrecisionModel.from_model(model)`.

    Args:
        loss_scale: `"auto"`, `LossScaler`, float or None. `"auto"`:
            dynamic loss scaling when the model computes in float16
            (`mixed_float16`), none otherwise (bfloat16 has float32's
            range). A `LossScaler` for full control; a number in
            [2**-24, 2**64] for a fixed scale; None for no scaling.
            Non-finite steps are skipped in every case. Defaults to
            `"auto"`.
        *args: as for `keras.Model` (`inputs`, `outputs`).
        **kwargs: as for `keras.Model` (`inputs`, `outputs`, `name`).

    Raises:
        ValueError: `loss_scale` is a string other than `"auto"`, or a
            number outside [2**-24, 2**64].
        TypeError: `loss_scale` is of another type.

    `compile` never scales twice: a `keras.mixed_precision.LossScaleOptimizer`
    passed to it (the TF 2.x recipe) is unwrapped, its initial scale and
    growth steps taken over when `loss_scale="auto"`, and Keras's automatic
    wrapping under `mixed_float16` is turned off. `auto_scale_loss=False`
    means no scaling, as in Keras (non-finite steps are still skipped).

    Training logs gain `loss_scale` (current scale), `grad_norm` (mean global
    norm of the unscaled gradients over the epoch's applied steps; NaN for
    an epoch without one) and `skipped_steps` (steps skipped in the epoch).

    Your own `train_step` (a GAN, a VAE, a custom loss) is kept as safe:
    `self.optimizer` is then a `LossScaleOptimizer` sharing the model's
    loss scale, so a non-finite update is never applied through it, and
    each step is reported in the same log keys. To scale the loss, add
    `loss = self.optimizer.scale_loss(loss)` inside the tape (Keras 3's
    spelling; tf.keras's `get_scaled_loss` / `get_unscaled_gradients` work
    too), or, for other optimizers, `self.scaler.scale(loss)` and
    `self.scaler.step(optimizer, grads, variables)`. The scale moves
    once per training step, whatever the number of optimizers.

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
    print(model.scaler)  # LossScaler.fixed(1.0)
    # bfloat16 has float32's range: no scaling, but non-finite steps are
    # still skipped. history = model.fit(x, y) logs history.history[
    # "loss_scale"], ["grad_norm"] and ["skipped_steps"].
    ```
    """

    _loss_scale: Any  # a LossScaler once compiled (None before, for "auto")
    _mp_chosen_by: str | None
    _epoch_signals: _EpochSignals
    _kept_batch: _KeptBatch
    _warned_unscaled_step: bool

    def __init__(self, *args: Any, loss_scale: Any = _AUTO, **kwargs: Any) -> None:
        scaler = loss_scale_from_argument(loss_scale)
        # Set before the constructors below run: a KerasHub task adopted by
        # a subclass (`class MyLM(MixedPrecisionModel, GPT2CausalLM)`)
        # compiles inside its own constructor.
        attributes = {
            "_loss_scale": scaler,
            # Who chose the loss scale: the user, or compile ("auto", or no
            # scaling for auto_scale_loss=False), which may choose again.
            "_mp_chosen_by": "user" if scaler is not None else None,
            "_epoch_signals": _EpochSignals(),
            "_kept_batch": _KeptBatch(),
            "_warned_unscaled_step": False,
        }
        for name, value in attributes.items():
            object.__setattr__(self, name, value)
        construct(self, args, kwargs, lambda: super(MixedPrecisionModel, self).__init__(*args, **kwargs))
        if self.__dict__.get("_loss_scale") is scaler:  # tracked as before (TF checkpoints)
            del self.__dict__["_loss_scale"]
            self._loss_scale = scaler

    # ---------------------------------------------------------- loss scale
    @property
    def scaler(self) -> LossScaler | None:
        """The `LossScaler` in use (None until `compile` resolves
        `loss_scale="auto"`)."""
        return self._loss_scale

    @property
    def loss_scale(self) -> Any:
        """The current loss scale, a float32 tensor (as on
        `LossScaleOptimizer` and in the logs); None before `compile`."""
        return None if self._loss_scale is None else self._loss_scale.loss_scale

    def _auto_loss_scale(self) -> LossScaler:
        if self._computes_in_float16():
            return LossScaler()
        return LossScaler.disabled()

    def set_loss_scale(self, loss_scale: Any) -> None:
        """Replaces the loss scale (same values as the `loss_scale`
        argument), for example between keras-tuner trials. Training resumes
        from the new object's state; the next `fit` retraces."""
        self._loss_scale = loss_scale_from_argument(loss_scale)
        self._mp_chosen_by = "user" if self._loss_scale is not None else None
        if self._loss_scale is None and self.compiled:
            self._loss_scale = self._auto_loss_scale()
            self._mp_chosen_by = "auto"
        if self._loss_scale is not None and self.built:
            with self.distribute_strategy.scope():
                self._loss_scale.build(self.trainable_variables)
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, LossScaleOptimizer) and not optimizer._saves_loss_scale:
            optimizer.scaler = self._loss_scale
        self.train_function = None

    def get_scale(self) -> float:
        """The current loss scale as a Python float (1.0: no scaling)."""
        if self._loss_scale is None:
            return 2.0**15 if self._computes_in_float16() else 1.0
        return self._loss_scale.get_scale()

    def loss_scale_state(self) -> dict[str, Any]:
        """The state machine's variables as Python numbers, in one host read
        (`LossScaler.diagnostics()`; `lowest_scale` is None before a step)."""
        if self._loss_scale is None:
            raise RuntimeError("MixedPrecisionModel must be compiled before its loss scale has a state.")
        return self._loss_scale.diagnostics()

    def kept_batch(self) -> tuple[tuple[Any, Any, Any], int] | None:
        """The last batch whose step was skipped, and that step's number.

        Returns `((x, y, sample_weight), step)` as NumPy values, `step`
        counting the loss scale's steps from 0, or None when no step has
        been skipped (or under a `tf.distribute` strategy, with your own
        `train_step`, for sparse or ragged inputs, or for batches of
        unknown shape under `jit_compile=True`, where batches are not kept:
        `kept_batch_note()` says why). Under `jit_compile=True` one batch is
        kept per batch shape, and the latest is returned. `diagnose_batch(model, *batch)` replays it.
        """
        return self._kept_batch.read()

    def epoch_sample_count(self) -> float:
        """Samples trained on in the current epoch, counted in-graph from
        the batches every training step saw, its own `train_step` or yours
        (one host read; `EpochTimer` reads it once per epoch)."""
        return float(self._epoch_signals.samples.result().numpy())

    def kept_batch_note(self) -> str | None:
        """Why the last skipped step's batch could not be kept, or None."""
        return self._kept_batch.not_kept

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
    def compile(self, optimizer: Any = None, *args: Any, **kwargs: Any) -> None:
        """As `keras.Model.compile`, with one loss scale guaranteed (the
        optimizer defaults to that of the class adopted: Keras's "rmsprop",
        a KerasHub task's own).

        The model scales the loss itself, so Keras's own wrapping is always
        off; `auto_scale_loss=False` means no scaling (as in Keras) unless
        the model was given a `loss_scale`. A `LossScaleOptimizer`
        (Keras's or mp_callbacks') is unwrapped and its loss scale adopted;
        a `loss_scale_factor` set on the optimizer becomes a fixed loss
        scale. A model with its own `train_step` then trains through a
        `LossScaleOptimizer` sharing the model's scale (`self.optimizer`).
        The first compile runs `mp_callbacks.check_model` and warns once
        about what it finds.
        """
        auto_scale_loss = kwargs.pop("auto_scale_loss", True)
        if optimizer is None:
            optimizer = default_optimizer_argument(super().compile)
        # "auto": a KerasHub task's own choice, made by its compile below.
        if not (isinstance(optimizer, str) and optimizer == "auto"):
            optimizer = keras.optimizers.get(optimizer)
        adopted = given_wrapper = None
        if isinstance(optimizer, LossScaleOptimizer):
            adopted, given_wrapper = optimizer.scaler, optimizer
            optimizer = optimizer.inner_optimizer
        elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            adopted = LossScaler(
                initial_scale=float(optimizer.initial_scale),
                growth_interval=int(optimizer.dynamic_growth_steps),
            )
            optimizer = optimizer.inner_optimizer
        elif getattr(optimizer, "loss_scale_factor", None) is not None:
            adopted = LossScaler.fixed(float(optimizer.loss_scale_factor))
            optimizer.loss_scale_factor = None
        if adopted is not None:
            if self._mp_chosen_by != "user":
                self._loss_scale = adopted
                self._mp_chosen_by = "user"
                logger.info("MixedPrecisionModel adopted %r from compile().", adopted)
            elif adopted is not self._loss_scale:
                logger.info(
                    "MixedPrecisionModel keeps its loss scale %r; the one "
                    "given to compile() (%r) is not applied on top.",
                    self._loss_scale,
                    adopted,
                )
        elif self._mp_chosen_by == "user" and not auto_scale_loss:
            logger.info(
                "MixedPrecisionModel keeps its loss scale %r: auto_scale_loss=False "
                "only turns off loss_scale='auto'.",
                self._loss_scale,
            )
        super().compile(optimizer, *args, auto_scale_loss=False, **kwargs)
        if self._mp_chosen_by != "user":
            choice = "auto" if auto_scale_loss else "off"
            if self._loss_scale is None or self._mp_chosen_by != choice:
                self._loss_scale = self._auto_loss_scale() if auto_scale_loss else LossScaler.disabled()
                self._mp_chosen_by = choice
        if self._loss_scale.scaling_active or self._has_own_train_step():
            # As in Keras, a model that scales its loss trains through a
            # LossScaleOptimizer; and your own train_step applies through
            # self.optimizer: never a non-finite update, the scale in reach.
            if given_wrapper is not None and given_wrapper.scaler is self._loss_scale:
                self.optimizer = given_wrapper
            else:
                self.optimizer = LossScaleOptimizer.for_model(self.optimizer, self._loss_scale)
            # Saved as the plain optimizer it wraps; the model saves the scale.
            self.optimizer._saved_as_inner = True
            self.optimizer._saves_loss_scale = False
        if self.built:
            self._loss_scale.build(self.trainable_variables)
            # Built now rather than at the first fit, so that load_weights
            # right after compile (resuming from a ModelCheckpoint) restores
            # the optimizer's slots too instead of skipping them.
            if not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)
        self._warn_about_findings()

    def _float8_following_the_scale(self) -> list[Any]:
        """The float8 state to rescale with the loss scale in this step."""
        if not self.float8_follows_loss_scale or not self._loss_scale.scaling_active:
            return []
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            return []  # (each replica would write a mirrored variable)
        variables = self.trainable_variables
        return [variables[i] for i in gradient_state(variables)]

    def make_train_function(self, force: bool = False):
        """As Keras's, around `recorded_train_step`: the model's own
        `train_step` or a subclass's, run as one recorded step."""
        if self._loss_scale is None:
            raise RuntimeError("MixedPrecisionModel must be compiled before training.")
        with self.distribute_strategy.scope():
            self._loss_scale.build(self.trainable_variables)
        if self.train_function is not None and not force:
            return self.train_function
        self.train_function = make_step_function(self, self.recorded_train_step)
        return self.train_function

    def recorded_train_step(self, data: Any) -> Any:
        """Runs `train_step(data)` (the model's own, or a subclass's) as one
        recorded step of the loss scale: one state update at its end, the
        forward pass's state put back when an update was skipped, the batch
        kept, and `loss_scale`, `grad_norm` and `skipped_steps` in the logs.
        `fit`, `train_on_batch` and the `train_function` they build run it;
        a loop of your own calls it in place of `train_step`."""
        loss_scale = self._loss_scale
        if loss_scale is None or loss_scale._record is not None:
            return self.train_step(data)  # a step inside a step joins it
        # The model's own step puts the forward pass's state back itself.
        forward_state = self._read_forward_state(data) if self._has_own_train_step() else None
        with loss_scale.recording() as record:
            record.reference = not self.fast_step
            logs = self.train_step(data)
            self._epoch_signals.samples.update_state(tf.cast(_batch_size(data), tf.float32))
            return self._finish_step(record, logs, forward_state)

    def loss_scaling(self) -> LossScaling:
        """The loss scale for one step of your own (see `LossScaling`):
        the recipe's verbs, the same on every backend (a GAN's two
        optimizers share one scale and one decision)."""
        if self._loss_scale is None:
            raise RuntimeError("MixedPrecisionModel must be compiled before training.")
        return LossScaling(self._loss_scale, self.non_trainable_variables)

    @property
    def losses(self) -> list[Any]:
        """As `keras.Model.losses`, each floating loss in float32. An
        activity regularizer's loss comes in its layer's float16 or
        bfloat16, which Keras's `compute_loss` cannot add to a float32 loss
        on TensorFlow (a `TypeError` in stock Keras)."""
        return [_in_float32(loss) for loss in super().losses]

    def compute_loss(
        self,
        x: Any = None,
        y: Any = None,
        y_pred: Any = None,
        sample_weight: Any = None,
        training: bool = True,
    ) -> Any:
        """As `keras.Model.compute_loss`; inside a training step, the loss
        is also noted as one the step's updates come from (a non-finite
        one is divergence for `NaNGradientMonitor`)."""
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        record = None if self._loss_scale is None else self._loss_scale._record
        if record is not None and training:
            record.note_loss(loss)
        return loss

    # ---------------------------------------------------------------- steps
    def train_step(self, data: Any) -> dict[str, Any]:
        loss_scale = self._loss_scale
        record = loss_scale._record
        if record is None:  # called outside a recorded step: it records itself
            return self.recorded_train_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
        # Keras divides the loss by the replica count under tf.distribute:
        # the reported norm is each replica's own.
        record.norm_factor = num_replicas

        # The forward pass updates some state itself (BatchNormalization's
        # moving statistics, RNG seeds): read it first, so that a skipped
        # step can put it back. Reads are free until a write copies.
        forward_state = self.non_trainable_variables + self._trainables_the_forward_pass_writes(x)
        state_before = [tf.identity(v.value) for v in forward_state]
        with tf.GradientTape() as tape:
            if call_has_training_arg(self):
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            loss = compute_loss(self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
            batch_size = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
            # Keras divides the loss by the replica count under tf.distribute.
            loss_tracker(self).update_state(loss * num_replicas, sample_weight=batch_size)
            scaled_loss = loss_scale.scale(loss)

        variables = self.trainable_variables
        if not variables:
            logger.warning("The model does not have any trainable weights.")
            # Nothing to apply is not a skipped step: no overflow happened.
            record.note_apply(tf.constant(True), tf.constant(0.0))
        else:
            grads = loss_scale._unscale(tape.gradient(scaled_loss, variables), variables)
            # One pass over the gradients gives both finiteness and the norm.
            checked = loss_scale.check_gradients(grads)
            restore = list(zip(forward_state, state_before))
            # Under tf.distribute each replica has only its shard of the
            # batch: replaying one shard would not be the step's batch.
            if num_replicas == 1:
                # The step number the batch would have had (0-based count
                # of steps seen), kept with it on a skip.
                restore += self._kept_batch.pairs(
                    (x, y, sample_weight),
                    loss_scale._state["step_count"].read_value(),
                    fixed_shapes=self.jit_compile is True,
                )
            else:
                self._kept_batch.not_kept = (
                    f"under a tf.distribute strategy each of the {num_replicas} replicas holds only "
                    "its own part of the batch, so no single batch is kept to replay"
                )
            tf_step.apply_unscaled(
                loss_scale, self.optimizer, grads, variables, loss, restore_on_skip=restore, checked=checked
            )
        return dict(self.compute_metrics(x, y, y_pred, sample_weight=sample_weight))

    _mp_default_train_step = train_step

    def _read_forward_state(self, data: Any) -> list[tuple[Any, Any]]:
        """(variable, value) for the state a forward pass may change, read
        before your own train_step runs."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        state = self.non_trainable_variables + self._trainables_the_forward_pass_writes(x)
        return [(v, tf.identity(v.value)) for v in state]

    def _trainables_the_forward_pass_writes(self, x: Any) -> list[Any]:
        """Trainable variables that the forward pass itself assigns
        (SpectralNormalization writes its layer's normalized kernel), which a
        skipped step must put back too. Found once per input signature by
        tracing the forward pass into a throwaway graph; most models have
        none, and their healthy steps read nothing more."""
        try:
            specs = tf.nest.map_structure(tf.type_spec_from_value, x)
        except (TypeError, ValueError):
            return []
        cache = self.__dict__.setdefault("_mp_forward_writes", {})
        key = repr(specs)
        if key not in cache:
            cache[key] = written_variables(
                lambda inputs: self(inputs, training=True) if call_has_training_arg(self) else self(inputs),
                specs,
                self.trainable_variables,
            )
        return cache[key]

    def _finish_step(self, record: StepRecord, logs: Any, forward_state: list[tuple[Any, Any]] | None) -> Any:
        """Ends a recorded step: one state update, the forward pass's state
        put back if an update was skipped, and the step in the logs."""
        loss_scale = self._loss_scale
        following = self._float8_following_the_scale()
        scale_before = loss_scale.loss_scale if following else None
        loss_scale.finish_step(record)
        if following:
            ratio = loss_scale.loss_scale / scale_before
            for variable in following:
                variable.assign(variable * tf.cast(ratio, variable.dtype))
        standard = forward_state is None
        if not record.loss_scaled and not standard:
            self._warn_unscaled_step()
        if not record.stepped:
            return logs
        applied = record.all_applied()
        if forward_state:
            tf_step.restore_if_skipped(applied, forward_state)
        signals = self._epoch_signals
        signals.grad_norm.update_state(
            tf.where(applied, record.global_norm(), 0.0),
            sample_weight=tf.cast(applied, tf.float32),
        )
        signals.skipped_steps.update_state(1.0 - tf.cast(applied, tf.float32))
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        if standard or record.loss_scaled:
            logs.setdefault("loss_scale", loss_scale.loss_scale)
        # An epoch without an applied step has no gradient norm (0 would
        # read as vanishing gradients).
        logs.setdefault(
            "grad_norm", tf.where(signals.grad_norm.count > 0, signals.grad_norm.result(), float("nan"))
        )
        logs.setdefault("skipped_steps", signals.skipped_steps.result())
        return _for_multi_worker_reduction(logs)

    def _warn_unscaled_step(self) -> None:
        if self._warned_unscaled_step or not self._loss_scale.scaling_active:
            return
        if not self._computes_in_float16():
            return
        self._warned_unscaled_step = True
        warnings.warn(
            f"{type(self).__name__}.train_step never scales its loss, but {self.name!r} "
            "computes in float16: small gradients underflow to zero. To scale it, "
            f"{_SCALE_THE_LOSS}. Non-finite updates through self.optimizer are skipped "
            "either way.",
            MixedPrecisionWarning,
            stacklevel=2,
        )

    def test_step(self, data: Any) -> dict[str, Any]:
        return _for_multi_worker_reduction(super().test_step(data))

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self._epoch_signals.reset()

    # ---------------------------------------------------------- save / load
    # Marked as Keras's own default, so that a subclass without a get_config
    # of its own is treated as stock Keras treats one: configured from its
    # constructor arguments, or refused at save when they cannot be (a
    # sub-model passed to __init__), rather than saved as a file that
    # load_model cannot read.
    @keras_default_method
    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if self._loss_scale is None:
            config["loss_scale"] = _AUTO
        else:
            config["loss_scale"] = keras.saving.serialize_keras_object(self._loss_scale)
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
