"""`diagnose_batch`'s backward pass on torch: gradients at every layer.

Each layer call's floating inputs and outputs get a zero "probe" added
(`x + 0` is `x`, inf and NaN included) that requires a gradient, and
`torch.autograd.grad` is taken with respect to the probes and the
trainable weights: the gradient at a probe is the gradient at that tensor.
It leaves the weights' `.grad` alone, and the pass runs in a stateless
scope, so no variable changes (BatchNormalization's statistics included).
The same `Replay` as JAX's (`backends/jax/replay.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import compute_loss, layer_calls_wrapped
from mp_callbacks.backends.common.replay import LayerCall, Replay

__all__ = ["replay"]


def _is_floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _probed(structure: Any, probes: list[Any] | None) -> tuple[Any, list[Any]]:
    """`structure` with a zero probe added to each floating tensor (when
    `probes` collects them), and those tensors as the layer saw them."""
    seen: list[Any] = []

    def probe(t: Any) -> Any:
        if not _is_floating(t):
            return t
        if probes is not None:
            zero = torch.zeros_like(t, requires_grad=True)
            probes.append(zero)
            t = t + zero
        seen.append(t)
        return t

    return keras.tree.map_structure(probe, structure), seen


@contextlib.contextmanager
def _recorded(
    layers: list[Any], calls: list[LayerCall], probes: list[tuple[list, list]] | None
) -> Iterator[None]:
    def wrap(layer: Any, original: Any) -> Any:
        def recorded_call(*args: Any, **kwargs: Any) -> Any:
            input_probes: list[Any] | None = [] if probes is not None else None
            output_probes: list[Any] | None = [] if probes is not None else None
            (args, kwargs), inputs = _probed((args, kwargs), input_probes)
            outputs, seen = _probed(original(*args, **kwargs), output_probes)
            calls.append(LayerCall(layer, [t.detach() for t in inputs], [t.detach() for t in seen]))
            if probes is not None:
                probes.append((input_probes or [], output_probes or []))
            return outputs

        return recorded_call

    with layer_calls_wrapped(layers, wrap):
        yield


def replay(model: Any, layers: list[Any], x: Any, y: Any, sample_weight: Any, loss_scale: float) -> Replay:
    """The batch through `model` in training mode, statelessly, with each
    of `layers`' calls recorded and, when the model is compiled and `y`
    given, the gradients of `loss * loss_scale`."""
    with_loss = y is not None and getattr(model, "compiled", False)
    calls: list[LayerCall] = []
    probes: list[tuple[list, list]] | None = [] if with_loss else None
    with keras.StatelessScope(collect_losses=True), _recorded(layers, calls, probes):
        if not with_loss:
            with torch.no_grad():
                model(x, training=True)
            return Replay(calls, None, [], [], [])
        y_pred = model(x, training=True)
        # The unscaled loss: Keras's own LossScaleOptimizer would scale it.
        loss = compute_loss(model, x, y, y_pred, sample_weight)
    assert probes is not None
    weights = [v.value for v in model.trainable_variables]
    flat_probes = [p for inputs, outputs in probes for p in inputs + outputs]
    scaled = loss.to(torch.float32) * loss_scale
    wanted = weights + flat_probes
    needs = [t.requires_grad for t in wanted]
    sources = [t for t, n in zip(wanted, needs) if n]
    found = torch.autograd.grad(scaled, sources, allow_unused=True, materialize_grads=True) if sources else []
    grads = iter(found)
    all_grads = [next(grads) if n else torch.zeros_like(t) for t, n in zip(wanted, needs)]
    weight_grads, rest = all_grads[: len(weights)], iter(all_grads[len(weights) :])
    input_gradients: list[list[Any]] = []
    output_gradients: list[list[Any]] = []
    for inputs, outputs in probes:
        input_gradients.append([next(rest) for _ in inputs])
        output_gradients.append([next(rest) for _ in outputs])
    return Replay(calls, loss.detach(), input_gradients, output_gradients, list(weight_grads))
