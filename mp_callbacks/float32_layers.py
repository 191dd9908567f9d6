"""`with_float32_layers`: acting on a diagnosis in one line."""

from __future__ import annotations

import copy
from collections.abc import Iterable

from mp_callbacks._backend import keras
from mp_callbacks._cloning import layers_within, rebuilt, set_nested_dtypes
from mp_callbacks._keras_internals import has_layer_graph, is_functional
from mp_callbacks._layer_labels import known_labels
from mp_callbacks._model_building import adopted_model_class
from mp_callbacks._validation import fail

__all__ = ["float32_copy", "with_float32_layers"]


def with_float32_layers(model: keras.Model, names: Iterable[str]) -> keras.Model:
    """A copy of `model` whose named layers compute in float32.

    The copy has the same architecture and the same weights; only the named
    layers' dtype policy becomes `"float32"` (the others keep theirs). If
    the original was compiled, the copy is compiled the same way, with a
    fresh optimizer of the same class and configuration. A
    `MixedPrecisionModel` stays one, with the same loss-scale settings.

    Args:
        model: `keras.Model`. A functional or Sequential model (a
            `MixedPrecisionModel` built functionally included).
        names: iterable of str. Names or paths of the model's layers at
            any depth (a top-level layer, or one inside a wrapper, a nested
            model or a custom layer: `block2/proj`), for example
            `report.float32_layers` from `diagnose_batch`, which names a
            layer by its path where another layer has the same name. A
            name that several layers share names all of them. Every layer
            inside a named one computes in float32 too.

    Example:

    ```python
    import keras
    import mp_callbacks as mp

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden", dtype="mixed_float16")(inputs)
    outputs = keras.layers.Dense(1, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    fixed = mp.with_float32_layers(model, ["hidden"])
    print(fixed.get_layer("hidden").compute_dtype)  # float32
    ```
    """
    names = [names] if isinstance(names, str) else list(names)
    if not all(isinstance(name, str) for name in names):
        fail("with_float32_layers", "names", names, "layer names (strings)", TypeError)
    if isinstance(model, keras.Sequential):
        functional = True
    else:
        functional = is_functional(model)
        try:
            functional = functional and bool(model.inputs) and bool(model.outputs)
        except (AttributeError, ValueError):
            functional = False
    if not functional:
        fail(
            "with_float32_layers",
            "model",
            model.name,
            "a functional or Sequential model (subclassed models define their layers in "
            "code: set dtype='float32' on those layers there)",
        )
    known = known_labels(model)
    unknown = [name for name in names if name not in known]
    if unknown:
        fail(
            "with_float32_layers",
            "names",
            unknown,
            f"names of the model's layers ({', '.join(known)})",
        )
    float32 = layers_within(model, names)
    config = copy.deepcopy(model.get_config())
    # A nested model's input in float32: its layers cast it to what they compute in.
    set_nested_dtypes(config.get("layers", []), input_dtype="float32")
    clone = rebuilt(
        model,
        config,
        type(model),
        lambda layer: "float32" if id(layer) in float32 else None,
    )
    if getattr(model, "compiled", False) and getattr(model, "optimizer", None) is not None:
        compile_config = keras.saving.deserialize_keras_object(model.get_compile_config())
        optimizer = model.optimizer
        compile_config["optimizer"] = type(optimizer).from_config(optimizer.get_config())
        clone.compile(**compile_config)
    return clone


def float32_copy(model: keras.Model) -> keras.Model:
    """A float32 copy of a (mixed-precision trained) model, for serving on
    hardware without fast low precision: every layer computes in float32,
    the weights are the same, and it is a plain `keras.Model` (or
    `keras.Sequential`), uncompiled, that needs no mp_callbacks to load or
    `export()`.

    Args:
        model: `keras.Model`. A functional or Sequential model (a
            `MixedPrecisionModel` included).

    Returns:
        The float32 copy.

    Example:

    ```python
    import keras
    import mp_callbacks as mp

    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, dtype="mixed_bfloat16")(inputs)
    served = mp.float32_copy(mp.MixedPrecisionModel(inputs, outputs))
    print(type(served).__name__, served.layers[-1].compute_dtype)  # Functional float32
    ```
    """
    if not has_layer_graph(model):
        fail(
            "float32_copy",
            "model",
            model.name,
            "a functional or Sequential model (a subclassed model: build it again under "
            "the float32 policy and copy the weights with set_weights)",
        )
    config = copy.deepcopy(model.get_config())
    config.pop("loss_scale", None)
    # In the config too (a wrapper's layer, a nested model's), so that a
    # save of the copy loads as float32 under any global policy.
    float32 = keras.dtype_policies.serialize(keras.dtype_policies.get("float32"))
    # An adopted KerasHub task is copied as the task (`generate()` kept),
    # its backbone's config in float32 too.
    adopted = adopted_model_class(type(model))
    set_nested_dtypes(config if adopted else config.get("layers", []), float32, input_dtype="float32")
    plain = adopted or (keras.Sequential if isinstance(model, keras.Sequential) else keras.Model)
    clone = rebuilt(model, config, plain, lambda layer: "float32", global_policy="float32")
    if plain is keras.Model and not keras.tree.is_nested(model.input) and keras.tree.is_nested(clone.input):
        # Keras 3.10's config round trip turns a single input into a list of one,
        # and the exported signature with it.
        clone = keras.Model(clone.inputs[0], clone.output, name=clone.name)
        clone.dtype_policy = "float32"  # made under the global policy, which may be mixed
    return clone
