"""The update compiled by XLA: equal to TensorFlow's, bit for bit, for every
optimizer it takes, and refused for every other.

A sweep over every optimizer class Keras offers, with dense and sparse
gradients: where `compilable` says yes, three applied steps equal stock
Keras's `optimizer.apply` traced without XLA and a skipped step changes no
bit; where it says no, the optimizer is one XLA would round differently or
one whose update is not known to be exact.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from mp_callbacks.backends.tensorflow import compiled_update as _compiled_update
from mp_callbacks.backends.tensorflow.compiled_update import (
    VERIFIED_OPTIMIZERS,
    VERIFIED_SPARSE_OPTIMIZERS,
    compilable,
)
from mp_callbacks.backends.tensorflow.skip import apply_or_skip


def _keras_optimizer_classes() -> dict[str, type]:
    """Every optimizer class `keras.optimizers` exports, but the wrapper."""
    return {
        name: cls
        for name, cls in vars(keras.optimizers).items()
        if inspect.isclass(cls)
        and issubclass(cls, keras.optimizers.Optimizer)
        and cls is not keras.optimizers.Optimizer
        and cls is not keras.optimizers.LossScaleOptimizer
    }


CLASSES = _keras_optimizer_classes()

# Options that change the update's arithmetic, on the classes that have them.
VARIANTS = {
    "SGD-momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "SGD-nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "SGD-weight-decay": lambda: keras.optimizers.SGD(0.1, weight_decay=0.01),
    "Adam-amsgrad": lambda: keras.optimizers.Adam(amsgrad=True),
    "AdamW-decay": lambda: keras.optimizers.AdamW(weight_decay=0.05),
    "Adam-clipvalue": lambda: keras.optimizers.Adam(clipvalue=0.01),
    "Lion-weight-decay": lambda: keras.optimizers.Lion(weight_decay=0.01),
}
# Never compiled, whatever the class: a norm (XLA reduces in its own order),
# a schedule (XLA computes its power), EMA and accumulation (state of their own).
REFUSED = {
    "Adam-clipnorm": lambda: keras.optimizers.Adam(clipnorm=1.0),
    "Adam-global-clipnorm": lambda: keras.optimizers.Adam(global_clipnorm=1.0),
    "Adam-schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-3, 10, 0.5)
    ),
    "Adam-ema": lambda: keras.optimizers.Adam(use_ema=True),
    "Adam-accumulation": lambda: keras.optimizers.Adam(gradient_accumulation_steps=2),
}


# Classes that need an argument to be made at all.
ARGUMENTS = {"MultiOptimizer": (lambda variable: keras.optimizers.Adam(),)}


def _make(name: str):
    if name in VARIANTS:
        return VARIANTS[name]()
    if name in REFUSED:
        return REFUSED[name]()
    return CLASSES[name](*ARGUMENTS.get(name, ()))


def _class_name(name: str) -> str:
    return name.split("-")[0]


def _variables_and_gradients(sparse: bool, steps: int):
    """Variables large enough that XLA's contraction, unchecked, changes some
    of their values (16,384 and 4,800 elements), and `steps` sets of
    gradients; a sparse one repeats rows, as a batch of tokens does."""
    rng = np.random.default_rng(7)
    shapes = [(64, 256), (256,), (300, 16)]
    values = [rng.normal(size=shape).astype("float32") * 0.1 for shape in shapes]
    gradients = []
    for _ in range(steps):
        dense = [tf.constant(rng.normal(size=shape).astype("float32") * 0.1) for shape in shapes]
        if sparse:
            indices = rng.integers(0, 40, size=120)
            rows = rng.normal(size=(120, 16)).astype("float32") * 0.1
            dense[2] = tf.IndexedSlices(tf.constant(rows), tf.constant(indices), tf.constant([300, 16]))
        gradients.append(dense)
    return values, gradients


def _bits(optimizer, variables) -> list[bytes]:
    return [np.asarray(v.numpy()).tobytes() for v in list(variables) + list(optimizer.variables)]


def _train(name: str, sparse: bool, how: str, decisions=(True, True, True)):
    """Runs one step per decision; `how`: 'stock' (`optimizer.apply` in a
    plain tf.function) or a mechanism of `apply_or_skip`. Returns the state
    before the last step, after it, and the mechanisms used."""
    values, gradients = _variables_and_gradients(sparse, len(decisions))
    variables = [keras.Variable(v) for v in values]
    optimizer = _make(name)
    optimizer.build(variables)
    used = []

    @tf.function
    def step(grads, decision):
        if how == "stock":
            optimizer.apply(grads, variables)
        else:
            used.append(apply_or_skip(optimizer, grads, variables, decision, mechanism=how))

    before = None
    for grads, decision in zip(gradients, decisions):
        before = _bits(optimizer, variables)
        step(grads, tf.constant(decision))
    return before, _bits(optimizer, variables), set(used)


def _expected_compilable(name: str, sparse: bool) -> bool:
    if name in REFUSED:
        return False
    verified = VERIFIED_SPARSE_OPTIMIZERS if sparse else VERIFIED_OPTIMIZERS
    return _class_name(name) in verified


def test_the_sweep_covers_every_verified_optimizer():
    assert set(VERIFIED_OPTIMIZERS) <= set(CLASSES)
    assert set(VERIFIED_SPARSE_OPTIMIZERS) <= set(VERIFIED_OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(CLASSES) + sorted(VARIANTS) + sorted(REFUSED))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_every_compiled_update_is_stocks_bit_for_bit_and_a_skip_changes_nothing(name, sparse):
    values, gradients = _variables_and_gradients(sparse, 1)
    optimizer = _make(name)
    variables = [keras.Variable(v) for v in values]
    assert compilable(optimizer, gradients[0], variables) == _expected_compilable(name, sparse)
    if not _expected_compilable(name, sparse):
        return
    _, stock, _ = _train(name, sparse, "stock")
    _, compiled, used = _train(name, sparse, "compiled")
    assert used == {"compiled"}
    assert compiled == stock, f"{name}: three compiled steps differ from TensorFlow's"
    before, skipped, _ = _train(name, sparse, "compiled", decisions=(True, True, False))
    assert skipped == before, f"{name}: a skipped compiled step changed state"


def test_a_subclass_an_override_a_constraint_float16_or_a_gpu_is_not_compiled():
    values, gradients = _variables_and_gradients(False, 1)
    variables = [keras.Variable(v) for v in values]

    class MyAdam(keras.optimizers.Adam):
        pass

    assert not compilable(MyAdam(), gradients[0], variables)
    overridden = keras.optimizers.Adam()
    overridden.apply_gradients = lambda pairs: None
    assert not compilable(overridden, gradients[0], variables)
    layer = keras.layers.Dense(256, kernel_constraint=keras.constraints.NonNeg())
    layer.build((None, 64))
    assert layer.kernel.constraint is not None
    constrained = [layer.kernel, *variables[1:]]
    assert not compilable(keras.optimizers.Adam(), gradients[0], constrained)

    class VariableOnAGPU:  # as a tf.Variable placed on a GPU reports itself
        dtype, constraint, device = "float32", None, "/job:localhost/replica:0/task:0/device:GPU:0"

    assert not compilable(keras.optimizers.Adam(), gradients[0], [VariableOnAGPU(), *variables[1:]])
    half = [keras.Variable(v, dtype="float16") for v in values]
    assert not compilable(keras.optimizers.Adam(), [tf.cast(g, "float16") for g in gradients[0]], half)
    assert compilable(keras.optimizers.Adam(), gradients[0], variables)


def _has_fma() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " fma" in cpuinfo.read_text()


@pytest.mark.skipif(not _has_fma(), reason="XLA contracts only where the CPU has FMA")
def test_without_the_barriers_xla_rounds_differently(monkeypatch):
    # What the barriers are for: with none, XLA's fused multiply-adds change
    # values TensorFlow's kernels round twice.
    _, stock, _ = _train("Adam", False, "stock")
    monkeypatch.setattr(_compiled_update, "_PRODUCT_OPS", frozenset())
    _, unshielded, used = _train("Adam", False, "compiled")
    assert used == {"compiled"}
    assert unshielded != stock


@pytest.mark.parametrize("base", [0.9, 0.999, 0.96])
def test_a_power_of_the_step_count_is_tensorflows_for_100000_steps(base):
    # Adam's, AdamW's, Adamax's and Nadam's bias corrections are powers of
    # their default betas (Nadam's decay 0.96) to the step count: three
    # steps of the sweep above cannot show a count where XLA's power and
    # TensorFlow's part.
    steps = 100_000

    def powers():
        # The base a constant, as in Keras's update.
        def body(i, powers):
            return i + 1, powers.write(i, tf.pow(tf.constant(base), tf.cast(i + 1, tf.float32)))

        initial = (tf.constant(0), tf.TensorArray(tf.float32, steps))
        return tf.while_loop(lambda i, _: i < steps, body, initial)[1].stack()

    compiled = tf.function(powers, jit_compile=True)().numpy()
    plain = tf.function(powers)().numpy()
    assert compiled.view(np.uint32).tolist() == plain.view(np.uint32).tolist()


def test_a_sparse_gradient_of_unknown_rows_is_not_compiled():
    # XLA compiles once per shape: a step traced for any number of rows
    # (sequences of any length) would compile at every new one.
    _, gradients = _variables_and_gradients(True, 1)
    variables = [keras.Variable(np.zeros(shape, "float32")) for shape in [(64, 256), (256,), (300, 16)]]
    optimizer, seen = keras.optimizers.Adam(), []

    @tf.function(input_signature=[tf.TensorSpec([None, 16]), tf.TensorSpec([None], tf.int64)])
    def trace(rows, indices):
        sparse = tf.IndexedSlices(rows, indices, tf.constant([300, 16], tf.int64))
        seen.append(compilable(optimizer, [*gradients[0][:2], sparse], variables))
        return rows

    trace.get_concrete_function()
    assert seen == [False]
    assert compilable(optimizer, gradients[0], variables)
