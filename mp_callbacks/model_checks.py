"""`check_model`: the usual mixed-precision model mistakes (and their
troubleshooting) as a check that names the layer at fault."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import (
    all_layers,
    computes_float8,
    has_layer_graph,
    inbound_tensors,
    output_layers,
    producing_layer,
    replaced_on_instance,
)
from mp_callbacks._loss_scale_source import LossScaleSource

__all__ = ["Finding", "check_model"]

_LOW_PRECISION = ("float16", "bfloat16")
_SQUASHING = ("softmax", "sigmoid", "log_softmax")
_NORMALIZATION = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.UnitNormalization,
)


# Alignment findings are kept for layers that carry at least this share of
# the model's multiply-adds: resizing a layer that costs less cannot speed
# the model up measurably.
MIN_COMPUTE_SHARE = 0.01
#: ... and at least this many multiply-adds a sample: below it a layer's
#: matrix products are too small for Tensor Core (or AMX) tiles to matter.
MIN_MULTIPLY_ADDS = 2**20

# Layers that look rows up by integer index: float ids rounded to a low
# precision look up other rows.
_INDEX_LOOKUPS = (keras.layers.Embedding, keras.layers.IntegerLookup, keras.layers.CategoryEncoding)
_EXACT_FLOAT_IDS = {"bfloat16": 256, "float16": 2048}


@dataclass(frozen=True)
class Finding:
    """One problem found in a model.

    Attributes:
        layer: name of the layer at fault (the model's name for model-wide
            findings; for a grouped finding, the layers' names joined by
            ", ").
        kind: `"output_dtype"`, `"low_precision_output_op"`,
            `"float16_activity_regularizer"`,
            `"float_index_input"`, `"tensor_core_alignment"`,
            `"missing_loss_scale"`, `"low_precision_variable"`, `"float16_result"`,
            `"float8_unsupported_layer"`, or `"not_checked"` (what the check could
            not see, such as a subclassed model's own `call`).
        message: what is wrong and what to do.
        layers: every layer the finding is about.
    """

    layer: str
    kind: str
    message: str
    layers: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"[{self.kind}] {self.layer}: {self.message}"


def _compute_dtype(layer: Any) -> str | None:
    return getattr(layer, "compute_dtype", None)


def _activation_name(layer: Any) -> str | None:
    if isinstance(layer, keras.layers.Softmax):
        return "softmax"
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", None)
    return name if name in _SQUASHING else None


def _is_pass_through(layer: Any) -> bool:
    """Layers that only cast or copy: what they get is what the loss gets."""
    if isinstance(layer, keras.layers.Identity):
        return True
    activation = getattr(layer, "activation", None)
    return isinstance(layer, keras.layers.Activation) and getattr(activation, "__name__", "") == "linear"


# Layers that keep each output feature a function of one input feature:
# behind them, a layer's size is still the size of the model's output.
_FEATURE_PRESERVING = (
    keras.layers.Activation,
    keras.layers.Softmax,
    keras.layers.Identity,
    keras.layers.Dropout,
    keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D,
    keras.layers.SpatialDropout3D,
    keras.layers.GaussianNoise,
    keras.layers.Flatten,
    keras.layers.Reshape,
    keras.layers.ReLU,
    keras.layers.LeakyReLU,
    keras.layers.PReLU,
    keras.layers.ELU,
    keras.layers.Cropping1D,
    keras.layers.Cropping2D,
    keras.layers.Cropping3D,
    keras.layers.ZeroPadding1D,
    keras.layers.ZeroPadding2D,
    keras.layers.ZeroPadding3D,
    keras.layers.UpSampling1D,
    keras.layers.UpSampling2D,
    keras.layers.UpSampling3D,
) + _NORMALIZATION


def _output_size_layers(output_layers: list[Any]) -> list[Any]:
    """The layers whose size is the output's, set by the task (a class
    count): the output layers, and the layer behind a head of activations,
    casts, dropout or reshapes (a Dense(classes) before a float32 softmax)."""
    return _walk_back(output_layers, lambda layer: isinstance(layer, _FEATURE_PRESERVING))


def _shape(tensor: Any) -> tuple | None:
    try:
        return tuple(tensor.shape)
    except (AttributeError, TypeError, ValueError):
        return None


def _multiply_adds(layer: Any) -> int:
    """Multiply-adds of one sample through a Dense or convolution layer (0
    for other layers or unknown shapes)."""
    try:
        input_shape, output_shape = _shape(layer.input), _shape(layer.output)
    except (AttributeError, ValueError):
        return 0
    if not input_shape or not output_shape or any(d is None for d in output_shape[1:]):
        return 0
    if input_shape[-1] is None:
        return 0
    if isinstance(layer, keras.layers.Dense):
        positions = 1
        for dim in output_shape[1:-1]:
            positions *= dim
        return positions * input_shape[-1] * output_shape[-1]
    kernel_size = getattr(layer, "kernel_size", None)
    if kernel_size is None:
        return 0
    taps = 1
    for dim in kernel_size:
        taps *= dim
    positions = 1
    channels_last = getattr(layer, "data_format", "channels_last") == "channels_last"
    spatial = output_shape[1:-1] if channels_last else output_shape[2:]
    for dim in spatial:
        positions *= dim
    in_channels = input_shape[-1] if channels_last else input_shape[1]
    if in_channels is None:
        return 0
    groups = getattr(layer, "groups", 1) or 1
    if isinstance(layer, keras.layers.DepthwiseConv2D):
        return positions * taps * in_channels * getattr(layer, "depth_multiplier", 1)
    out_channels = output_shape[-1] if channels_last else output_shape[1]
    return positions * taps * (in_channels // groups) * out_channels


def _parents(layer: Any) -> list[Any]:
    parents = []
    for tensor in inbound_tensors(layer):
        producer = producing_layer(tensor)
        if producer not in parents:
            parents.append(producer)
    return parents


def _walk_back(output_layers: list[Any], passes_through) -> list[Any]:
    """The output layers, and the layers behind those for which
    `passes_through(layer)` is true, breadth first, each once."""
    found, frontier = [], list(output_layers)
    while frontier:
        layer = frontier.pop(0)
        if layer in found:
            continue
        found.append(layer)
        if passes_through(layer):
            frontier.extend(_parents(layer))
    return found


def _layers_feeding_loss(output_layers: list[Any]) -> list[Any]:
    """The output layers, and behind pass-through ones (a float32 cast
    after a softmax) the layers whose values reach the loss unchanged."""
    return _walk_back(output_layers, _is_pass_through)


def _size_of(layer: Any) -> tuple[str, int] | None:
    for attribute in ("units", "filters"):
        value = getattr(layer, attribute, None)
        if isinstance(value, int):
            return attribute, value
    return None


# Keras computes these in float32 whatever their policy, and rounds only
# their output (tests/test_model_checks.py checks that it still does).
_NORMALIZATION_IN_FLOAT32 = (keras.layers.BatchNormalization, keras.layers.GroupNormalization)


def _saturating_operation(layer: Any) -> str | None:
    operation = _activation_name(layer)
    if (
        operation is None
        and isinstance(layer, _NORMALIZATION)
        and not isinstance(layer, _NORMALIZATION_IN_FLOAT32)
    ):
        operation = type(layer).__name__
    return operation


def _alignment_findings(
    layers: list[Any], low_precision: list[Any], output_size_layers: list[Any]
) -> list[Finding]:
    """One finding for the low-precision layers, with a real share of the
    compute and at least MIN_MULTIPLY_ADDS, whose size is not a multiple of 8."""
    costs = {id(layer): _multiply_adds(layer) for layer in layers}
    total = sum(costs.values())
    misaligned, minor = [], 0
    for layer in low_precision:
        size = _size_of(layer)
        if layer in output_size_layers or size is None or size[1] % 8 == 0:
            continue
        if costs[id(layer)] < MIN_MULTIPLY_ADDS:
            continue  # too small for alignment to matter
        share = costs[id(layer)] / total if total else 1.0
        if share < MIN_COMPUTE_SHARE:
            minor += 1
            continue
        misaligned.append((layer, size, share))
    if not misaligned:
        return []
    names = tuple(layer.name for layer, _, _ in misaligned)
    changes = ", ".join(
        f"{layer.name} {attribute}={value} -> {-(-value // 8) * 8}"
        for layer, (attribute, value), _ in misaligned
    )
    share = sum(share for _, _, share in misaligned)
    count = len(misaligned)
    message = (
        f"{'this layer has a size' if count == 1 else f'{count} layers have sizes'} that "
        f"{'is' if count == 1 else 'are'} not a multiple of 8 ({share:.0%} of the model's "
        f"multiply-adds, each at least 2**20 a sample); Tensor Cores (and AMX tiles) run at "
        f"full speed only on multiples of 8: {changes}."
    )
    if minor:
        message += (
            f" ({minor} more such layer{'s' if minor > 1 else ''}, each under "
            f"{MIN_COMPUTE_SHARE:.0%} of the compute, not listed.)"
        )
    return [Finding(", ".join(names), "tensor_core_alignment", message, names)]


def check_model(model: keras.Model) -> list[Finding]:
    """Checks a model for mixed-precision mistakes; returns the findings.

    * a softmax, sigmoid or normalization output that is not float32 under
      a mixed policy (a linear output, such as logits, is no mistake: Keras
      3's losses compute in float32 whatever the output's dtype);
    * a softmax, sigmoid or normalization computed in float16/bfloat16 that
      feeds the loss: it produces a model output, directly or through
      pass-through layers (a float32 `Activation("linear")` cast after a
      float16 softmax still feeds the loss a float16 softmax);
    * an `activity_regularizer` on a layer that computes in float16: its
      penalty (a sum over the whole batch's activations) is computed in
      float16 too, where it overflows past 65504 and makes the loss inf;
    * float model inputs (a `keras.Input` without `dtype`) cast to
      float16/bfloat16 on their way to an `Embedding` (or another index
      lookup), which then looks up other rows than the ids say;
    * hidden layers whose size (units, filters) is not a multiple of 8,
      which Tensor Cores need for full speed, grouped in one finding; only
      layers with at least `MIN_MULTIPLY_ADDS` multiply-adds a sample and
      `MIN_COMPUTE_SHARE` of the model's count, and output sizes (set by
      the task, such as a class count, also behind a float32 head or
      normalization, activation, cropping and padding layers) are not
      reported;
    * float16 computation with no loss scale (also a `train_step` of your
      own that, once traced, is known never to scale its loss);
    * trainable variables held in float16 or bfloat16 (a custom layer's
      `add_weight(dtype=...)`, LoRA adapters on older Keras): an update
      smaller than the variable's rounding step (2**-8 of it in bfloat16)
      is lost, so they stop learning; mixed precision keeps variables in
      float32 and computes in low precision;
    * integer ids cast to float16/bfloat16 by a nested model built without
      an `Input` of its own (a `Sequential([Embedding(...)])` inside
      another model): Keras makes its input the policy's float dtype, so
      id 999 looks up row 1000 in bfloat16;
    * a float16 result where no layer computes in float16: with
      `floatx` bfloat16, Keras types an integer tensor combined with a
      Python float as float16 (`ops.add(ids, 0.5)`), which overflows past
      65504;
    * a float8 dtype policy on a layer Keras does not quantize to float8
      (only `Dense` and `EinsumDense` have float8 arithmetic): the model
      builds, and its first training step fails.

    A subclassed model's tracked sub-models (a VAE's encoder and decoder)
    are checked too, and a `"not_checked"` finding says what could not be
    (the operations of its own `call`). A correct functional model gives an
    empty list. Layers are named in each finding.

    Args:
        model: `keras.Model`, built (any construction style).

    Returns:
        A list of `Finding`s.
    """
    findings = _check(model)
    layers = all_layers(model)
    if any(_compute_dtype(layer) == "float16" for layer in layers):
        findings += _loss_scale_findings(model)
    else:
        findings += _float16_result_findings([model, *layers])
    return findings + _low_precision_variable_findings(model) + _float8_unsupported_findings(layers)


def _float16_result_findings(models: list[Any]) -> list[Finding]:
    """Operations whose result is float16 in a model where no layer
    computes in float16 (keras-team/keras#23712), by walking each graph
    back from its outputs."""
    findings: dict[str, Finding] = {}
    for model in models:
        if not has_layer_graph(model):
            continue
        frontier = list(getattr(model, "outputs", None) or [])
        seen: set[int] = set()
        while frontier:
            tensor = frontier.pop()
            producer = producing_layer(tensor)
            if producer is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            frontier.extend(inbound_tensors(producer))
            if (
                keras.backend.standardize_dtype(tensor.dtype) != "float16"
                or isinstance(producer, keras.layers.InputLayer)  # a dtype the user chose
                or producer.name in findings
            ):
                continue
            findings[producer.name] = Finding(
                producer.name,
                "float16_result",
                f"it gives a float16 result ({type(producer).__name__}) although no layer computes "
                f"in float16: with floatx {keras.config.floatx()!r}, Keras types an integer tensor "
                "combined with a Python float as float16 (ops.add(ids, 0.5)), which overflows "
                "past 65504 and rounds to 11 bits. Cast the integer tensor to the float dtype "
                "first: ops.cast(ids, keras.config.floatx()).",
                (producer.name,),
            )
    return list(findings.values())


def _float8_unsupported_findings(layers: list[Any]) -> list[Finding]:
    """Layers given a float8 dtype policy that Keras cannot run in float8."""
    return [
        Finding(
            layer.name,
            "float8_unsupported_layer",
            f"it has the float8 policy {layer.dtype_policy.name!r}, but Keras has no float8 "
            f"arithmetic for {type(layer).__name__} (only Dense and EinsumDense): the model "
            "builds, and its first call in training fails with NotImplementedError. Give it "
            "the mixed policy instead (dtype='mixed_bfloat16' or 'mixed_float16') and quantize "
            'the Dense and EinsumDense layers with model.quantize("float8").',
            (layer.name,),
        )
        for layer in layers
        if getattr(layer.dtype_policy, "quantization_mode", None) == "float8" and not computes_float8(layer)
    ]


def _low_precision_variable_findings(model: keras.Model) -> list[Finding]:
    """Trainable variables stored in float16 or bfloat16, by the path of
    the layer that holds them."""
    by_layer: dict[str, list[str]] = {}
    for variable in model.trainable_variables:
        dtype = keras.backend.standardize_dtype(variable.dtype)
        if dtype in _LOW_PRECISION:
            owner, _, name = variable.path.rpartition("/")
            by_layer.setdefault(owner or model.name, []).append(f"{name} ({dtype})")
    held = sum(len(names) for names in by_layer.values())
    if held and held == len(model.trainable_variables) and len(by_layer) > 1:
        # Every variable: a low-precision variable policy ("bfloat16"), one finding.
        return [
            Finding(
                model.name,
                "low_precision_variable",
                f"all {held} of its trainable variables are kept in low precision (a dtype policy "
                "such as 'bfloat16' instead of 'mixed_bfloat16'): an update smaller than a "
                "variable's rounding step (2**-8 of its value in bfloat16) is lost, so training "
                "stalls. A mixed policy stores the variables in float32 and computes in low precision.",
                tuple(by_layer),
            )
        ]
    return [
        Finding(
            name,
            "low_precision_variable",
            f"it keeps trainable variables in low precision: {', '.join(variables)}. An update "
            "smaller than such a variable's rounding step (2**-8 of its value in bfloat16, 2**-11 "
            "in float16) is lost, so it stops learning. Create them in float32 "
            "(add_weight(dtype='float32'), or leave dtype unset: a mixed policy stores variables "
            "in float32 and casts them where it computes).",
            (name,),
        )
        for name, variables in by_layer.items()
    ]


def _has_graph(model: Any) -> bool:
    return has_layer_graph(model)


def _sub_models(model: keras.Model) -> list[keras.Model]:
    return [layer for layer in all_layers(model, recursive=False) if isinstance(layer, keras.Model)]


def _check(model: keras.Model) -> list[Finding]:
    """Every finding but the loss scale's, for `model` and its sub-models."""
    findings: list[Finding] = []
    layers = list(all_layers(model))
    low_precision = [layer for layer in layers if _compute_dtype(layer) in _LOW_PRECISION]
    if not low_precision and _compute_dtype(model) not in _LOW_PRECISION:
        return findings

    outputs_from = output_layers(model)
    reported = set()
    for tensor, layer in zip(getattr(model, "outputs", None) or [], outputs_from):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if dtype == "float32":
            continue
        operation = _saturating_operation(layer)
        if operation is None:
            # Linear outputs (logits, a regression): Keras 3's losses convert
            # y_pred to float32 before computing (byte for byte the loss of
            # float32-cast outputs), so a float16 output is not a mistake.
            continue
        if operation in _SQUASHING:
            # A float32 cast after it would not do: the squashing itself
            # must run in float32.
            remedy = (
                f"its {operation} is computed in {dtype}, where it saturates. Give this layer "
                f"dtype='float32', or let it output the logits and add "
                f"keras.layers.Activation('{operation}', dtype='float32') after it."
            )
        else:
            remedy = f"its {operation} is computed in {dtype}. Give this layer dtype='float32'."
        reported.add(layer.name)
        findings.append(
            Finding(
                layer.name,
                "output_dtype",
                f"model output is {dtype} under a mixed policy; {remedy}",
                (layer.name,),
            )
        )
    for layer in _layers_feeding_loss(outputs_from):
        dtype = _compute_dtype(layer)
        if dtype not in _LOW_PRECISION or layer.name in reported:
            continue
        operation = _saturating_operation(layer)
        if operation is not None:
            findings.append(
                Finding(
                    layer.name,
                    "low_precision_output_op",
                    f"{operation} is computed in {dtype} and feeds the loss; it "
                    "saturates and loses precision there. Give this layer "
                    "dtype='float32'.",
                    (layer.name,),
                )
            )

    sub_models = [] if _has_graph(model) else _sub_models(model)
    if sub_models:  # their layers are checked with them, once
        inside = {id(layer) for sub_model in sub_models for layer in all_layers(sub_model, include_self=True)}
        layers = [layer for layer in layers if id(layer) not in inside]
        low_precision = [layer for layer in low_precision if id(layer) not in inside]
    findings += _activity_regularizer_findings(low_precision)
    findings += _float_index_findings(layers)
    findings += _alignment_findings(layers, low_precision, _output_size_layers(outputs_from))
    if not _has_graph(model):
        checked = []
        for sub_model in sub_models:
            checked.append(sub_model.name)
            findings += [
                Finding(f.layer, f.kind, f"in sub-model {sub_model.name!r}: {f.message}", f.layers)
                for f in _check(sub_model)
            ]
        seen = f"; its sub-models {', '.join(map(repr, checked))} are" if checked else ""
        findings.append(
            Finding(
                model.name,
                "not_checked",
                f"{type(model).__name__} is subclassed: the operations written in its own call() "
                f"(and train_step) are not checked, only its layers{seen}.",
                (model.name,),
            )
        )
    return findings


def _activity_regularizer_findings(layers: list[Any]) -> list[Finding]:
    """Layers computing in float16 whose activity regularizer is computed
    there too (Keras applies it to the layer's output, in its dtype)."""
    return [
        Finding(
            layer.name,
            "float16_activity_regularizer",
            "its activity_regularizer is computed in float16, on the layer's output: the "
            "penalty sums over the whole batch and overflows past 65504, and an inf loss "
            "skips the step. Take the regularizer off this layer and add "
            "keras.layers.ActivityRegularization(l1=..., l2=..., dtype='float32') after it, "
            "which computes the same penalty in float32.",
            (layer.name,),
        )
        for layer in layers
        if _compute_dtype(layer) == "float16" and getattr(layer, "activity_regularizer", None) is not None
    ]


def _loss_scale_findings(model: keras.Model) -> list[Finding]:
    source = LossScaleSource.of(model)
    # An uncompiled model has not chosen its loss scale yet.
    compiled = getattr(model, "optimizer", None) is not None or source.scaler is not None
    if not compiled or source.active:
        return []
    return [
        Finding(
            model.name,
            "missing_loss_scale",
            "layers compute in float16 but no loss scale is in use: small "
            "gradients underflow to zero. Use loss_scale='auto' or a "
            "LossScaler (in your own train_step, scale the loss: "
            "loss = self.optimizer.scale_loss(loss)).",
            (model.name,),
        )
    ]


def _casts_floats(layer: Any) -> bool:
    return _compute_dtype(layer) in _LOW_PRECISION and getattr(layer, "autocast", True)


def _inputs_reach_lookups(host: Any, lookups: list[Any]) -> bool:
    """Whether what a custom layer's lookups get depends on its inputs:
    the layer is called on two small batches of different ids (1s, then
    2s) and the ids each lookup receives are compared. True when that
    cannot be told (the finding is then kept)."""
    specs = [tensor.shape for tensor in inbound_tensors(host)]
    if not specs:
        return True
    seen: list[list[np.ndarray]] = [[], []]

    def watching(lookup: Any, run: int) -> Any:
        call = lookup.call

        def watched(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            seen[run].append(np.asarray(keras.ops.convert_to_numpy(inputs)))
            return call(inputs, *args, **kwargs)

        return watched

    try:
        for run, value in enumerate((1.0, 2.0)):
            batch = [np.full([1 if d is None else d for d in shape], value, "float32") for shape in specs]
            with contextlib.ExitStack() as stack:
                for lookup in lookups:
                    stack.enter_context(replaced_on_instance(lookup, {"call": watching(lookup, run)}))
                host(batch[0] if len(batch) == 1 else batch)
    except Exception:  # a layer that cannot run on such a batch: keep the finding
        return True
    first, second = seen
    return len(first) != len(second) or any(
        a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(first, second)
    )


def _float_index_findings(layers: list[Any]) -> list[Finding]:
    """Index lookups whose ids come from a float model input and reach them
    cast to float16/bfloat16 (by a layer on the way, or the layer that holds
    the lookup)."""
    findings = []
    for host in layers:
        lookups = [
            inner for inner in all_layers(host, include_self=True) if isinstance(inner, _INDEX_LOOKUPS)
        ]
        if not lookups:
            continue
        if (
            host not in lookups
            and not (_has_graph(host) or getattr(host, "layer", None) in lookups)
            and not _inputs_reach_lookups(host, lookups)
        ):
            # A custom layer's call decides what its lookups get (ViT's
            # positions come from ops.arange), not its inputs.
            continue
        casts_on_entry = host not in lookups and _casts_floats(host)
        cast_to: str | None = _compute_dtype(host) if casts_on_entry else None
        frontier = [(tensor, cast_to) for tensor in inbound_tensors(host)]
        seen: set[int] = set()
        while frontier:
            tensor, cast = frontier.pop()
            dtype = keras.backend.standardize_dtype(tensor.dtype)
            if "float" not in dtype or id(tensor) in seen:
                continue  # integer ids are exact
            seen.add(id(tensor))
            cast = cast or (dtype if dtype in _LOW_PRECISION else None)
            producer = producing_layer(tensor)
            nested = _nested_model_with_input(producer, layers)
            if nested is not None:
                # The input of a model inside this one: its ids come from
                # where the nested model is called.
                outer = inbound_tensors(nested)
                if cast is not None and any("int" in keras.backend.standardize_dtype(t.dtype) for t in outer):
                    findings.append(_nested_cast_finding(nested, host, lookups[0], cast))
                    break
                frontier.extend((t, cast) for t in outer)
                continue
            if isinstance(producer, keras.layers.InputLayer):
                if cast is not None:
                    findings.append(
                        Finding(
                            host.name,
                            "float_index_input",
                            f"the ids come from the float model input {producer.name!r} (a "
                            f"keras.Input without dtype) and reach the {type(lookups[0]).__name__} "
                            f"in {host.name!r} cast to {cast}, where ids above "
                            f"{_EXACT_FLOAT_IDS[cast]} are rounded to other ids: the wrong rows are "
                            f"looked up. Declare the ids as integers: keras.Input(..., dtype='int32').",
                            (host.name,),
                        )
                    )
                    break
                continue
            frontier.extend((t, cast) for t in inbound_tensors(producer))
    return findings


def _nested_model_with_input(producer: Any, layers: list[Any]) -> Any:
    """The nested model among `layers`, called in the outer graph, whose
    own input `producer` is (an InputLayer), or None."""
    if not isinstance(producer, keras.layers.InputLayer):
        return None
    for layer in layers:
        if (
            isinstance(layer, keras.Model)
            and has_layer_graph(layer)
            and inbound_tensors(layer)
            and any(producing_layer(t) is producer for t in getattr(layer, "inputs", None) or [])
        ):
            return layer
    return None


def _nested_cast_finding(nested: Any, host: Any, lookup: Any, cast: str) -> Finding:
    return Finding(
        nested.name,
        "float_index_input",
        f"the nested model {nested.name!r} gets integer ids but has no integer keras.Input of "
        f"its own: Keras made its input {cast} and casts the ids to {cast} before the "
        f"{type(lookup).__name__} in {host.name!r}, where ids above {_EXACT_FLOAT_IDS[cast]} "
        f"are rounded to other ids (id 999 looks up row 1000 in bfloat16). Start "
        f"{nested.name!r} with keras.Input(shape, dtype='int32'), for a Sequential: "
        "keras.Sequential([keras.Input(shape, dtype='int32'), ...]).",
        (nested.name, host.name),
    )
