"""The model a benchmark trains: a built-in one, or the user's own.

`--model` takes `mlp`, `cnn`, `MODULE:FUNCTION` (importable, as in
`mypackage.models:build`) or `path/to/file.py:FUNCTION`. `FUNCTION()`
takes no argument and returns a Keras model, compiled or not; it is called
after the run's dtype policy is set, so its layers take that policy.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mp_callbacks_bench.settings import BUILT_IN_MODELS, BenchError

__all__ = ["ModelSpec", "build_model", "check_model_fits_data", "parse_model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """A parsed `--model` value: `kind` is "built-in", "module" or "file"."""

    text: str
    kind: str
    target: str = ""
    function: str = ""

    @property
    def name(self) -> str:
        return self.text if self.kind == "built-in" else self.function


def parse_model_spec(text: str) -> ModelSpec:
    """Checks the form of a `--model` value (no import happens here)."""
    if text in BUILT_IN_MODELS:
        return ModelSpec(text, "built-in", text)
    target, colon, function = text.rpartition(":")
    if not colon or not target or not function.isidentifier():
        raise BenchError(f"--model {text}: use mlp, cnn, MODULE:FUNCTION or path/to/file.py:FUNCTION")
    if target.endswith(".py") or os.sep in target or "/" in target:
        return ModelSpec(text, "file", target, function)
    if not all(part.isidentifier() for part in target.split(".")):
        raise BenchError(f"--model {text}: {target!r} is not a Python module name")
    return ModelSpec(text, "module", target, function)


def _import_target(spec: ModelSpec):
    if spec.kind == "file":
        path = os.path.abspath(spec.target)
        if not os.path.isfile(path):
            raise BenchError(f"--model {spec.text}: no such file {spec.target}")
        module_name = "_mp_callbacks_user_model_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise BenchError(f"--model {spec.text}: {spec.target} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        # A user's file may import its neighbours, as when run as a script.
        sys.path.insert(0, os.path.dirname(path))
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:
            raise BenchError(
                f"--model {spec.text}: importing {spec.target} failed: {type(error).__name__}: {error}"
            ) from error
        finally:
            sys.path.remove(os.path.dirname(path))
        return module
    sys.path.insert(0, os.getcwd())  # as `python -m` does: modules next to the user
    try:
        return importlib.import_module(spec.target)
    except ModuleNotFoundError as error:
        if error.name and spec.target.startswith(error.name):
            raise BenchError(f"--model {spec.text}: no module named {spec.target!r}") from error
        raise BenchError(
            f"--model {spec.text}: importing {spec.target} failed: {type(error).__name__}: {error}"
        ) from error
    except Exception as error:
        raise BenchError(
            f"--model {spec.text}: importing {spec.target} failed: {type(error).__name__}: {error}"
        ) from error
    finally:
        sys.path.remove(os.getcwd())


def load_model_function(spec: ModelSpec) -> Callable[[], Any]:
    """The user's `FUNCTION`, imported."""
    module = _import_target(spec)
    function = getattr(module, spec.function, None)
    if function is None:
        raise BenchError(f"--model {spec.text}: {spec.target} has no function {spec.function!r}")
    if not callable(function):
        raise BenchError(
            f"--model {spec.text}: {spec.function} is not a function (it is of type "
            f"{type(function).__name__})"
        )
    return function


def build_model(spec: ModelSpec, input_shape: Any, num_classes: int):
    """Builds the model under the current global dtype policy, compiled.

    A built-in model, or the user's `FUNCTION()`: a model it returns
    uncompiled is compiled with Adam, sparse categorical cross-entropy and
    accuracy. Sequential and functional models become `MixedPrecisionModel`s
    (same layers and weights) so that float16 runs get loss scaling; a
    subclassed one is trained as it is.
    """
    import keras

    import mp_callbacks  # noqa: F401  (checks Keras's backend first)
    from mp_callbacks import MixedPrecisionModel
    from mp_callbacks_bench.reference_models import MODELS

    if spec.kind == "built-in":
        if isinstance(input_shape, dict):
            raise BenchError(
                f"--model {spec.text}: a built-in model takes one input array, and the data has "
                f"named inputs {sorted(input_shape)}: give --model path/to/file.py:FUNCTION"
            )
        model = MODELS[spec.target](input_shape, num_classes)
    else:
        function = load_model_function(spec)
        try:
            model = function()
        except Exception as error:
            raise BenchError(
                f"--model {spec.text}: {spec.function}() raised {type(error).__name__}: {error}"
            ) from error
        if not isinstance(model, keras.Model):
            raise BenchError(
                f"--model {spec.text}: {spec.function}() returned {_short_repr(model)} (of type "
                f"{type(model).__name__}), not a Keras model"
            )
        if not isinstance(model, MixedPrecisionModel) and model.inputs:
            model = MixedPrecisionModel.from_model(model)
    if not getattr(model, "compiled", False):
        model.compile(
            optimizer=keras.optimizers.Adam(),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    return model


def check_model_fits_data(model, spec: ModelSpec, x, num_classes: int) -> None:
    """Raises BenchError, in one line, unless the model takes samples of
    `x`'s shape and gives one score per class to each (sparse labels)."""
    import keras

    import mp_callbacks  # noqa: F401  (checks Keras's backend first)
    from mp_callbacks_bench.data import first_samples

    sample_shape = (
        {key: tuple(leaf.shape[1:]) for key, leaf in x.items()} if isinstance(x, dict) else tuple(x.shape[1:])
    )
    try:
        output = model(
            keras.tree.map_structure(keras.ops.convert_to_tensor, first_samples(x, 2)), training=False
        )
    except Exception as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        expected = _input_shape_text(model)
        raise BenchError(
            f"--model {spec.text}: the model does not take the data's samples of shape "
            f"{sample_shape}{expected}: {type(error).__name__}: {first_line}"
        ) from error
    if isinstance(output, (list, tuple, dict)):
        raise BenchError(
            f"--model {spec.text}: the model has several outputs; bench needs one output of class scores"
        )
    shape = tuple(output.shape)
    if len(shape) != 2 or shape[-1] < num_classes:
        raise BenchError(
            f"--model {spec.text}: the model's output has shape {shape[1:]} per sample; the "
            f"data has {num_classes} classes, so it needs ({num_classes},)"
        )


def _input_shape_text(model) -> str:
    try:
        shapes = [tuple(tensor.shape[1:]) for tensor in model.inputs]
    except (AttributeError, ValueError, TypeError):
        return ""
    return f" (it expects {shapes[0]})" if len(shapes) == 1 else ""


def _short_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
