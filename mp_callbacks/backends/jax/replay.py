"""`diagnose_batch`'s backward pass on JAX: gradients at every layer.

JAX has no tape to watch a tensor with, so each layer call's floating
inputs and outputs get a zero "probe" added (`x + 0` is `x`, inf and NaN
included) and `jax.grad` is taken with respect to the probes and the
trainable values: the gradient at a probe is the gradient at that tensor.
Both passes run through `compute_loss_and_updates`, Keras's own stateless
loss, so no variable changes (BatchNormalization's statistics included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import layer_calls_wrapped
from mp_callbacks.backends.common.replay import LayerCall, Replay

__all__ = ["LayerCall", "Replay", "is_traced", "replay"]


def is_traced(tensors: list[Any]) -> bool:
    """Whether these are values of a JAX transformation's body (an RNN cell
    run by `lax.scan`): they exist only inside it, so they are not recorded."""
    return any(isinstance(t, jax.core.Tracer) for t in tensors)


def _is_floating(value: Any) -> bool:
    return keras.ops.is_tensor(value) and "float" in keras.backend.standardize_dtype(value.dtype)


def _floating(structure: Any) -> list[Any]:
    return [t for t in keras.tree.flatten(structure) if _is_floating(t)]


def _with_probes(structure: Any, probes: Iterator[Any]) -> Any:
    return keras.tree.map_structure(lambda t: t + next(probes) if _is_floating(t) else t, structure)


@contextlib.contextmanager
def _recorded(
    layers: list[Any], calls: list[LayerCall | None], completed: list[int], probes: list | None
) -> Iterator[None]:
    """While active, each call of `layers` is recorded in `calls` (by start
    order; `completed` gets its index on return) and, given `probes` (one
    (inputs, outputs) pair per call, by start order; None for a call inside
    a transformation's body), has them added. Without probes the pass runs
    on values, and a call whose outputs are traced is left out (None)."""

    def wrap(layer: Any, original: Any) -> Any:
        def recorded_call(*args: Any, **kwargs: Any) -> Any:
            index = len(calls)
            calls.append(None)
            probe = probes[index] if probes is not None else None
            if probe is not None:
                args, kwargs = _with_probes((args, kwargs), iter(probe[0]))
            outputs = original(*args, **kwargs)
            if probe is not None:
                outputs = _with_probes(outputs, iter(probe[1]))
            call = LayerCall(layer, _floating((args, kwargs)), _floating(outputs))
            if probes is None and is_traced(call.inputs + call.outputs):
                return outputs
            calls[index] = call
            completed.append(index)
            return outputs

        return recorded_call

    with layer_calls_wrapped(layers, wrap):
        yield


def replay(model: Any, layers: list[Any], x: Any, y: Any, sample_weight: Any, loss_scale: float) -> Replay:
    """The batch through `model` in training mode, statelessly, with each
    of `layers`' calls recorded and, when the model is compiled and `y`
    given, the gradients of `loss * loss_scale`."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    metrics = [v.value for v in model.metrics_variables]
    with_loss = y is not None and getattr(model, "compiled", False)
    optimizer_values = None
    if with_loss and model.optimizer is not None:
        optimizer_values = [v.value for v in model.optimizer.variables]

    def forward(trainable_values: list, probes: list | None, calls: list, completed: list) -> Any:
        with _recorded(layers, calls, completed, probes):
            if not with_loss:
                model.stateless_call(trainable_values, non_trainable, x, training=True)
                return None
            # The unscaled loss: Keras's own LossScaleOptimizer would scale it.
            _, (loss, *_) = model.compute_loss_and_updates(
                trainable_values,
                non_trainable,
                metrics,
                x,
                y,
                sample_weight,
                training=True,
                optimizer_variables=optimizer_values,
            )
            return loss

    calls: list = []
    completed: list[int] = []
    loss = forward(trainable, None, calls, completed)
    in_order = [calls[i] for i in completed]
    if loss is None:
        return Replay(in_order, None, [], [], [])
    probes = [
        None
        if call is None
        else ([keras.ops.zeros_like(t) for t in call.inputs], [keras.ops.zeros_like(t) for t in call.outputs])
        for call in calls
    ]

    def scaled_loss(trainable_values: list, probe_values: list) -> Any:
        unscaled = forward(trainable_values, probe_values, [], [])
        return keras.ops.cast(unscaled, "float32") * loss_scale

    weight_grads, probe_grads = jax.grad(scaled_loss, argnums=(0, 1))(trainable, probes)
    return Replay(
        in_order,
        loss,
        [list(probe_grads[i][0]) for i in completed],
        [list(probe_grads[i][1]) for i in completed],
        list(weight_grads),
    )
