"""What a backend's replay for `diagnose_batch` returns: each layer call's
floating inputs and outputs and, with a loss, the gradients at them and at
the weights (JAX's from `jax.grad`, torch's from `torch.autograd.grad`)."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["LayerCall", "Replay"]


class LayerCall(NamedTuple):
    """One call of a layer: its floating inputs and outputs."""

    layer: Any
    inputs: list[Any]
    outputs: list[Any]


class Replay(NamedTuple):
    """The batch's calls (in order of completion: forward order), its
    unscaled loss (None without one) and, when there is a loss, the
    gradients of the scaled loss at each call's inputs and outputs and at
    the trainable variables (aligned with `model.trainable_variables`;
    empty without a loss)."""

    calls: list[LayerCall]
    loss: Any
    input_gradients: list[list[Any]]
    output_gradients: list[list[Any]]
    weight_gradients: list[Any]
