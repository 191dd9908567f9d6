"""What every backend's `MixedPrecisionModel` shares: its log keys, a model
brought into the global policy by `from_model`, and the functional variant
of a subclass."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

from mp_callbacks._backend import keras
from mp_callbacks._keras_internals import (
    all_layers,
    functional_class,
    functional_init_arguments,
    init_functional,
    output_layers,
    register_serialized_name,
)
from mp_callbacks.errors import MixedPrecisionWarning
from mp_callbacks.model_checks import check_model

__all__ = [
    "LOG_KEYS",
    "adopted_model_class",
    "adopts_a_functional_class",
    "construct",
    "default_optimizer_argument",
    "follow_global_policy",
    "functional_variant",
    "warn_about_findings",
    "wrap_model",
]

logger = logging.getLogger("mp_callbacks.model")

#: The keys a MixedPrecisionModel's step adds to the training logs.
LOG_KEYS = ("loss_scale", "grad_norm", "skipped_steps")


def follow_global_policy(model: keras.Model) -> None:
    """Moves a model built under float32 into the mixed global policy set
    since (see `from_model`). Keras gives every layer made without a dtype
    the global policy object itself, so a layer still holding the model's
    own default object was not pinned by the user."""
    target = keras.mixed_precision.global_policy()
    default = model.dtype_policy
    if default.name != "float32" or target.compute_dtype == "float32" or target.quantization_mode:
        return
    outputs = {id(inner) for layer in output_layers(model) for inner in all_layers(layer, include_self=True)}
    moved = []
    for layer in all_layers(model):
        if layer.dtype_policy is not default or id(layer) in outputs:
            continue
        if isinstance(layer, keras.layers.InputLayer):
            continue
        layer.dtype_policy = target
        # A preprocessing layer's adapted statistics follow its compute dtype.
        if hasattr(layer, "finalize_state") and layer.built:
            layer.finalize_state()
        moved.append(layer.name)
    if moved:
        logger.info(
            "MixedPrecisionModel.from_model: %d layer(s) of %r built under float32 now compute "
            "under the global policy %r (the output layers stay float32): %s",
            len(moved),
            model.name,
            target.name,
            ", ".join(moved),
        )


_FUNCTIONAL_VARIANTS: dict[type, type] = {}


def adopted_model_class(cls: type) -> type | None:
    """The Keras model class, from outside this library, that `cls` (a
    MixedPrecisionModel or a subclass) also derives from: a KerasHub task
    (`class MyLM(MixedPrecisionModel, GPT2CausalLM)`); None for any other."""
    keras_own = set(functional_class().__mro__) | set(keras.Sequential.__mro__)
    for base in cls.__mro__:
        if not issubclass(base, keras.Model) or base in keras_own:
            continue
        if not any(c.__module__.split(".")[0] == "mp_callbacks" for c in base.__mro__):
            return base
    return None


def adopts_a_functional_class(cls: type) -> bool:
    """Whether `cls` adopts a Keras model class (`adopted_model_class`)
    and no class of it has a `call` of its own: its constructor (a KerasHub
    task's) builds it functionally."""
    keras_own = set(functional_class().__mro__)
    return adopted_model_class(cls) is not None and not any(
        "call" in vars(base) for base in cls.__mro__ if base not in keras_own
    )


def construct(model: Any, args: tuple, kwargs: dict, base_init: Any) -> None:
    """Builds a MixedPrecisionModel as keras.Model builds itself:
    functionally (`Model(inputs, outputs)`), through a functional variant
    of its class; otherwise by `base_init()` (the next class's constructor:
    keras.Model's, or an adopted task's, which builds functionally itself:
    Functional is mixed in first, so that Keras does not inject it into
    every base class, KerasHub resetting its own bases at each construction).
    The arguments that reach here decide (not a subclass's own constructor
    arguments, such as a VAE's encoder and decoder)."""
    if functional_init_arguments(args, kwargs):
        if not isinstance(model, functional_class()):
            model.__class__ = functional_variant(type(model))
        init_functional(model, args, kwargs)
        return
    if not adopts_a_functional_class(type(model)):
        base_init()
        return
    model.__class__ = functional_variant(type(model))
    # KerasHub's constructor resets its own bases to keras.Model, counting
    # on Keras to inject Functional again, which the variant makes
    # needless: put them back, or the tasks built before lose their `call`.
    bases = {cls: cls.__bases__ for cls in type(model).__mro__}
    try:
        base_init()
    finally:
        for cls, before in bases.items():
            if cls.__bases__ != before:
                cls.__bases__ = before


def default_optimizer_argument(compile_method: Any) -> Any:
    """The default `optimizer` of a compile method: keras.Model's
    "rmsprop", or the class's own (a KerasHub task's "auto")."""
    try:
        parameter = inspect.signature(compile_method).parameters.get("optimizer")
    except (TypeError, ValueError):
        parameter = None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return "rmsprop"
    return parameter.default


def functional_variant(cls: type) -> type:
    """`cls` with Functional mixed in, made once per class.

    keras.Model handles `SubClass(inputs, outputs)` by rewriting
    `SubClass.__bases__` in place, which would turn MixedPrecisionModel into
    a Functional-only class for the rest of the process and break every
    later subclass with its own `call`. A separate class per use keeps
    both ways of building a model working side by side.
    """
    Functional = functional_class()

    if Functional in cls.__bases__:  # a variant already
        return cls
    variant = _FUNCTIONAL_VARIANTS.get(cls)
    if variant is None:
        variant = type(
            cls.__name__,
            (cls, Functional),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__reduce__": _reduce_functional_variant,
            },
        )
        # Serialized under the name the user registered for `cls`.
        register_serialized_name(variant, keras.saving.get_registered_name(cls))
        _FUNCTIONAL_VARIANTS[cls] = variant
    return variant


def _reduce_functional_variant(model: Any) -> tuple[Any, tuple[Any, ...]]:
    """How pickle saves a functional model: Keras's way (the .keras archive
    in a buffer), rebuilt by `load_pickled_model`. Keras rebuilds with a
    method of the model's class, which pickle finds by name, and a variant
    made at run time has no name of its own."""
    variant: type[Any] = next(
        c for c in type(model).__mro__ if c.__dict__.get("__reduce__") is _reduce_functional_variant
    )
    _, arguments = super(variant, model).__reduce__()
    return load_pickled_model, arguments


def load_pickled_model(archive: io.BytesIO) -> Any:
    """The model a pickled functional model's archive holds, compiled as
    it was (with its loss scale), as Keras unpickles a model."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "pickled.keras")
        with open(path, "wb") as file:
            file.write(archive.getvalue())
        # As Keras's own unpickling: unpickling runs code anyway.
        return keras.saving.load_model(path, compile=True, safe_mode=False)


def warn_about_findings(model: Any, loading: bool) -> None:
    """What `check_model` finds, as one warning at a model's first compile
    (logged instead when the model is being loaded: it warned when it was
    first compiled)."""
    findings = [f for f in check_model(model) if f.kind != "not_checked"]
    if findings and loading:
        logger.info(
            "check_model found %d mixed-precision issue(s) in %r: %s",
            len(findings),
            model.name,
            "; ".join(map(str, findings)),
        )
        return
    if findings:
        warnings.warn(
            f"check_model found {len(findings)} mixed-precision issue(s) in "
            f"{model.name!r}:\n" + "\n".join(f"  - {f}" for f in findings),
            MixedPrecisionWarning,
            stacklevel=4,
        )


def wrap_model(cls: type, model: Any, loss_scale: Any, kwargs: dict[str, Any]) -> Any:
    """`cls.from_model(model, loss_scale, **kwargs)` on either backend: the
    same layers and weights, compiled as `model` was."""
    try:
        if isinstance(model, keras.Sequential):  # one input, one output
            inputs, outputs = model.inputs[0], model.outputs[0]
        else:
            inputs, outputs = model.input, model.output
    except (AttributeError, ValueError, IndexError, TypeError):
        inputs = outputs = None
    if inputs is None or outputs is None or not keras.tree.flatten(inputs):
        raise ValueError(
            "MixedPrecisionModel.from_model needs a model with known inputs "
            "and outputs (a functional model, or a Sequential that starts "
            f"with keras.Input); received model={model.name!r} of type "
            f"{type(model).__name__}. Subclassed models should subclass "
            "MixedPrecisionModel instead."
        )
    adopted = adopted_model_class(type(model))
    if adopted is not None:
        warnings.warn(
            f"MixedPrecisionModel.from_model wraps the graph of {model.name!r} in a functional "
            f"model, without the methods of {adopted.__name__} (a KerasHub task's generate(), "
            "preprocessor and saving). To keep them, subclass both and build it as "
            f"{adopted.__name__} is built: class Mixed{adopted.__name__}(MixedPrecisionModel, "
            f"{adopted.__name__}): pass.",
            MixedPrecisionWarning,
            stacklevel=3,
        )
    kwargs.setdefault("name", model.name)
    follow_global_policy(model)
    wrapped = cls(inputs=inputs, outputs=outputs, loss_scale=loss_scale, **kwargs)
    if getattr(model, "compiled", False):
        config = keras.saving.deserialize_keras_object(model.get_compile_config())
        config["optimizer"] = model.optimizer
        wrapped.compile(**config)
    return wrapped


@contextlib.contextmanager
def policy_scope(policy: str) -> Iterator[None]:
    """Sets the global dtype policy inside the block, and restores the
    previous one on the way out (errors included)."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)
