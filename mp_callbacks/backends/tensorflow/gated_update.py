"""An optimizer step that takes effect only where a predicate holds, without a `tf.cond`.

Contract of `gated_apply(optimizer, apply, predicate)`: `apply()` (the
optimizer's update) runs unconditionally; where `predicate` is True every
variable ends as the update alone would leave it, where it is False every
variable the optimizer writes (weights, slots, iteration count) is bit for
bit as it was. It returns False, adding nothing to the step, when the update
changes state in a way that cannot be gated; the caller then uses the
`tf.cond` (`_skip.apply_or_skip` chooses).

How: each write the optimizer makes through its `assign`, `assign_add` and
`assign_sub`, its weight decay and its iteration counter is gated by a
scalar `Select`, which forwards one input without copying. An increment
picks itself or a zero and is applied in place, as Keras applies it (adding
-0.0 or subtracting +0.0 changes no value): on a healthy step it reads and
writes exactly what Keras's own write does. The zero of a small variable is
a constant Grappler folds; a large one is a view of one zero buffer kept
per optimizer, so no zero is filled per step. An overwrite picks the new or
the old value (the old value is only forwarded, never copied). With `forward_done` (a
scalar computed from the loss), a sparse increment is written as soon as its
gradient exists, gated on it, and the rows it touches are read first and put
back on a skip (`rows_to_put_back`).

Every write is ordered after the forward pass's reads through data (the
gate), never by a control edge alone, which Grappler may drop. The update is
traced into a nested function first and its graph inspected, so that a
write by any other route (a custom `update_step` assigning a variable,
constraints, EMA, gradient accumulation, a random op) is detected. Why
without a cond, and what was measured: docs/design.md.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mp_callbacks._backend import keras, tf
from mp_callbacks._keras_internals import (
    optimizer_built_variables,
    replaced_on_instance,
    tf_optimizer_class,
    uses_weight_decay,
    weight_decay_replacement,
)

__all__ = ["gated_apply", "gradients_after", "tf_variable", "writes_are_kerass_own"]

# Zeros up to this size are constants Grappler folds; larger ones would be
# filled anew every step (Grappler does not fold them), so they are views of
# a zero buffer kept per optimizer instead.
_FOLDED_ZERO_MAX_ELEMENTS = 1 << 16

# Per optimizer, per (device, dtype, sign): one flat zero buffer, as large as
# the optimizer's largest variable of that dtype. Views of it (a dim-0 slice
# from 0, then a reshape) share its memory, so every large variable's zero
# costs nothing per step, and the memory of one variable in all.
_ZERO_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Stateful ops that only read state: they may appear anywhere in the update.
_READ_ONLY_STATEFUL_OPS = frozenset(
    {
        "ReadVariableOp",
        "VarHandleOp",
        "VarIsInitializedOp",
        "VariableShape",
        "ResourceGather",
        "ResourceGatherNd",
    }
)


def tf_variable(variable: Any) -> Any:
    return variable.value if isinstance(variable, keras.Variable) else variable


def _zero_buffer(optimizer: Any, variable: Any, negative: bool) -> tf.Tensor | None:
    """The optimizer's flat zero buffer for `variable`'s device and dtype
    (an eager tensor the step captures), or None if the variable is larger
    than every variable the optimizer was built with."""
    target = tf_variable(variable)
    key = (target.device, target.dtype, negative)
    buffers = _ZERO_BUFFERS.setdefault(optimizer, {})
    if key not in buffers:
        sizes = [
            tf_variable(v).shape.num_elements() or 0
            for v in optimizer_built_variables(optimizer) + list(optimizer.variables)
            if tf_variable(v).dtype == target.dtype
        ]
        size = max([*sizes, target.shape.num_elements() or 0])
        # Made eagerly, outside the step being traced, on the variable's own
        # device: the step reads it as a captured input, never a copy. -0.0
        # by negation: eager Python scalars are cached by value, and
        # -0.0 == 0.0.
        with tf.init_scope(), tf.device(target.device):
            zeros = tf.zeros([size], target.dtype)
            buffers[key] = -zeros if negative and target.dtype.is_floating else zeros
    buffer = buffers[key]
    if buffer.shape[0] < (target.shape.num_elements() or 0):
        return None
    return buffer


class _NotGatable(Exception):
    """Raised while tracing an update that has a write this module cannot gate."""


class _GatedWrites:
    """Stand-ins for an optimizer's write methods, gated on `predicate`."""

    def __init__(
        self,
        optimizer: Any,
        predicate: tf.Tensor,
        record: Callable,
        forward_done: tf.Tensor | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.predicate = predicate
        self.forward_done = forward_done
        self.record = record
        self.cls = type(optimizer)
        self._neutrals: dict[tuple, tf.Tensor] = {}
        # (variable, indices, rows before the write), in the order written.
        self.rows_to_put_back: list[tuple[Any, tf.Tensor, tf.Tensor]] = []

    def _pick(self, new: tf.Tensor, old: tf.Tensor) -> tf.Tensor:
        # The v1 `Select` with a scalar condition forwards `new` or `old`
        # itself; `tf.where` (SelectV2) would copy every element.
        return tf.raw_ops.Select(condition=self.predicate, x=new, y=old)

    def _write(self, variable: Any, combine: Callable[[tf.Tensor], tf.Tensor]) -> None:
        target = tf_variable(variable)
        old = target.value()
        target.assign(self._pick(combine(old), old), read_value=False)

    def _neutral(self, variable: Any, negative: bool) -> tf.Tensor | None:
        """A zero of `variable`'s shape: a folded constant when small (shared
        by every write of that shape), else a view of the optimizer's zero
        buffer; None if there is none large enough."""
        target = tf_variable(variable)
        shape, dtype = target.shape, target.dtype
        elements = shape.num_elements()
        if elements is None:
            return None
        if elements > _FOLDED_ZERO_MAX_ELEMENTS:
            buffer = _zero_buffer(self.optimizer, variable, negative)
            if buffer is None:
                return None
            # A dim-0 slice from 0 and a reshape alias the buffer: no copy.
            return tf.reshape(buffer[:elements], shape)
        key = (tuple(shape), dtype, negative)
        if key not in self._neutrals:
            zero = (
                tf.constant(-0.0 if negative else 0.0, dtype) if dtype.is_floating else tf.constant(0, dtype)
            )
            self._neutrals[key] = tf.fill(shape, zero)
        return self._neutrals[key]

    def _gated_increment(self, variable: Any, value: Any, subtract: bool) -> None:
        """Keras's own in-place `assign_add` / `assign_sub` of the value, or
        of a zero on a skip (x + (-0.0) and x - (+0.0) are x, -0.0 included)."""
        neutral = self._neutral(variable, negative=not subtract)
        if neutral is None:
            if subtract:
                self._write(variable, lambda old: old - tf.cast(value, old.dtype))
            else:
                self._write(variable, lambda old: old + tf.cast(value, old.dtype))
            return
        gated = self._pick(tf.cast(value, tf_variable(variable).dtype), neutral)
        write = self.cls.assign_sub if subtract else self.cls.assign_add
        write(self.optimizer, variable, gated)

    def assign(self, variable: Any, value: Any) -> None:
        with self.record():
            if isinstance(value, tf.IndexedSlices):
                # A sparse overwrite has no neutral value to gate with.
                raise _NotGatable
            self._write(variable, lambda old: tf.cast(value, old.dtype))

    def _sparse_increment(self, variable: Any, value: tf.IndexedSlices, subtract: bool) -> None:
        # x - (+0.0) and x + (-0.0) are x for every x, including -0.0. The
        # zeros' shape comes from the indices, known long before the values:
        # filling them does not hold up the write.
        values = value.values
        neutral = tf.fill(
            tf.concat([tf.shape(value.indices), tf.shape(tf_variable(variable))[1:]], axis=0),
            tf.constant(0.0 if subtract else -0.0, values.dtype),
        )
        if self.forward_done is None:
            gate = self.predicate
        else:
            # Not waiting for the decision: an Embedding's gradient comes last,
            # so its update would be the step's tail (step_overhead.py, the
            # Transformer). The gate orders it after the forward pass's reads.
            gate = self.forward_done
            target = tf_variable(variable)
            self.rows_to_put_back.append((target, value.indices, target.sparse_read(value.indices)))
        # A scalar v1 `Select` forwards one input whole; `tf.where` would copy.
        gated = tf.IndexedSlices(
            tf.raw_ops.Select(condition=gate, x=values, y=neutral), value.indices, value.dense_shape
        )
        write = self.cls.assign_sub if subtract else self.cls.assign_add
        write(self.optimizer, variable, gated)

    def assign_add(self, variable: Any, value: Any) -> None:
        with self.record():
            if isinstance(value, tf.IndexedSlices):
                self._sparse_increment(variable, value, subtract=False)
            else:
                self._gated_increment(variable, value, subtract=False)

    def assign_sub(self, variable: Any, value: Any) -> None:
        with self.record():
            if isinstance(value, tf.IndexedSlices):
                self._sparse_increment(variable, value, subtract=True)
            else:
                self._gated_increment(variable, value, subtract=True)

    def apply_weight_decay(self, variables: list[Any]) -> None:
        # Keras's TensorFlow `_apply_weight_decay`, gated: the same in-place
        # `variable.assign_sub(variable * wd * lr)`, bit for bit.
        optimizer = self.optimizer
        if optimizer.weight_decay is None:
            return
        with self.record():
            for variable in variables:
                if uses_weight_decay(optimizer, variable):
                    target = tf_variable(variable)
                    lr = tf.cast(optimizer.learning_rate, target.dtype)
                    wd = tf.cast(optimizer.weight_decay, target.dtype)
                    self._gated_increment(variable, target.value() * wd * lr, subtract=True)


def _routed(optimizer: Any, writes: _GatedWrites) -> Any:
    """The optimizer's writes routed through the gated ones for the duration
    (fenced in `_keras_internals.replaced_on_instance`)."""
    replacements = {name: getattr(writes, name) for name in ("assign", "assign_add", "assign_sub")}
    replacements.update(weight_decay_replacement(optimizer, writes.apply_weight_decay))
    return replaced_on_instance(optimizer, replacements)


# Keras increments the iteration counter with these, outside the routes above.
_COUNTER_WRITES = frozenset({"AssignAddVariableOp", "AssignVariableOp"})


# Data-dependent control flow in an update (Keras's sparse arithmetic uses it)
# may take paths a skipped step's state was never meant to reach, and one of
# Keras's fails there: such updates keep the tf.cond.
_CONTROL_FLOW_OPS = frozenset(
    {
        "If",
        "StatelessIf",
        "While",
        "StatelessWhile",
        "Case",
        "StatelessCase",
    }
)


def _writes_only_through(graph: Any, ours: set[str], counter_handle: str) -> bool:
    """True if every stateful op in `graph` is ours, only reads, or writes
    the iteration counter (whose value is put back afterwards), and the
    update has no control flow of its own."""
    for op in graph.get_operations():
        if op.type in _CONTROL_FLOW_OPS:
            return False
        if op.name in ours or not op.op_def.is_stateful:
            continue
        if op.type in _READ_ONLY_STATEFUL_OPS:
            continue
        if op.type in _COUNTER_WRITES and op.inputs[0].name == counter_handle:
            continue
        return False
    return True


def writes_are_kerass_own(optimizer: Any) -> bool:
    """An optimizer that overrides `assign`, `assign_add` or `assign_sub`,
    in its class or on the instance (a test's mock), may write something
    else than the value it is given (a gated zero included): only Keras's
    own write methods are known to be neutral."""
    TFOptimizer = tf_optimizer_class()
    names = ("assign", "assign_add", "assign_sub")
    return not any(name in vars(optimizer) for name in names) and all(
        getattr(type(optimizer), name) is getattr(TFOptimizer, name) for name in names
    )


# Python control flow over the traced graph, never over tensors: AutoGraph
# has nothing to convert (and cannot convert its context managers).
@tf.autograph.experimental.do_not_convert
def gradients_after(
    optimizer: Any, grads: Sequence[Any], variables: Sequence[Any], predicate: tf.Tensor
) -> list[Any]:
    """Each dense gradient, or a zero where `predicate` is False, through a
    scalar `Select` (which forwards its input, no copy): the optimizer's
    arithmetic on it then starts after the decision, as it does in Keras's
    `tf.cond`, so each increment is written while it is still in cache
    instead of all being held until the decision. On a skip every write is
    gated anyway; the zero only keeps inf and NaN out of the arithmetic."""
    out = []
    for grad, variable in zip(grads, variables):
        target = tf_variable(variable)
        if not isinstance(grad, tf.Tensor) or grad.dtype != target.dtype or not grad.shape.is_fully_defined():
            out.append(grad)
            continue
        elements = grad.shape.num_elements() or 0
        if elements > _FOLDED_ZERO_MAX_ELEMENTS:
            buffer = _zero_buffer(optimizer, variable, negative=False)
            if buffer is None:
                out.append(grad)
                continue
            zero = tf.reshape(buffer[:elements], grad.shape)
        else:
            zero = tf.zeros(grad.shape, grad.dtype)
        out.append(tf.raw_ops.Select(condition=predicate, x=grad, y=zero))
    return out


@tf.autograph.experimental.do_not_convert
def gated_apply(
    optimizer: Any,
    apply: Callable[[], None],
    predicate: tf.Tensor,
    forward_done: tf.Tensor | None = None,
    restore_on_skip: Sequence[tuple[Any, Any]] = (),
) -> bool:
    """Adds `apply()` (an update by `optimizer`) to the current graph so that
    it changes state only where the scalar `predicate` is True.

    `forward_done`, a boolean scalar computed from the loss (its
    finiteness), lets sparse increments (an Embedding's gradient) be applied
    without waiting for `predicate`: they wait for it instead, and the rows
    they touch are put back if `predicate` is False. `restore_on_skip`
    pairs `(variable, value)` are assigned in the same place.

    Returns False, having added nothing, if the update writes state in a way
    that cannot be gated, or when executing eagerly; the caller must then
    skip by other means. Call it while tracing a `tf.function`, outside any
    `tf.distribute` strategy.
    """
    if tf.executing_eagerly() or not isinstance(optimizer, keras.optimizers.Optimizer):
        return False  # eagerly, a tf.cond costs nothing: it is a Python if
    if not writes_are_kerass_own(optimizer):
        return False
    if getattr(optimizer, "gradient_accumulation_steps", None):
        # Accumulating updates branch on the step count (a cond of Keras's
        # own) and count iterations in a private variable: the tf.cond.
        return False
    ours: set[str] = set()
    counter_handle: dict[str, str] = {}
    rows_to_put_back: list[tuple[Any, tf.Tensor, tf.Tensor]] = []

    def update() -> None:
        graph = tf.compat.v1.get_default_graph()

        @contextlib.contextmanager
        def record() -> Iterator[None]:
            start = len(graph.get_operations())
            yield
            ours.update(op.name for op in graph.get_operations()[start:])

        iterations = tf_variable(optimizer.iterations)
        with record():
            iterations_before = tf.identity(iterations.value())
        counter_handle.setdefault("name", iterations_before.op.inputs[0].op.inputs[0].name)
        writes = _GatedWrites(optimizer, predicate, record, forward_done)
        with _routed(optimizer, writes):
            apply()
        rows_to_put_back[:] = writes.rows_to_put_back
        # Keras counts the iteration with a plain assign_add: put it back.
        # Scalar, so the copy is free; and correct even if no increment ran.
        with record():
            iterations.assign(
                tf.raw_ops.Select(condition=predicate, x=iterations.value(), y=iterations_before),
                read_value=False,
            )

    # Traced once into a throwaway function to inspect it, then again into
    # the step itself: calling the traced function instead would leave a
    # function call in the step, which TensorFlow does not inline here and
    # which costs healthy steps what the cond did.
    try:
        probe = tf.function(update, autograph=False).get_concrete_function()
    except _NotGatable:
        return False
    except ValueError:
        # The throwaway graph cannot hold every update: a sparse gradient
        # of unknown batch size reaches Keras's all-reduce (a
        # tf.custom_gradient) with parts from the step's graph, which
        # TensorFlow refuses there ("All custom_gradient outputs should be
        # from the same graph": a tied embedding, 4 samples in a batch of
        # 32). The caller skips by a tf.cond instead, as for any update
        # this module cannot gate.
        return False
    if not _writes_only_through(probe.graph, ours, counter_handle["name"]):
        return False
    update()
    if rows_to_put_back or restore_on_skip:

        def put_back() -> None:
            for variable, value in restore_on_skip:
                variable.assign(value)
            # Last write first: rows written twice get their first old value.
            for variable, indices, rows in reversed(rows_to_put_back):
                variable.scatter_update(tf.IndexedSlices(rows, indices))

        # Off the update's path: nothing waits for this cond.
        tf.cond(predicate, lambda: None, put_back)
    return True
