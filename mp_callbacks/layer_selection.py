"""Which layers must compute in float32 under a mixed policy, measured.

On a few of the user's own batches, a layer is flagged when

* its output or its gradient goes non-finite (the origin `diagnose_batch`
  names, forward or backward),
* its true output (from a float32 replay of the batch) uses more than
  `FLOAT16_ADVICE_THRESHOLD` of float16's range, or
* its own computation differs from the same computation in float32 by
  more than `MAX_RELATIVE_ERROR` (relative L2 error, each layer replayed
  alone on its own low-precision inputs, so that it is not blamed for error
  it inherits): bfloat16's 8-bit mantissa loses a hand-written variance,
  E[x^2] - E[x]^2, on inputs with a large mean, where nothing overflows.

The set is then made minimal: pinned, the model is diagnosed again (and
any layer flagged only now is added), and a layer whose pinning changes
nothing (the model is still clean without it) is dropped. Pinning here
swaps dtype policies on the model for the duration, so it needs no rebuild
and works for subclassed models too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import all_layers
from mp_callbacks._layer_labels import layer_labels, layers_labelled
from mp_callbacks.diagnosis import (
    MAX_RELATIVE_ERROR,
    PrecisionLoss,
    computing_in_float32,
    diagnose_batch,
    own_precision_loss,
)

__all__ = [
    "MAX_RELATIVE_ERROR",
    "LayerSelection",
    "PrecisionLoss",
    "own_precision_loss",
    "own_relative_errors",
    "select_float32_layers",
]

_LOW_PRECISION = ("float16", "bfloat16")
_FLOAT16_MAX = 65504.0
# A loss scale that leaves a factor of 16 below float16's largest value:
# gradients grow as training moves off the initial weights.
_SCALE_HEADROOM = 16.0


@dataclass
class LayerSelection:
    """What `select_float32_layers` found.

    Attributes:
        layers: names of the layers to compute in float32, in forward order.
        reasons: layer name -> why it is in `layers`.
        dropped: layer name -> why it was flagged at first and then dropped.
        initial_scale: for float16, a loss scale from the largest gradient
            measured (None otherwise).
        notes: what could not be measured.
    """

    layers: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    initial_scale: float | None = None
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def pinned(model: keras.Model, names: Sequence[str]) -> Iterator[None]:
    """While active, the named layers (and the layers inside them) compute
    in float32."""
    named = layers_labelled(model, list(names))
    layers = [
        inner for name in names for layer in named[name] for inner in all_layers(layer, include_self=True)
    ]
    with computing_in_float32(model, layers=layers):
        yield


def own_relative_errors(model: keras.Model, x: Any) -> dict[str, float]:
    """Layer label -> the relative L2 error of the layer's own computation
    against the same computation in float32, in a training-mode pass of
    `x` (see `own_precision_loss`)."""
    return {label: loss.error for label, loss in own_precision_loss(model, x).items()}


def _flag(
    model: keras.Model, batches: Sequence[tuple[Any, Any]], pins: Sequence[str], compute_dtype: str
) -> tuple[dict[str, str], float]:
    """Layer name -> reason, for the model with `pins` in float32; and the
    largest gradient magnitude seen (for the loss scale)."""
    flags: dict[str, str] = {}
    gradient_max = 0.0
    with pinned(model, pins):
        for x, y in batches:
            report = diagnose_batch(model, x, y, loss_scale=1.0)
            gradient_max = max([gradient_max, *(g for g in report.gradient_max.values() if math.isfinite(g))])
            for name in report.float32_layers:
                if name in pins:
                    continue
                if report.precision_loss.get(name, 0.0) > MAX_RELATIVE_ERROR:
                    error = report.precision_loss[name]
                    flags.setdefault(name, f"it differs {error:.0%} from float32 (relative error)")
                elif name == report.layer_of(report.forward_origin):
                    flags.setdefault(name, "its output overflows (not finite)")
                elif name == report.layer_of(report.origin):
                    flags.setdefault(name, "the gradient it passes back is not finite")
                else:
                    reached = [r.activation_max for r in report.layers if r.layer == name]
                    share = max([report.reference_max.get(name, 0.0), *reached])
                    flags.setdefault(
                        name, f"its output reaches {share / _FLOAT16_MAX:.0%} of float16's range"
                    )
            for name, error in own_relative_errors(model, x).items():
                if name not in pins and error > MAX_RELATIVE_ERROR:
                    flags.setdefault(name, f"it differs {error:.0%} from float32 (relative error)")
            if not report.loss_finite and not flags:
                flags.setdefault(report.layer_of(report.origin) or "loss", "the loss is not finite")
    return {name: why for name, why in flags.items() if name != "loss"}, gradient_max


def select_float32_layers(
    model: keras.Model,
    batches: Sequence[tuple[Any, Any]],
    max_rounds: int = 3,
) -> LayerSelection:
    """The minimal set of layers to compute in float32 under the model's
    own policy, measured on `batches` (a few `(x, y)` of the user's data).

    Args:
        model: a built, compiled Keras model, built under the policy in
            question (its layers carry it).
        batches: `(x, y)` pairs, each one batch.
        max_rounds: how many times to re-diagnose with new layers pinned.
            Defaults to 3.

    Returns:
        A `LayerSelection`.
    """
    compute_dtype = _model_compute_dtype(model)
    selection = LayerSelection()
    if compute_dtype not in _LOW_PRECISION:
        return selection
    labels = layer_labels(model)
    order = [labels[id(layer)] for layer in all_layers(model)]
    pins: list[str] = []
    reasons: dict[str, str] = {}
    gradient_max = 0.0
    for _ in range(max_rounds):
        flags, measured = _flag(model, batches, pins, compute_dtype)
        gradient_max = max(gradient_max, measured)
        new = [name for name in flags if name not in pins]
        if not new:
            break
        reasons.update({name: flags[name] for name in new})
        pins += new
    else:
        flags, _ = _flag(model, batches, pins, compute_dtype)
        if flags:
            selection.notes.append(
                "still flagged after pinning: " + ", ".join(f"{n} ({w})" for n, w in flags.items())
            )
    # Minimal: a layer whose pinning changes nothing goes; containers are
    # tried first, so that the smallest layer that needs float32 is kept.
    size = {labels[id(layer)]: len(all_layers(layer)) for layer in all_layers(model)}

    def clean(names: list[str]) -> bool:
        return not _flag(model, batches, names, compute_dtype)[0]

    needed = _minimal(sorted(pins, key=lambda n: -size.get(n, 0)), [], clean)
    for name in [n for n in pins if n not in needed]:
        selection.dropped[name] = f"{reasons.pop(name)}, but pinning it changed nothing"
    pins = needed
    selection.layers = sorted(pins, key=lambda n: order.index(n) if n in order else len(order))
    selection.reasons = {name: reasons[name] for name in selection.layers}
    if compute_dtype == "float16":
        selection.initial_scale = initial_scale_for(gradient_max)
    return selection


def _minimal(candidates: list[str], kept: list[str], clean: Any) -> list[str]:
    """The smallest part of `candidates` that, pinned with `kept`, leaves
    the model clean: halves are dropped whole where they can be, so a few
    needed layers among many cost a few diagnoses each, not one per layer."""
    if not candidates or clean(kept):
        return []
    if len(candidates) == 1:
        return list(candidates)
    middle = len(candidates) // 2
    first, second = candidates[:middle], candidates[middle:]
    needed_first = _minimal(first, kept + second, clean)
    return needed_first + _minimal(second, kept + needed_first, clean)


def initial_scale_for(gradient_max: float) -> float:
    """The largest power of two that keeps `gradient_max` (the largest
    |gradient| of the unscaled loss) a factor of 16 below float16's
    largest value, within [1, 2**24]."""
    if not gradient_max or not math.isfinite(gradient_max):
        return 2.0**15
    exponent = math.floor(math.log2(_FLOAT16_MAX / (_SCALE_HEADROOM * gradient_max)))
    return float(2.0 ** int(np.clip(exponent, 0, 24)))


def _model_compute_dtype(model: keras.Model) -> str:
    dtypes = {getattr(layer, "compute_dtype", "float32") for layer in all_layers(model)}
    for dtype in ("float16", "bfloat16"):
        if dtype in dtypes:
            return dtype
    return "float32"
