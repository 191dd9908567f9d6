"""`PrecisionPlan`: a measured answer to "which precision, and where".

`mp.autotune` makes one: the dtype policy to train under, the few layers
that must compute in float32 under it, the initial loss scale, and the
evidence for each candidate it measured. A plan is plain data: it
round-trips through JSON, applies to a model built under any policy, and
prints as a table with the code to paste.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from mp_callbacks._backend import keras
from mp_callbacks._cloning import layers_within, rebuilt, set_nested_dtypes
from mp_callbacks._keras_internals import all_layers, has_layer_graph
from mp_callbacks._validation import fail
from mp_callbacks.hardware import POLICIES

__all__ = ["PrecisionPlan", "pin_float32", "quantize_float8"]

_OWNER = "PrecisionPlan"


def _layers_by_name(model: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for layer in all_layers(model):
        found.setdefault(layer.name, layer)
    return found


def pin_float32(model: Any, names: Iterable[str]) -> None:
    """Makes the named layers, and every layer inside them, compute in
    float32 (their dtype policy, kept in their config, so a `.keras` save
    keeps it). In place; the model must not have been traced yet."""
    by_name = _check_names(model, names)
    float32 = keras.dtype_policies.get("float32")
    for name in names:
        for layer in all_layers(by_name[name], include_self=True):
            if getattr(layer.dtype_policy, "quantization_mode", None) is None:
                layer.dtype_policy = float32


def quantize_float8(model: Any, labels: Iterable[str]) -> None:
    """Quantizes the labelled layers (names, or paths where a name repeats)
    to float8, in place (`Layer.quantize("float8")`: Dense, EinsumDense)."""
    from mp_callbacks._layer_labels import layers_labelled

    labels = list(labels)
    found = layers_labelled(model, labels)
    unknown = [label for label, layers in found.items() if not layers]
    if unknown:
        fail(_OWNER, "float8_layers", unknown, "names (or paths) of the model's Dense and EinsumDense layers")
    for layers in found.values():
        for layer in layers:
            if getattr(layer, "quantization_mode", None) is None:
                layer.quantize("float8")


def _check_names(model: Any, names: Iterable[str]) -> dict[str, Any]:
    """The model's layers by name; raises naming those `names` it lacks."""
    by_name = _layers_by_name(model)
    unknown = [name for name in names if name not in by_name]
    if unknown:
        fail(
            _OWNER,
            "float32_layers",
            unknown,
            f"names of the model's layers ({', '.join(sorted(by_name)[:12])}"
            f"{', ...' if len(by_name) > 12 else ''})",
        )
    return by_name


@dataclass
class PrecisionPlan:
    """A dtype policy, the layers that must stay float32 under it, and why.

    Args:
        policy: the dtype policy to train under ("float32",
            "mixed_bfloat16" or "mixed_float16").
        float32_layers: names of the layers that `autotune` found must
            compute in float32 under `policy` (layers inside them too).
            Defaults to none.
        initial_scale: the initial loss scale for float16, measured from the
            gradients' magnitudes; None for the default (2**15) or no
            scaling. Defaults to None.
        layer_dtypes: layer path -> dtype policy name, for every layer whose
            policy is not `policy` in the measured model (your own float32
            heads and the pinned layers), so that `apply` reproduces it on a
            model built under any policy. Defaults to none.
        reasons: why the plan is what it is, in sentences. Defaults to none.
        candidates: the evidence: one dict per candidate measured (policy,
            pinned layers and why, step time, speed-up and its spread,
            validation metric, skipped steps, divergence). Defaults to none.
        measured_on: the device the speed was measured on.
        float8_layers: labels (names, or paths where a name repeats) of
            the `Dense` and `EinsumDense` layers to quantize to float8
            (`layer.quantize("float8")`), each measured faster in float8 on
            this device with its error and saturation under `autotune`'s
            thresholds. Defaults to none.

    Example:

    ```python
    import keras
    import mp_callbacks as mp

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    plan = mp.PrecisionPlan("mixed_bfloat16", float32_layers=["head"])
    tuned = plan.apply(model)
    print(tuned.get_layer("hidden").compute_dtype, tuned.get_layer("head").compute_dtype)  # bfloat16 float32
    print(mp.PrecisionPlan.from_json(plan.to_json()) == plan)  # True
    ```
    """

    policy: str
    float32_layers: list[str] = field(default_factory=list)
    initial_scale: float | None = None
    layer_dtypes: dict[str, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    measured_on: str = ""
    interrupted: bool = False
    float8_layers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            fail(_OWNER, "policy", self.policy, f"one of {', '.join(POLICIES)}")
        if isinstance(self.float32_layers, str) or not all(
            isinstance(name, str) for name in self.float32_layers
        ):
            fail(_OWNER, "float32_layers", self.float32_layers, "a list of layer names", TypeError)
        self.float32_layers = list(self.float32_layers)
        if isinstance(self.float8_layers, str) or not all(
            isinstance(name, str) for name in self.float8_layers
        ):
            fail(_OWNER, "float8_layers", self.float8_layers, "a list of layer names", TypeError)
        self.float8_layers = list(self.float8_layers)
        if self.initial_scale is not None and not (
            isinstance(self.initial_scale, (int, float))
            and math.isfinite(self.initial_scale)
            and self.initial_scale >= 1.0
        ):
            fail(_OWNER, "initial_scale", self.initial_scale, "None or a finite number >= 1")

    # ---------------------------------------------------------- applying
    def dtype_policy_map(self) -> Any:
        """A `keras.dtype_policies.DTypePolicyMap`: `policy` by default,
        float32 (or the measured model's own policy) for the layers listed
        by path."""
        policy_map = {path: keras.dtype_policies.get(name) for path, name in self.layer_dtypes.items()}
        return keras.dtype_policies.DTypePolicyMap(
            default_policy=keras.dtype_policies.get(self.policy), policy_map=policy_map
        )

    def apply(self, model: keras.Model) -> keras.Model:
        """A copy of `model` with the plan applied: every layer under
        `policy` except those `layer_dtypes` lists (and `float32_layers`,
        float32), the same weights, the `float8_layers` quantized, compiled
        like the original (a fresh optimizer of the same configuration),
        with the plan's initial loss scale. A `.keras` save and load keeps the pinned layers float32.

        Args:
            model: `keras.Model`. A functional or Sequential model (a
                `MixedPrecisionModel` included), built under any policy.

        Returns:
            The new model (a `MixedPrecisionModel` if `model` was one).
        """
        if not has_layer_graph(model):
            fail(
                _OWNER,
                "model",
                model.name,
                "a functional or Sequential model (in a subclassed model, set "
                f"dtype='float32' on {', '.join(self.float32_layers) or 'the layers'} in its code)",
            )
        _check_names(model, self.float32_layers)
        float32 = layers_within(model, list(self.float32_layers))
        # Each top-level layer, and everything inside it, under the plan's
        # policy or the one the plan lists for it.
        top_level: dict[int, str] = {}
        for layer in all_layers(model, recursive=False):
            dtype = self.layer_dtypes.get(layer.path, self.layer_dtypes.get(layer.name, self.policy))
            for inner in all_layers(layer, include_self=True):
                top_level[id(inner)] = dtype

        def policy_for(layer: Any) -> str:
            if id(layer) in float32:
                return "float32"
            return top_level.get(id(layer), self.policy)

        config = model.get_config()
        scale_is_auto = getattr(model, "_loss_scale_is_auto", None)  # a MixedPrecisionModel's
        if "loss_scale" in config and scale_is_auto is not None and scale_is_auto():
            # The original's "auto" chose for its policy; the copy chooses for the plan's.
            config["loss_scale"] = "auto"
        # A nested model's input in float32: its layers cast it to what they compute in.
        set_nested_dtypes(config.get("layers", []), input_dtype="float32")
        clone = rebuilt(model, config, type(model), policy_for, global_policy=self.policy)
        if self.float8_layers:  # before compiling, as Keras asks
            quantize_float8(clone, self.float8_layers)
        if getattr(model, "compiled", False) and getattr(model, "optimizer", None) is not None:
            compile_config = keras.saving.deserialize_keras_object(model.get_compile_config())
            optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
            compile_config["optimizer"] = type(optimizer).from_config(optimizer.get_config())
            clone.compile(**compile_config)
        if self.initial_scale is not None and callable(getattr(clone, "set_loss_scale", None)):
            from mp_callbacks import LossScaler  # this backend's; the package imports this module

            clone.set_loss_scale(LossScaler(initial_scale=float(self.initial_scale)))
        return clone

    @property
    def code(self) -> str:
        """The lines to paste into a training script: the policy before
        the model is built, the pinned layers after."""
        lines = [f'keras.mixed_precision.set_global_policy("{self.policy}")  # before building the model']
        if self.float32_layers:
            lines.append(f"model = mp.with_float32_layers(model, {self.float32_layers!r})")
        for name in self.float8_layers:
            lines.append(f'model.get_layer("{name}").quantize("float8")')
        if self.initial_scale is not None:
            scale = f"mp.LossScaler(initial_scale={self.initial_scale:g})"
            lines.append(f"model = mp.MixedPrecisionModel.from_model(model, loss_scale={scale})")
        return "\n".join(lines)

    # ------------------------------------------------------------- JSON
    def to_json(self) -> str:
        """The plan and its evidence as JSON (`from_json` reads it back)."""
        return json.dumps(asdict(self), indent=2, default=_jsonable)

    @classmethod
    def from_json(cls, text: str) -> PrecisionPlan:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{_OWNER}.from_json: not a plan's JSON ({error})") from error
        if not isinstance(data, dict) or "policy" not in data:
            raise ValueError(f"{_OWNER}.from_json: not a plan's JSON (no 'policy')")
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    # ------------------------------------------------------------- text
    def table(self) -> str:
        """One row per candidate measured: step time, speed-up (median of
        paired rounds, with the spread), validation metric, skipped steps,
        pinned layers, and why it was or was not chosen."""
        headers = (
            "candidate",
            "step time (ms)",
            "speed-up",
            "validation",
            "skipped steps",
            "pinned to float32",
            "verdict",
        )
        rows = []
        for candidate in self.candidates:
            step = candidate.get("step_time")
            speedup = candidate.get("speedup")
            spread = candidate.get("speedup_range")
            metric = candidate.get("metric")
            rows.append(
                (
                    candidate["policy"],
                    "-" if step is None else f"{step * 1000:.1f}",
                    "-"
                    if speedup is None
                    else (f"{speedup:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")),
                    "-" if metric is None else f"{candidate.get('metric_name', '')} {metric:.4g}",
                    str(candidate.get("skipped_steps", "-")),
                    ", ".join(candidate.get("float32_layers", [])) or "-",
                    candidate.get("verdict", ""),
                )
            )
        widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [headers, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [
            f"plan: {self.policy}"
            + (f", {', '.join(self.float32_layers)} in float32" if self.float32_layers else "")
            + (f", initial loss scale {self.initial_scale:g}" if self.initial_scale else "")
            + (" (interrupted: what was measured so far)" if self.interrupted else "")
        ]
        if self.candidates:
            lines += ["", self.table()]
        if self.measured_on:
            lines.append(f"\nmeasured on: {self.measured_on}")
        lines += [f"- {reason}" for reason in self.reasons]
        lines += ["", "to use it:", *("    " + line for line in self.code.splitlines())]
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)
