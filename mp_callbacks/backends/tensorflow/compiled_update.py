"""An optimizer's update and its skip compiled by XLA, equal to TensorFlow's value for value.

Contract of `compiled_apply(optimizer, grads, variables, decision)`: where
`decision` is True every variable ends as `optimizer.apply_gradients`
traced without XLA leaves it, bit for bit; where it is False nothing the
optimizer owns changes. It returns False, adding nothing to the step, when
the update is not one this module has been shown to reproduce exactly
(`compilable`); the caller then gates or conds (`skip.apply_or_skip`).

Why: an exact skip waits for the decision, so its update cannot hide
behind the backward pass as stock Keras's does; where the update is a
large share of the step (ResNet50 with Adam) that wait is the skip's whole
cost. XLA fuses the update into one pass over each variable and its slots,
about half the memory traffic of TensorFlow's op-by-op update, which pays
for the wait (docs/design.md, "The update compiled by XLA").

Exactness: XLA's CPU backend contracts a multiply feeding an add or a
subtract into one fused multiply-add, rounded once where TensorFlow rounds
twice. Each product that leaves for anything but another product is
therefore passed through an exclusive or with a zero the compiler cannot
see (its bits, reinterpreted as integers: the value is unchanged), which
contraction cannot cross. What else could differ (a reduction's order, a
divide by a square root rewritten) or was not checked (a learning-rate
schedule) is kept out by `compilable`: only the built-in optimizers whose
values `tests/test_compiled_update.py` checks against TensorFlow's, bit for
bit, with float32 variables on the CPU and a learning rate in a variable.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from mp_callbacks._backend import keras, tf
from mp_callbacks._keras_internals import learning_rate_is_scheduled, replace_op_input
from mp_callbacks.backends.tensorflow.gated_update import tf_variable, writes_are_kerass_own

__all__ = [
    "VERIFIED_OPTIMIZERS",
    "VERIFIED_SPARSE_OPTIMIZERS",
    "compilable",
    "compiled_apply",
    "compiled_update_function",
]

# The built-in optimizers whose compiled update equals TensorFlow's, bit for
# bit (tests/test_compiled_update.py). Keras's RMSprop, Adagrad and Adadelta
# divide by a square root (XLA multiplies by its reciprocal); Adafactor, Lamb
# and Muon reduce (in another order): they are not here.
VERIFIED_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "Ftrl", "Lion")
# Of those, the ones whose update of a sparse gradient (an Embedding's) is
# exact too: they make it dense with TensorFlow's own segment sum, which XLA
# sums in the same order. The others' scatters round differently.
VERIFIED_SPARSE_OPTIMIZERS = ("Adam", "AdamW", "Adamax")

# Ops whose float output is a product: the left side of a contraction.
_PRODUCT_OPS = frozenset({"Mul", "Square", "SquaredDifference", "MulNoNan"})

_SAME_WIDTH_INTEGER = {tf.float32: tf.int32, tf.float64: tf.int64}

# Per optimizer, per tuple of variable ids: its compiled update function. The
# function holds the variables, so their ids stay theirs while it is kept.
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _verified_classes() -> tuple[type, ...]:
    return tuple(getattr(keras.optimizers, name) for name in VERIFIED_OPTIMIZERS)


def compilable(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> bool:
    """Whether `compiled_apply` reproduces `optimizer`'s update exactly:
    a verified built-in class (not a subclass), Keras's own writes, no
    clipping by norm, EMA, gradient accumulation, learning-rate schedule or
    `loss_scale_factor`, float32 variables on the CPU without constraints,
    and gradients of their dtype and fully known shape (while tracing),
    dense unless the class is also in `VERIFIED_SPARSE_OPTIMIZERS`. On a
    GPU (where Keras compiles the whole step with XLA by default) the
    values were not compared, and a plugin device may have no XLA at all:
    not compiled."""
    if type(optimizer) not in _verified_classes() or "apply_gradients" in vars(optimizer):
        return False
    if not writes_are_kerass_own(optimizer):
        return False
    if optimizer.clipnorm is not None or optimizer.global_clipnorm is not None:
        return False  # a norm is a reduction, in XLA's order
    if optimizer.use_ema or getattr(optimizer, "gradient_accumulation_steps", None):
        return False
    if getattr(optimizer, "loss_scale_factor", None) is not None:
        return False  # not among the forms checked
    if learning_rate_is_scheduled(optimizer):
        return False
    sparse_verified = type(optimizer).__name__ in VERIFIED_SPARSE_OPTIMIZERS
    for grad, variable in zip(grads, variables):
        if isinstance(grad, tf.IndexedSlices):
            # Rows known while tracing: XLA compiles once per shape, and a
            # step traced for any number of rows would compile at each.
            if not sparse_verified or not grad.values.shape.is_fully_defined():
                return False
        elif not isinstance(grad, tf.Tensor) or not grad.shape.is_fully_defined():
            return False
        if grad.dtype != tf.float32 or variable.dtype != "float32":
            return False
        if getattr(variable, "constraint", None) is not None:
            return False
        if _device_type(variable) != "CPU":
            return False
    return bool(grads)


def _device_type(variable: Any) -> str:
    return tf.DeviceSpec.from_string(tf_variable(variable).device).device_type or ""


def _hold_off_contraction(graph: Any, first_op: int, zero: tf.Tensor) -> None:
    """Passes every product made since op `first_op` of `graph` through an
    exclusive or with `zero` before anything but another product uses it."""
    for op in graph.get_operations()[first_op:]:
        if op.type not in _PRODUCT_OPS or op.outputs[0].dtype not in _SAME_WIDTH_INTEGER:
            continue
        product = op.outputs[0]
        users = [user for user in product.consumers() if user.type not in _PRODUCT_OPS]
        if not users:
            continue
        bits = _SAME_WIDTH_INTEGER[product.dtype]
        shielded = tf.bitcast(
            tf.bitwise.bitwise_xor(tf.bitcast(product, bits), tf.cast(zero, bits)), product.dtype
        )
        for user in users:
            for index, tensor in enumerate(user.inputs):
                if tensor is product:
                    replace_op_input(user, index, shielded)


def compiled_update_function(optimizer: Any, variables: Sequence[Any]) -> Any:
    """The XLA-compiled `tf.function(decision, grads)` that `compiled_apply`
    calls: `optimizer`'s update of `variables` inside a cond on `decision`,
    its products held out of contraction (design notes and tests read its
    compiled form)."""
    variables = list(variables)
    # Weakly: the function is kept per optimizer (`_FUNCTIONS`, weak keys),
    # and a strong reference from it would keep the optimizer, its slots and
    # its model's variables alive after the model is gone (a search's trials).
    optimizer_ref = weakref.ref(optimizer)

    def update(decision: tf.Tensor, grads: list[tf.Tensor]) -> None:
        optimizer: Any = optimizer_ref()  # alive: it is tracing this call

        def applied() -> None:
            graph = tf.compat.v1.get_default_graph()
            first_op = len(graph.get_operations())
            # Zero for every non-negative count, which the compiler cannot
            # know: a constant would be folded and the barrier removed.
            iterations = tf.convert_to_tensor(optimizer.iterations)
            zero = tf.bitwise.right_shift(iterations, tf.constant(63, iterations.dtype))
            optimizer.apply_gradients(list(zip(grads, variables)))
            _hold_off_contraction(graph, first_op, zero)

        tf.cond(decision, applied, lambda: None)

    return tf.function(update, jit_compile=True, autograph=False)


@tf.autograph.experimental.do_not_convert
def compiled_apply(optimizer: Any, grads: list[Any], variables: list[Any], decision: tf.Tensor) -> bool:
    """Adds to the graph being traced one XLA-compiled call that applies
    `grads` with `optimizer` where `decision` is True and changes nothing
    where it is False. Returns False, adding nothing, if not `compilable`
    or when executing eagerly."""
    if tf.executing_eagerly() or not compilable(optimizer, grads, variables):
        return False
    # One function per optimizer and variables, kept across traces of the
    # step: XLA then compiles the update once, not at every retrace.
    functions = _FUNCTIONS.setdefault(optimizer, {})
    key = tuple(id(variable) for variable in variables)
    if key not in functions:
        functions[key] = compiled_update_function(optimizer, variables)
    with tf.device(tf_variable(variables[0]).device):  # where the variables are
        functions[key](decision, list(grads))
    return True
