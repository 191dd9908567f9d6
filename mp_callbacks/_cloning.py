"""A model rebuilt with other dtype policies and the same state.

Contract of `rebuilt(model, config, cls, policy_for)`: a new model
of the same architecture in which every layer, at any depth (inside
wrappers such as `Bidirectional` and `TimeDistributed`, nested models, and
the sublayers a custom layer makes in `__init__`), computes under
the policy chosen for it, and whose state is the original's, copied layer by
layer the way `save` / `load_model` copies it (each layer's
`save_own_variables` / `load_own_variables`, and its assets): an adapted
`Normalization` or lookup table keeps normalizing and looking up exactly as
in the original, which `set_weights` alone does not give.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from mp_callbacks._backend import BACKEND, keras
from mp_callbacks._keras_internals import all_layers, in_memory_deserialization
from mp_callbacks._layer_labels import layers_labelled

__all__ = ["copy_state", "layers_within", "rebuilt", "set_nested_dtypes"]

_LOW_PRECISION = ("float16", "bfloat16")


def _is_float_policy(dtype: Any) -> bool:
    """Whether a layer's serialized dtype is a float policy: an integer one
    (`Hashing`, `IntegerLookup` output ids) is the layer's output type."""
    try:
        policy = (
            keras.dtype_policies.deserialize(dtype)
            if isinstance(dtype, dict)
            else keras.dtype_policies.get(dtype)
        )
    except (TypeError, ValueError):
        return False
    return "float" in str(policy.compute_dtype) and policy.quantization_mode is None


def set_nested_dtypes(config: Any, dtype: Any = None, input_dtype: str | None = None) -> None:
    """Sets `dtype` (unless None) on every layer config nested in `config`
    (a wrapper's layer, a nested model's layers), in place. An input layer's dtype is
    its tensor's: a nested model's float16 or bfloat16 input becomes
    `input_dtype`, other inputs (integer ids) keep theirs."""
    if isinstance(config, dict):
        inner = config.get("config")
        if "class_name" in config and isinstance(inner, dict) and "dtype" in inner:
            if config["class_name"] != "InputLayer":
                if dtype is not None and _is_float_policy(inner["dtype"]):
                    inner["dtype"] = copy.deepcopy(dtype)
            elif inner["dtype"] in _LOW_PRECISION and input_dtype is not None:
                inner["dtype"] = input_dtype
        for value in config.values():
            set_nested_dtypes(value, dtype, input_dtype)
    elif isinstance(config, list):
        for value in config:
            set_nested_dtypes(value, dtype, input_dtype)


def _is_input_layer(layer: Any) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


def _paired_layers(source: keras.Model, target: keras.Model) -> list[tuple[Any, Any]]:
    """Each layer of `source` with the one in the same place in `target`
    (names may differ: a custom layer's sublayers are named anew). A
    stateless layer of `source` may be missing in `target`: Keras leaves
    out of a float32 graph a preprocessing layer that returns a float32
    input as it is (`Equalization` on a symbolic input).

    Raises:
        ValueError: the two models' layers differ otherwise.
    """
    # Input layers hold nothing to copy, and a model rebuilt from its config
    # may have more of them: a nested model built on the outer one's inputs
    # (a KerasHub task on its backbone's) gets an InputLayer of its own.
    ours, theirs = (
        [layer for layer in all_layers(model, include_self=True) if not _is_input_layer(layer)]
        for model in (source, target)
    )
    # The models themselves may differ in class (float32_copy's is a plain keras.Model).
    pairs = [(ours[0], theirs[0])]
    remaining = iter(theirs[1:])
    candidate = next(remaining, None)
    for layer in ours[1:]:
        if candidate is not None and type(candidate) is type(layer):
            pairs.append((layer, candidate))
            candidate = next(remaining, None)
        elif layer.weights:
            break  # a layer with state and no counterpart
    else:
        if candidate is None:
            return pairs
    raise ValueError(
        f"Cannot copy model {source.name!r}: rebuilt from its config it has other layers "
        f"({[type(layer).__name__ for layer in theirs[1:]]} instead of "
        f"{[type(layer).__name__ for layer in ours[1:]]}; does a custom layer's get_config give "
        "back the same layer?)."
    )


def _copy_state(pairs: list[tuple[Any, Any]]) -> None:
    for original, clone in pairs:
        store: dict[str, Any] = {}
        original.save_own_variables(store)
        if BACKEND == "jax":
            # A JAX variable assigned from another holds the same buffer: the
            # copy's first donating call would delete the original's.
            store = {key: np.array(keras.ops.convert_to_numpy(value)) for key, value in store.items()}
        clone.load_own_variables(store)
        if hasattr(original, "save_assets") and hasattr(clone, "load_assets"):
            with tempfile.TemporaryDirectory() as assets:
                original.save_assets(assets)
                clone.load_assets(assets)


def copy_state(source: keras.Model, target: keras.Model) -> None:
    """Copies every layer's state from `source` to `target` (the same
    architecture), as a `.keras` save and load would."""
    _copy_state(_paired_layers(source, target))


def _set_policies(pairs: list[tuple[Any, Any]], policy_for: Callable[[Any], Any]) -> None:
    for original, clone in pairs:
        policy = policy_for(original)
        if policy is None or _is_input_layer(clone):
            continue
        if getattr(clone.dtype_policy, "quantization_mode", None) is not None:
            continue  # a quantized layer keeps its quantization
        if "float" not in str(clone.dtype_policy.compute_dtype):
            continue  # an integer output (Hashing, IntegerLookup) is not a precision
        if clone.dtype_policy.name != keras.dtype_policies.get(policy).name:
            clone.dtype_policy = policy


def layers_within(model: keras.Model, names: list[str]) -> set[int]:
    """ids of the layers named (at any depth in `model`, by label or path:
    `_layer_labels`) and of every layer inside them."""
    named = layers_labelled(model, names)
    return {
        id(inner) for name in names for layer in named[name] for inner in all_layers(layer, include_self=True)
    }


def rebuilt(
    model: keras.Model,
    config: dict[str, Any],
    cls: Any,
    policy_for: Callable[[Any], Any],
    global_policy: str | None = None,
) -> keras.Model:
    """`cls.from_config(config)` with the state of `model` (see the
    module's contract), each layer of the copy under `policy_for(layer)`,
    called with the original's layer in the same place (None: the layer
    keeps the policy it has).

    `global_policy`, if given, is the global policy while the layers are
    made, so that the sublayers a custom layer makes in `__init__` without
    a dtype follow it too.
    """
    previous = keras.mixed_precision.global_policy()
    if global_policy is not None:
        keras.mixed_precision.set_global_policy(global_policy)
    try:
        with in_memory_deserialization():
            clone = cls.from_config(config)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"Cannot copy model {model.name!r}: Keras cannot rebuild it from its own config "
            f"({error}). A .keras save and load of this model fails the same way; the layer "
            "named there needs a get_config that its from_config accepts."
        ) from error
    finally:
        keras.mixed_precision.set_global_policy(previous)
    pairs = _paired_layers(model, clone)
    _set_policies(pairs, policy_for)
    # After the policies: a layer's loading may cast to its compute dtype
    # (Normalization's mean and variance).
    _copy_state(pairs)
    return clone
