"""Which variables a function writes, found by tracing it into a throwaway graph.

Contract of `written_variables(fn, specs, candidates)`: the `candidates` that
`fn(inputs)` assigns (assign, assign_add, assign_sub, scatter updates) when
traced with inputs of `specs`; nothing is executed, and a function that
cannot be traced this way gives none (the caller keeps its default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mp_callbacks._backend import keras, tf

__all__ = ["written_variables"]

# Ops that write the resource variable given as their first input.
_WRITE_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})


def _handle(variable: Any) -> Any:
    return (variable.value if isinstance(variable, keras.Variable) else variable).handle


def written_variables(fn: Callable[[Any], Any], specs: Any, candidates: Sequence[Any]) -> list[Any]:
    """The `candidates` that `fn` writes when traced with `specs`."""
    if not candidates:
        return []
    try:
        graph = tf.function(fn, autograph=False).get_concrete_function(specs).graph
    except Exception:  # the forward pass traces in the step anyway; no probe, no extra state
        return []
    by_handle = {id(_handle(v)): v for v in candidates}
    captured = {id(internal): by_handle.get(id(external)) for external, internal in graph.captures}
    written: list[Any] = []
    for op in graph.get_operations():
        if op.type in _WRITE_OPS or op.type.startswith("ResourceScatter"):
            variable = captured.get(id(op.inputs[0]))
            if variable is not None and all(variable is not seen for seen in written):
                written.append(variable)
    return written
