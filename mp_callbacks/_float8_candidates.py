"""float8 as a per-layer candidate of `autotune`: which `Dense` and
`EinsumDense` layers gain from `quantize("float8")` on this device.

Each such layer is measured on its own, on the inputs it receives from one
real batch: a copy under the candidate's policy against a copy quantized
to float8, trained side by side in paired, interleaved rounds (step time
ratio, `SpeedComparison`), after a few steps that let float8's delayed
scaling settle; then the float8 copy's output error against the plain
copy's and the share of its inputs and kernel that saturate. A layer
qualifies only when it is clearly faster and both figures stay under the
thresholds below; the side-by-side proof of the whole model then decides.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import all_layers
from mp_callbacks._layer_labels import layer_labels
from mp_callbacks.diagnosis import float8_figures
from mp_callbacks.speed_comparison import SpeedComparison

__all__ = ["FLOAT8_MAX_ERROR", "FLOAT8_MAX_SATURATION", "float8_layer_verdicts"]

#: The largest relative (L2) error of a float8 layer's output against the
#: same layer without float8, on the same inputs, for it to qualify.
FLOAT8_MAX_ERROR = 0.05
#: The largest share of a float8 layer's inputs or kernel clipped at its
#: scale (`HeadroomMonitor`'s `saturation`), for it to qualify.
FLOAT8_MAX_SATURATION = 0.05

_QUANTIZABLE = (keras.layers.Dense, keras.layers.EinsumDense)
_SETTLE_STEPS = 3
_STEPS_PER_ROUND = 3


def _first_inputs(model: Any, x: Any, layers: list[Any]) -> dict[int, np.ndarray]:
    """Each layer's first input on `x`, as a float32 array."""
    from mp_callbacks.diagnosis import recording_layers

    wanted = {id(layer) for layer in layers}
    seen: dict[int, np.ndarray] = {}
    with recording_layers(model) as records:
        model(x, training=False)
    for layer, inputs, _ in records:
        if id(layer) in wanted and inputs and id(layer) not in seen:
            seen[id(layer)] = keras.ops.convert_to_numpy(keras.ops.cast(inputs[0], "float32"))
    return seen


def _alone(layer: Any, inputs: np.ndarray, float8: bool) -> Any:
    """A model of one copy of `layer` (its weights, its policy), float8 if
    asked, compiled to train on `inputs` with a zero learning rate."""
    copy = type(layer).from_config(layer.get_config())
    entry = keras.Input(inputs.shape[1:])
    model = keras.Model(entry, copy(entry))
    copy.set_weights(layer.get_weights())
    if float8:
        copy.quantize("float8")
    model.compile(keras.optimizers.SGD(0.0), "mse")
    return model


def time_steps(model: Any, inputs: np.ndarray, targets: np.ndarray, steps: int) -> float:
    """Seconds a step of `model.train_on_batch` takes, over `steps`."""
    started = time.perf_counter()
    for _ in range(steps):
        model.train_on_batch(inputs, targets)
    return (time.perf_counter() - started) / steps


def _relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(ours - reference) / max(float(np.linalg.norm(reference)), 1e-30))


def float8_layer_verdicts(model: Any, x: Any, policy: str, rounds: int = 5) -> dict[str, dict[str, Any]]:
    """Layer label -> {"speedup", "speed", "speed_text", "error",
    "saturation", "verdict"} for every `Dense` and `EinsumDense` of `model`
    that computes in float16 or bfloat16, measured on the inputs of batch `x`;
    `verdict` is "passes" or the reasons it does not."""
    layers = [
        layer
        for layer in all_layers(model)
        if isinstance(layer, _QUANTIZABLE)
        and getattr(layer, "quantization_mode", None) is None
        # A layer kept in float32 (a head, a pinned layer) stays so.
        and getattr(layer, "compute_dtype", "") in ("float16", "bfloat16")
    ]
    inputs = _first_inputs(model, x, layers)
    labels = layer_labels(model)
    verdicts: dict[str, dict[str, Any]] = {}
    for layer in layers:
        if id(layer) not in inputs:
            continue
        batch = inputs[id(layer)]
        plain, quantized = _alone(layer, batch, False), _alone(layer, batch, True)
        targets = np.zeros(keras.ops.shape(plain(batch)), "float32")
        for model_alone in (plain, quantized):  # tracing, and float8's scales settle
            time_steps(model_alone, batch, targets, _SETTLE_STEPS)
        ratios = []
        for index in range(rounds):  # paired, interleaved, the order alternating
            pair = (plain, quantized) if index % 2 == 0 else (quantized, plain)
            seconds = {id(m): time_steps(m, batch, targets, _STEPS_PER_ROUND) for m in pair}
            ratios.append(seconds[id(plain)] / seconds[id(quantized)])
        comparison = SpeedComparison(ratios)
        plain_out = keras.ops.convert_to_numpy(keras.ops.cast(plain(batch), "float32"))
        float8_out = keras.ops.convert_to_numpy(keras.ops.cast(quantized(batch), "float32"))
        figures = next(iter(float8_figures(quantized, batch).values()))
        saturation = max(
            figures[tensor]["saturation"] for tensor in ("inputs", "kernel") if tensor in figures
        )
        entry = {
            "speedup": comparison.median,
            "speed": comparison.verdict,
            "speed_text": comparison.describe(),
            "error": _relative_error(float8_out, plain_out),
            "saturation": saturation,
        }
        problems = []
        if comparison.verdict != "faster":
            problems.append(f"not faster in float8 here: {comparison.describe()} {policy}'s speed")
        if entry["error"] > FLOAT8_MAX_ERROR:
            problems.append(f"output error {entry['error']:.1%} > {FLOAT8_MAX_ERROR:.0%}")
        if saturation > FLOAT8_MAX_SATURATION:
            problems.append(f"{saturation:.1%} saturate > {FLOAT8_MAX_SATURATION:.0%}")
        entry["verdict"] = "; ".join(problems) or "passes"
        verdicts[labels.get(id(layer), layer.name)] = entry
    return verdicts
