"""The private Keras internals mp_callbacks relies on are all still there:
a Keras release that renames or changes one fails here, not in a user's run."""

from __future__ import annotations

import keras
import keras_canaries
import pytest


@pytest.mark.parametrize("canary", keras_canaries.CANARIES, ids=lambda c: c.name)
def test_internal_is_present_and_still_used(canary):
    users = keras_canaries.used_by(canary)
    assert users, f"{canary.name}: no library module names {canary.guards}: a canary for nothing"
    assert canary.present(), f"{canary.name} changed in keras {keras.__version__}; used by {', '.join(users)}"


def test_no_canary_fails():
    assert keras_canaries.missing() == []


def test_used_by_is_read_from_the_code():
    (xla,) = [c for c in keras_canaries.CANARIES if c.guards == ("compiling_with_xla",)]
    assert keras_canaries.used_by(xla) == ["backends/tensorflow/skip.py"]


def test_checked_versions_include_the_declared_lower_bound():
    import configparser
    import pathlib

    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parents[1] / "setup.cfg")
    requires = config["options"]["install_requires"]
    lower = next(
        line.split(">=")[1].split(",")[0].strip()
        for line in requires.splitlines()
        if line.strip().startswith("keras>=")
    )
    assert any(version.startswith(lower) for version in keras_canaries.CHECKED_ON)


# ---------------------------------------------------------------- the fence
# "Every private Keras and TensorFlow use is in _keras_internals.py"
# (CONTRIBUTING, docs/design.md), checked on the code: outside that module,
# no mp_callbacks or mp_callbacks_bench code reads, writes or overrides a
# private name that Keras's or TensorFlow's objects carry.

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _private_names(obj) -> set[str]:
    return {name for name in dir(obj) if name.startswith("_") and not name.startswith("__")}


def _keras_samples() -> dict[type, set[str]]:
    """For each kind of Keras object mp_callbacks subclasses or is given,
    the private names a real one carries (class and instance, after a fit)."""
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2)(keras.layers.Dropout(0.1)(keras.layers.BatchNormalization()(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.AdamW(), "mse", metrics=["mae"])
    history = model.fit(np.zeros((4, 3), "float32"), np.zeros((4, 2), "float32"), verbose=0)
    sequential = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    scaled.build(model.trainable_variables)
    samples = {
        keras.Model: [model, keras.Model, TensorFlowTrainer, sequential],
        keras.layers.Layer: [keras.layers.Layer, *model.layers],
        keras.optimizers.Optimizer: [model.optimizer, scaled, keras.optimizers.LossScaleOptimizer],
        keras.callbacks.Callback: [keras.callbacks.Callback(), history],
        keras.metrics.Metric: [keras.metrics.Mean(), *model.metrics],
        keras.Variable: [model.optimizer.iterations, tf.Variable(1.0)],
        object: [
            inputs,
            keras.DTypePolicy("float32"),
            keras.random.SeedGenerator(1),
            tf.distribute.get_strategy(),
        ],
    }
    return {kind: set().union(*map(_private_names, objects)) for kind, objects in samples.items()}


def _fence_breaches(path, module, samples) -> list[str]:
    import ast

    tree = ast.parse(path.read_text())
    every_keras_name = set().union(*samples.values())
    # Names mp_callbacks gives its own objects (a lock, a record), which
    # Keras's objects of the same kind do not carry.
    own = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        live = getattr(module, cls.name, None)
        kind_names = next(
            (names for kind, names in samples.items() if live and issubclass(live, kind)), set()
        )
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and node.attr not in kind_names
            ):
                own.add(node.attr)
            if isinstance(node, ast.FunctionDef) and node.name not in kind_names:
                own.add(node.name)
    breaches = []

    def breach(node, name):
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        breaches.append(f"{where}:{node.lineno}: {name}")

    def check(scope, kind_names):
        for node in ast.walk(scope):
            if isinstance(node, ast.FunctionDef) and node is not scope and node.name in kind_names:
                breach(node, f"overrides {node.name}")
            if isinstance(node, ast.Attribute):
                on_self = (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) or (
                    isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super"
                )
                names = kind_names if on_self else every_keras_name - own
                if node.attr in names:
                    breach(node, ast.unparse(node))
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in every_keras_name - own
            ):
                breach(node, ast.unparse(node))

    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            live = getattr(module, node.name, None)
            kind = next(
                (kind for kind in samples if live and isinstance(live, type) and issubclass(live, kind)), None
            )
            check(node, samples[kind] if kind is not None and kind is not object else set())
        else:
            check(node, set())
    return breaches


def test_private_keras_use_is_only_in_keras_internals():
    import importlib

    samples = _keras_samples()
    breaches = []
    for package in ("mp_callbacks", "mp_callbacks_bench"):
        for path in sorted((ROOT / package).glob("*.py")):
            if path.name in ("_keras_internals.py", "__main__.py"):
                continue
            module = importlib.import_module(f"{package}.{path.stem}")
            breaches += _fence_breaches(path, module, samples)
    assert breaches == []


def test_the_fence_finds_a_private_read_an_override_and_a_getattr(tmp_path):
    import types

    path = tmp_path / "probe.py"
    source = (
        "import keras\n"
        "def walk(model):\n"
        "    return list(model._flatten_layers())\n"
        "def tracker(model):\n"
        "    return getattr(model, '_loss_tracker', None)\n"
        "class Model(keras.Model):\n"
        "    def _maybe_symbolic_build(self, iterator=None, data_batch=None):\n"
        "        self._mine = 1\n"
        "        return super()._maybe_symbolic_build(iterator, data_batch)\n"
    )
    module = types.ModuleType("probe")
    exec(compile(source, "probe", "exec"), module.__dict__)
    path.write_text(source)
    breaches = _fence_breaches(path, module, _keras_samples())
    found = sorted(line.split(": ", 1)[1] for line in breaches)
    assert found == [
        "getattr(model, '_loss_tracker', None)",
        "model._flatten_layers",
        "overrides _maybe_symbolic_build",
        "super()._maybe_symbolic_build",
    ]
