"""The canaries: every private Keras (and TensorFlow) internal that
`mp_callbacks/_keras_internals.py` reaches through, probed on the installed
Keras, so that a release that renames or changes one breaks a test here
rather than a user's training run. Which library modules rely on each is
computed from the code (`used_by`): the modules that name the accessors a
canary guards. The one torch private (`add_in_place`) is checked by
`tests/on_torch`, where torch is.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np

from mp_callbacks._keras_internals import (
    backend_trainer_class,
    compiling_with_xla,
    computes_float8,
    first_batch_of_epoch_iterator,
    functional_class,
    functional_init_arguments,
    global_seed_generator_state,
    in_memory_deserialization,
    init_functional,
    keras_default_method,
    keras_saveable_class,
    learning_rate_is_scheduled,
    optimizer_built_variables,
    optimizer_own_variables,
    recording_stateless_scope,
    replace_op_input,
    seed_generators_of,
    strategy_supports_no_merge_call,
)

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mp_callbacks"

#: Keras versions on which every canary was checked (CI tests the oldest
#: and the newest).
CHECKED_ON = ("3.10.0", "3.15.1")


class Canary(NamedTuple):
    name: str
    #: The names in the library (accessors of `_keras_internals`, mostly)
    #: whose users rely on this internal.
    guards: tuple[str, ...]
    present: Callable[[], bool]


def used_by(canary: Canary) -> list[str]:
    """The library modules (but `_keras_internals.py`, which holds the
    accessors) that name one of the canary's guards."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_keras_internals.py":
            continue
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name)
        if names & set(canary.guards):
            found.append(str(path.relative_to(PACKAGE)))
    return found


def _epoch_iterator() -> bool:
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    from mp_callbacks._backend import tf

    iterator = TFEpochIterator(
        x=np.zeros((4, 1), "float32"), batch_size=2, distribute_strategy=tf.distribute.get_strategy()
    )
    batch = first_batch_of_epoch_iterator(iterator.enumerate_epoch())
    return batch is not None and tuple(np.shape(batch[0] if isinstance(batch, tuple) else batch)) == (2, 1)


def _default_method_marker() -> bool:
    from keras.src.utils import python_utils

    return python_utils.is_default(keras_default_method(lambda: None))


def _layer_walk() -> bool:
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="d")(inputs))
    names = [layer.name for layer in model._flatten_layers(include_self=False, recursive=True)]
    return "d" in names and hasattr(model, "_run_through_graph")


def _multi_worker_mode_flag() -> bool:
    from tensorflow.python.distribute import collective_all_reduce_strategy

    return hasattr(collective_all_reduce_strategy.CollectiveAllReduceExtended, "_in_multi_worker_mode")


def _functional_init() -> bool:
    class Probe(keras.Model):
        pass

    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    model: Any = Probe.__new__(type("ProbeFunctional", (Probe, functional_class()), {}))
    init_functional(model, (inputs, outputs), {})
    return Probe.__bases__ == (keras.Model,) and model.built and len(model.layers) == 2


# Every method Keras's LossScaleOptimizer defines that reads its own state
# (made in its __init__ and build, which mp_callbacks' subclass skips).
LOSS_SCALE_OPTIMIZER_OVERRIDES = frozenset(
    {
        "__init__",
        "build",
        "variables",
        "stateless_apply",
        "apply",
        "learning_rate",
        "iterations",
        "scale_loss",
        "finalize_variable_values",
        "get_config",
        "from_config",
    }
)
# Its methods that read no state of its own: inherited as they are.
LOSS_SCALE_OPTIMIZER_STATELESS = frozenset({"check_finite"})


def _loss_scale_optimizer_methods() -> bool:
    own = {
        name
        for name in vars(keras.optimizers.LossScaleOptimizer)
        if not name.startswith("__") or name == "__init__"
    }
    helpers = {name for name in own if name.startswith("_") and name != "__init__"}
    return own - helpers <= LOSS_SCALE_OPTIMIZER_OVERRIDES | LOSS_SCALE_OPTIMIZER_STATELESS


def _global_seed_generator() -> bool:
    keras.random.normal((1,))  # makes the global generator if there is none
    state = global_seed_generator_state()
    return state is not None and hasattr(state, "assign")


def _has(obj: Any, *names: str) -> bool:
    return all(hasattr(obj, name) for name in names)


def _model_private_api() -> bool:
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    tracker = getattr(model, "_loss_tracker", None)
    return (
        _has(model, "_compute_loss", "_call_has_training_arg", "_maybe_symbolic_build")
        and tracker is not None
        and _has(tracker, "count", "update_state")
    )


def _layer_graph() -> bool:
    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    history = getattr(outputs, "_keras_history", None)
    if history is None:
        return False
    layer = history[0]
    nodes: Any = getattr(layer, "_inbound_nodes", None)
    return bool(nodes) and _has(nodes[0], "input_tensors")


def _saving_lib_walk() -> bool:
    from keras.src.saving import saving_lib

    return _has(saving_lib, "_walk_saveable", "_load_state", "_save_state")


def _tf_weight_decay() -> bool:
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return _has(TFOptimizer, "_apply_weight_decay", "assign", "assign_add", "assign_sub")


def _built_for_its_variables() -> bool:
    variable = keras.Variable(np.zeros((3, 2), "float32"))
    optimizer = keras.optimizers.SGD()
    optimizer.build([variable])
    return [v.shape for v in optimizer_built_variables(optimizer)] == [(3, 2)]


def _stateless_writes_recorded() -> bool:
    variable = keras.Variable(np.zeros((2,), "float32"))
    with recording_stateless_scope([(variable, np.ones((2,), "float32"))], lambda v, x: x * 3.0) as scope:
        variable.assign(variable + 1.0)
        seen = np.asarray(keras.ops.convert_to_numpy(variable.value))
    kept = np.asarray(keras.ops.convert_to_numpy(scope.get_current_value(variable)))
    return bool(np.array_equal(kept, [6.0, 6.0]) and np.array_equal(seen, kept))


def _xla_context_seen() -> bool:
    from mp_callbacks._backend import tf

    seen = []

    def trace() -> Any:
        seen.append(compiling_with_xla())
        return tf.constant(0.0)

    tf.function(trace, jit_compile=True).get_concrete_function()
    tf.function(trace).get_concrete_function()
    return seen == [True, False] and not compiling_with_xla()


def _op_input_replaced() -> bool:
    from mp_callbacks._backend import tf

    seen = []

    def trace() -> Any:
        one, two = tf.constant(1.0), tf.constant(2.0)
        total = tf.add(one, one)
        replace_op_input(total.op, 1, two)
        seen.append([t is two for t in total.op.inputs])
        return total

    result = tf.function(trace)()
    return seen == [[False, True]] and float(result) == 3.0


def _learning_rate_kinds() -> bool:
    fixed = keras.optimizers.SGD(0.1)
    scheduled = keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))
    return not learning_rate_is_scheduled(fixed) and learning_rate_is_scheduled(scheduled)


def _object_registration() -> bool:
    from keras.src.saving import object_registration

    return hasattr(object_registration, "GLOBAL_CUSTOM_NAMES")


CANARIES = (
    Canary(
        "tf.__internal__.distribute.strategy_supports_no_merge_call",
        ("strategy_supports_no_merge_call",),
        lambda: isinstance(strategy_supports_no_merge_call(), bool),
    ),
    Canary(
        "keras.src.models.model.functional_init_arguments",
        ("functional_init_arguments",),
        lambda: functional_init_arguments((1, 2), {}) and not functional_init_arguments((), {}),
    ),
    Canary(
        "Optimizer._use_weight_decay(variable)",
        ("uses_weight_decay",),
        lambda: _has(keras.optimizers.AdamW(), "_use_weight_decay"),
    ),
    Canary(
        "Optimizer._trainable_variables",
        ("optimizer_built_variables",),
        lambda: _built_for_its_variables(),
    ),
    Canary(
        "StatelessScope.add_update (every variable.assign in a stateless scope goes through it)",
        ("recording_stateless_scope", "deferring_stateless_scope"),
        _stateless_writes_recorded,
    ),
    Canary(
        "Optimizer._variables",
        ("optimizer_own_variables",),
        lambda: optimizer_own_variables(keras.optimizers.SGD())[0].path.endswith("iteration"),
    ),
    Canary(
        "TensorFlowTrainer._make_function(step) (the train function Keras builds around a step)",
        ("make_step_function",),
        lambda: (
            keras.backend.backend() != "tensorflow"
            or callable(getattr(backend_trainer_class(), "_make_function", None))
        ),
    ),
    Canary(
        "Layer._float8_call (the float8 arithmetic a quantizable layer overrides)",
        ("computes_float8",),
        lambda: computes_float8(keras.layers.Dense(1)) and not computes_float8(keras.layers.Conv1D(1, 1)),
    ),
    Canary(
        "Layer._seed_generators",
        ("seed_generators_of",),
        lambda: bool(seed_generators_of(keras.layers.Dropout(0.5))),
    ),
    Canary(
        "tf.Module _trackable_children / _lookup_dependency (TensorFlow's checkpoint protocol)",
        ("DelegatedCheckpoint",),
        lambda: _has(keras.optimizers.SGD(), "_trackable_children", "_lookup_dependency"),
    ),
    Canary(
        "keras.src.models.functional.Functional",
        ("functional_class",),
        lambda: isinstance(functional_class(), type),
    ),
    Canary(
        "keras.Model.__init__ = TensorFlowTrainer.__init__ + Functional.__init__ for a functional call",
        ("init_functional",),
        _functional_init,
    ),
    Canary(
        "keras.optimizers.LossScaleOptimizer methods, all overridden by mp_callbacks'",
        ("LossScaleOptimizer",),
        _loss_scale_optimizer_methods,
    ),
    Canary(
        "keras.src.saving.object_registration.GLOBAL_CUSTOM_NAMES",
        ("register_serialized_name",),
        _object_registration,
    ),
    Canary(
        "keras.src.saving.keras_saveable.KerasSaveable",
        ("LossScaleSaveable",),
        lambda: _has(keras_saveable_class(), "_obj_type"),
    ),
    Canary(
        "keras.src.saving.saving_lib walk of KerasSaveable attributes",
        ("LossScaleSaveable",),
        _saving_lib_walk,
    ),
    Canary(
        "Model._compute_loss, _loss_tracker(count), _call_has_training_arg, _maybe_symbolic_build",
        ("compute_loss", "loss_tracker", "call_has_training_arg", "MultiWorkerSymbolicBuild"),
        _model_private_api,
    ),
    Canary(
        "keras.src.backend.tensorflow.trainer.TFEpochIterator.enumerate_epoch items end with the batches",
        ("MultiWorkerSymbolicBuild",),
        _epoch_iterator,
    ),
    Canary(
        "TensorFlow CollectiveAllReduceExtended._in_multi_worker_mode",
        ("in_multi_worker_mode",),
        _multi_worker_mode_flag,
    ),
    Canary(
        "keras.src.utils.python_utils.default: Operation.get_config auto-configures a class whose get_config carries _is_default",
        ("keras_default_method",),
        _default_method_marker,
    ),
    Canary(
        "keras.src.saving.serialization_lib.SafeModeScope(safe_mode)",
        ("in_memory_deserialization",),
        lambda: callable(getattr(in_memory_deserialization(), "__enter__", None)),
    ),
    Canary(
        "KerasTensor._keras_history (the layer that produced a tensor)",
        ("producing_layer", "output_layers"),
        lambda: hasattr(keras.Input((1,)), "_keras_history"),
    ),
    Canary(
        "Layer._flatten_layers(include_self, recursive), Functional._run_through_graph",
        ("all_layers", "is_functional"),
        _layer_walk,
    ),
    Canary(
        "keras.src.backend.common.global_state 'global_seed_generator' (a SeedGenerator)",
        ("global_seed_generator_state",),
        _global_seed_generator,
    ),
    Canary(
        "Layer._dtype_policy (swapped for the float32 replay)",
        ("layer_dtype_policy", "set_layer_dtype_policy"),
        lambda: hasattr(keras.layers.Dense(1), "_dtype_policy"),
    ),
    Canary(
        "KerasTensor._keras_history, Layer._inbound_nodes[].input_tensors",
        ("inbound_tensors",),
        _layer_graph,
    ),
    Canary(
        "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext",
        ("compiling_with_xla",),
        _xla_context_seen,
    ),
    Canary(
        "tensorflow Operation._update_input (rerouting an input of a traced op)",
        ("replace_op_input",),
        _op_input_replaced,
    ),
    Canary(
        "Optimizer._learning_rate (a variable, or a schedule or callable evaluated each step)",
        ("learning_rate_is_scheduled",),
        _learning_rate_kinds,
    ),
    Canary(
        "keras.src.backend.tensorflow.optimizer.TFOptimizer (_apply_weight_decay, assign*)",
        ("tf_optimizer_class", "weight_decay_replacement"),
        _tf_weight_decay,
    ),
)


def missing() -> list[str]:
    """The canaries this Keras no longer passes (empty when all do)."""
    failed = []
    for canary in CANARIES:
        try:
            ok = canary.present()
        except Exception:  # any failure means the internal changed
            ok = False
        if not ok:
            failed.append(f"{canary.name} (used by {', '.join(used_by(canary))})")
    return failed
