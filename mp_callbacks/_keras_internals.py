"""Every private Keras (and TensorFlow) internal mp_callbacks relies on, in one place.

Keras 3 does not promise these names: each accessor below is probed by a
canary in `tests/keras_canaries.py` (run by `tests/test_keras_internals.py`
on the oldest and the newest Keras declared), which also computes from the
code which modules rely on it, so that a Keras release that renames or
changes one breaks a test there rather than a user's training run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from mp_callbacks._backend import keras

__all__ = ["LossScaleSaveable", "functional_class"]


def functional_class() -> type:
    """keras.src.models.functional.Functional: a functional MixedPrecisionModel
    mixes it in, as keras.Model does for its own subclasses."""
    from keras.src.models.functional import Functional

    return Functional


def init_functional(model: Any, args: tuple, kwargs: dict) -> None:
    """What keras.Model.__init__ does for a functional call, without its
    `inject_functional_model_class`, which rewrites the `__bases__` of every
    class between the model's and keras.Model for the whole process."""
    functional: Any = functional_class()
    trainer: Any = backend_trainer_class()
    trainer.__init__(model)
    functional.__init__(model, *args, **kwargs)


def backend_trainer_class() -> type:
    """The running backend's trainer (TensorFlowTrainer, JAXTrainer): the
    base of keras.Model that holds `train_step`'s contract."""
    from keras.src.models.model import Trainer

    return Trainer


def update_metrics_variables(
    model: Any, metrics_variables: Any, loss: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any
) -> tuple[Any, Any]:
    """JAXTrainer._update_metrics_variables: the loss tracker and compiled
    metrics updated statelessly, as Keras's own JAX step updates them."""
    return model._update_metrics_variables(metrics_variables, loss, x, y, y_pred, sample_weight)


def all_layers(layer: Any, include_self: bool = False, recursive: bool = True) -> list[Any]:
    """Every layer inside `layer` (its sublayers at any depth, in the
    order Keras tracks them; direct children only with `recursive=False`):
    `Layer._flatten_layers`, the walk Keras's own saving and summaries use."""
    return list(layer._flatten_layers(include_self=include_self, recursive=recursive))


def is_functional(model: Any) -> bool:
    """Whether `model` runs a functional graph of layers (a `Functional`,
    which has `_run_through_graph`; a `Sequential` is told apart by the
    caller where it counts too)."""
    return hasattr(model, "_run_through_graph")


def has_layer_graph(model: Any) -> bool:
    """A Sequential or functional model: one whose layers form a graph."""
    return isinstance(model, keras.Sequential) or is_functional(model)


def producing_layer(tensor: Any) -> Any:
    """The layer that produced a symbolic tensor (`KerasTensor._keras_history`),
    or None for a tensor without one."""
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history[0]


def inbound_tensors(layer: Any) -> list[Any]:
    """The symbolic tensors `layer` was called on, over all its calls
    (`Layer._inbound_nodes[].input_tensors`), those with a producer only."""
    return [
        tensor
        for node in getattr(layer, "_inbound_nodes", [])
        for tensor in getattr(node, "input_tensors", [])
        if producing_layer(tensor) is not None
    ]


def layer_dtype_policy(layer: Any) -> Any:
    """The layer's own dtype policy object (`Layer._dtype_policy`: for a
    layer of a quantized model, the map itself), or None."""
    return getattr(layer, "_dtype_policy", None)


def set_layer_dtype_policy(layer: Any, policy: Any) -> None:
    """Sets the layer's own policy object as it is, without the public
    setter's side effects (which edit a `DTypePolicyMap` and may quantize),
    so that putting the old one back restores the layer exactly."""
    layer._dtype_policy = policy


def loss_tracker(model: Any) -> Any:
    """Keras's `Mean` of the training loss (`Trainer._loss_tracker`),
    weighted by batch size in Keras's own train_step; None before compile."""
    return getattr(model, "_loss_tracker", None)


def call_has_training_arg(model: Any) -> bool:
    """Whether the model's `call` takes `training` (`Layer._call_has_training_arg`)."""
    return bool(model._call_has_training_arg)


def compute_loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """The training loss as Keras's own train_step computes it
    (`Trainer._compute_loss`, which passes `training` only to a
    `compute_loss` that takes it)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)


def in_multi_worker_mode(strategy: Any) -> bool:
    """TensorFlow's own flag of a strategy that spans several workers
    (`CollectiveAllReduceExtended._in_multi_worker_mode`)."""
    return bool(getattr(strategy.extended, "_in_multi_worker_mode", lambda: False)())


def weight_decay_replacement(optimizer: Any, replacement: Callable) -> dict[str, Callable]:
    """`{"_apply_weight_decay": replacement}` (for `replaced_on_instance`)
    when `optimizer` decays weights with Keras's own TensorFlow method, else
    empty: an optimizer with its own weight decay keeps it."""
    own: Any = type(optimizer)
    keras_own: Any = tf_optimizer_class()
    if own._apply_weight_decay is keras_own._apply_weight_decay:
        return {"_apply_weight_decay": replacement}
    return {}


class DelegatedCheckpoint:
    """Mixin for an optimizer wrapper with `inner_optimizer` and `scaler`,
    once it sets `_mp_delegating`: its checkpoint entries are the inner
    optimizer's own plus `loss_scale` (TensorFlow's checkpoint protocol,
    `_trackable_children` / `_lookup_dependency`), as tf.keras's wrapper
    does, so that a checkpoint of a plain optimizer restores into a
    wrapped one (iterations, slots) and the other way round."""

    inner_optimizer: Any
    scaler: Any

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict[str, Any]:
        if not self.__dict__.get("_mp_delegating"):
            return super()._trackable_children(save_type, **kwargs)  # type: ignore[misc]
        children = dict(self.inner_optimizer._trackable_children(save_type, **kwargs))
        children["loss_scale"] = self.scaler
        return children

    def _lookup_dependency(self, name: str, cached_dependencies: Any = None) -> Any:
        if not self.__dict__.get("_mp_delegating"):
            return super()._lookup_dependency(name, cached_dependencies)  # type: ignore[misc]
        if name == "loss_scale":
            return self.scaler
        return self.inner_optimizer._lookup_dependency(name, cached_dependencies)


class MultiWorkerSymbolicBuild:
    """Mixin for a model: Keras 3.15 reduces a distributed batch with
    strategy.reduce("MEAN") only to learn its shapes and dtypes
    (`Trainer._maybe_symbolic_build`), which fails under
    MultiWorkerMirroredStrategy; one local replica's batch has them."""

    distribute_strategy: Any

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        from mp_callbacks._backend import tf

        strategy = self.distribute_strategy
        if (
            iterator is not None
            and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and in_multi_worker_mode(strategy)
        ):
            batch = first_batch_of_epoch_iterator(iterator)
            if batch is None:
                return None
            local = strategy.experimental_local_results
            data_batch = tf.nest.map_structure(
                lambda v: local(v)[0] if isinstance(v, tf.distribute.DistributedValues) else v,
                batch,
            )
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)  # type: ignore[misc]


def in_memory_deserialization() -> Any:
    """A scope in which `from_config` rebuilds a `Lambda` layer's Python
    function (`keras.src.saving.serialization_lib.SafeModeScope(False)`):
    copying a model in memory runs only the user's own code, which safe mode
    guards files against."""
    from keras.src.saving.serialization_lib import SafeModeScope

    return SafeModeScope(False)


def keras_default_method(method: Callable) -> Callable:
    """Marks `method` as Keras's own default (`keras.src.utils.python_utils.default`):
    Keras then treats a class that does not override it as one that does
    not (its auto-config of `get_config`)."""
    method._is_default = True  # type: ignore[attr-defined]
    return method


def output_layers(model: Any) -> list[Any]:
    """The layers that produce a functional model's outputs (each tensor's
    `_keras_history`), in output order; none for a model without a graph."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return []
    layers: list[Any] = []
    for tensor in outputs or []:
        history = getattr(tensor, "_keras_history", None)
        if history is not None and history[0] not in layers:
            layers.append(history[0])
    return layers


def global_seed_generator_state() -> Any:
    """The state variable of Keras's global SeedGenerator (which
    `keras.random.*` ops without a seed advance), or None before one exists."""
    from keras.src.backend.common import global_state

    # The attribute's name: a constant since Keras 3.11, the same string before.
    generator = global_state.get_global_attribute("global_seed_generator")
    return None if generator is None else generator.state


def strategy_supports_no_merge_call() -> bool:
    """TensorFlow's own test of whether the current strategy's optimizer
    updates need no `merge_call` (Keras's LossScaleOptimizer asks it too)."""
    from mp_callbacks._backend import tf

    return bool(tf.__internal__.distribute.strategy_supports_no_merge_call())


def functional_init_arguments(args: tuple, kwargs: dict) -> bool:
    """Keras's own test of whether a model is built functionally
    (`Model(inputs, outputs)` and its keyword forms)."""
    from keras.src.models.model import functional_init_arguments as keras_test

    return bool(keras_test(args, kwargs))


def register_serialized_name(cls: type, name: str) -> None:
    """Makes Keras serialize `cls` under `name` (a class derived at run
    time, such as a functional variant, under its parent's registered name)."""
    from keras.src.saving import object_registration

    object_registration.GLOBAL_CUSTOM_NAMES[cls] = name


def compiling_with_xla() -> bool:
    """Whether the function being traced is compiled by XLA: a
    `tf.function(jit_compile=True)` (Keras's `jit_compile=True` step is
    one) or a function traced inside one. TensorFlow's own test, which
    `tf.cond` and `tf.while_loop` use to choose their XLA form."""
    from tensorflow.python.ops import control_flow_util

    from mp_callbacks._backend import tf

    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def replace_op_input(op: Any, index: int, tensor: Any) -> None:
    """Makes input `index` of the graph op `op` (not yet run) be `tensor`
    (TensorFlow's `Operation._update_input`)."""
    op._update_input(index, tensor)


def learning_rate_is_scheduled(optimizer: Any) -> bool:
    """Whether `optimizer`'s learning rate is computed each step (a
    `LearningRateSchedule` or a callable) rather than held in a variable
    (`Optimizer._learning_rate`)."""
    rate = optimizer._learning_rate
    return isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(rate) and not isinstance(rate, keras.Variable)
    )


def tf_optimizer_class() -> type:
    """keras.src.backend.tensorflow.optimizer.TFOptimizer: the class whose
    writes (`assign`, `assign_add`, `assign_sub`) and weight decay Keras's
    built-in optimizers use on TensorFlow."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def uses_weight_decay(optimizer: Any, variable: Any) -> bool:
    """Whether Keras applies `optimizer`'s weight decay to `variable`."""
    return bool(optimizer._use_weight_decay(variable))


def optimizer_built_variables(optimizer: Any) -> list[Any]:
    """The variables `optimizer` was built for (`Optimizer._trainable_variables`),
    or [] before it is built."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def recording_stateless_scope(mapping: list[tuple[Any, Any]], record: Callable[[Any, Any], Any]) -> Any:
    """A `keras.StatelessScope` over `mapping` in which each
    `variable.assign(value)` keeps `record(variable, value)` instead of
    `value`; later reads in the scope see what was kept. Keras hands every
    write in a stateless scope to `StatelessScope.add_update`, which this
    overrides."""

    class RecordingScope(keras.StatelessScope):
        def add_update(self, update: tuple[Any, Any]) -> None:
            variable, value = update
            super().add_update((variable, record(variable, value)))

    return RecordingScope(state_mapping=mapping)


class _DeferringScope(keras.StatelessScope):
    """See `deferring_stateless_scope` (one class, made once: torch.compile
    guards on the scope's type, and a class per call would recompile the
    step every time)."""

    def __init__(self) -> None:
        super().__init__(collect_losses=True)
        self._written: dict[int, Any] = {}

    def add_update(self, update: tuple[Any, Any]) -> None:
        variable, _ = update
        self._written[id(variable)] = variable
        super().add_update(update)

    def writes(self) -> list[tuple[Any, Any]]:
        return [(v, self.get_current_value(v)) for v in self._written.values()]


def deferring_stateless_scope() -> Any:
    """A `keras.StatelessScope` that keeps every `variable.assign(value)`
    made in it aside instead of writing it (later reads in the scope see
    the new value) and collects layer losses, as eager code sees them:
    `scope.writes()` lists each written variable once, with its last
    value. Keras hands every write in a stateless scope to
    `StatelessScope.add_update`, which this overrides."""
    return _DeferringScope()


def add_in_place(tensors: list[Any], amounts: Sequence[float]) -> None:
    """`tensor.add_(amount)` for each pair of torch tensors, in one call
    (torch's `_foreach_add_`, as its own optimizers use: one dispatch, not
    one per tensor; dtypes may differ). Checked by tests/on_torch."""
    import torch

    torch._foreach_add_(tensors, list(amounts))


def optimizer_own_variables(optimizer: Any) -> list[Any]:
    """The variables an optimizer made itself (`Optimizer._variables`: its
    `iterations` and what its `add_variable` made, not a wrapped optimizer's)."""
    return list(optimizer._variables)


def seed_generators_of(layer: Any) -> list[Any]:
    """The `SeedGenerator`s a layer tracks (a layer that draws random numbers)."""
    return list(getattr(layer, "_seed_generators", None) or [])


def called_method(layer: Any) -> str:
    """The method `Layer.__call__` runs for `layer`: `quantized_call` for a
    quantized layer (float8, int8, ...), else `call`."""
    return "quantized_call" if getattr(layer, "quantization_mode", None) else "call"


def make_step_function(model: Any, step: Callable[[Any], Any]) -> Any:
    """Keras's TensorFlow trainer's train function around `step` in place
    of `model.train_step` (`TensorFlowTrainer._make_function`: tf.function,
    XLA, the distribution strategy and `steps_per_execution`, as Keras
    builds them)."""
    return model._make_function(step)


def computes_float8(layer: Any) -> bool:
    """Whether the layer's class has float8 arithmetic (`Layer._float8_call`
    overridden: `Dense`, `EinsumDense`); any other layer given a float8
    policy fails at its first call."""
    return type(layer)._float8_call is not keras.layers.Layer._float8_call


@contextlib.contextmanager
def replaced_on_instance(obj: Any, replacements: dict[str, Any]) -> Iterator[None]:
    """Sets `replacements` as attributes of `obj` itself for the duration,
    and removes them after, errors included.

    The one place mp_callbacks replaces something on a user's object, and
    only where there is no other way: to gate every write an optimizer's
    own update makes without a `tf.cond` (`backends.tensorflow.gated_update`), to see each
    layer's inputs and outputs while a batch is replayed (`diagnosis`), and
    to see the ids a custom layer's lookups get (`model_checks`).
    """
    for name, value in replacements.items():
        object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        for name in replacements:
            object.__delattr__(obj, name)


@contextlib.contextmanager
def layer_calls_wrapped(layers: Iterable[Any], wrap: Callable[[Any, Any], Any]) -> Iterator[None]:
    """For the duration, each layer's called method (`called_method`) is
    `wrap(layer, method)`: how a replay records every layer call."""
    with contextlib.ExitStack() as stack:
        for layer in layers:
            method = called_method(layer)
            stack.enter_context(replaced_on_instance(layer, {method: wrap(layer, getattr(layer, method))}))
        yield


def keras_saveable_class() -> type:
    from keras.src.saving.keras_saveable import KerasSaveable

    return KerasSaveable


def first_batch_of_epoch_iterator(iterator: Any) -> Any:
    """The first (possibly distributed) batch of a TF epoch iterator, as
    `_maybe_symbolic_build` receives it: Keras 3.10 yields `(step,
    batches)`, Keras 3.15 `(begin, end, batches)`; the batches come last.
    None when the iterator is empty."""
    for item in iterator:
        return next(item[-1])
    return None


_KerasSaveable: Any = keras_saveable_class()


class LossScaleSaveable(_KerasSaveable):
    """The loss-scale state as a child of a model in Keras weights files.

    Kept apart from the model's own variables so that weights saved by a
    `MixedPrecisionModel` load into the same layers built as a plain
    `keras.Model` (which ignores this entry), e.g. for serving without
    mp_callbacks. The loss scale is looked up through a function rather
    than held as an attribute: Keras's saver walks every attribute, and the
    model must not be reached from here again.
    """

    def __init__(self, get_loss_scale: Callable[[], Any]) -> None:
        self._get_loss_scale = get_loss_scale

    def _obj_type(self) -> str:
        return "Layer"  # a type every Keras 3 knows; only its attribute skip-list is used

    def save_own_variables(self, store: Any) -> None:
        loss_scale = self._get_loss_scale()
        if loss_scale is not None:
            for key, value in loss_scale.get_state().items():
                store[key] = value

    def load_own_variables(self, store: Any) -> None:
        loss_scale = self._get_loss_scale()
        keys = list(store.keys())
        if loss_scale is not None and keys:
            loss_scale.set_state({key: store[key] for key in keys})

    def __deepcopy__(self, memo: dict) -> LossScaleSaveable:
        # A copied model makes its own (see MixedPrecisionModel); this one
        # points at the original's loss scale.
        return LossScaleSaveable(lambda: None)

    def __reduce__(self):
        # KerasSaveable would pickle this as a whole model.
        return (LossScaleSaveable, (_no_loss_scale,))


def _no_loss_scale() -> None:
    return None
