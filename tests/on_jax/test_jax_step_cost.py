"""What a healthy step costs on JAX, counted by XLA rather than timed.

`bytes accessed` in the compiled step's cost analysis is the same number on
every run and machine, so these tests can hold the skip to the goal the
timings can only suggest: no more memory traffic than Keras's own
`LossScaleOptimizer`, whose skip keeps the weights and slots but not
BatchNormalization's statistics.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import mp_callbacks as mp
from mp_callbacks.backends.jax import step as jax_step

#: The loss scale's own few scalars and the per-gradient flags, in bytes.
SCALE_STATE_SLACK = 4096


def _model(cls):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((256,))
    h = keras.layers.Dense(512)(inputs)  # 131,072 weights: a large variable
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dense(512, activation="relu")(h)  # 262,144
    return cls(inputs, keras.layers.Dense(1)(h))


def _bytes_accessed(model, x, y) -> float:
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # builds as fit does
    state = tuple(
        [v.value for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y)).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float(analysis["bytes accessed"])


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3),
    "sgd_momentum": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
    "sgd": lambda: keras.optimizers.SGD(1e-2),
}


def _conv_model(cls):
    """Convolutions with BatchNormalization, as ResNet50 has them: where the
    check's fusion with the kernels that make the gradients shows."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((16, 16, 8))
    h = keras.layers.Conv2D(64, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Conv2D(128, 3, padding="same", use_bias=False)(h)  # 73,728 weights
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return cls(inputs, keras.layers.Dense(1)(h))


MODELS = {
    "mlp": (_model, (256,)),
    "conv_bn": (_conv_model, (16, 16, 8)),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("architecture", sorted(MODELS))
def test_a_healthy_step_moves_no_more_bytes_than_keras_loss_scale_optimizer(architecture, optimizer):
    build, input_shape = MODELS[architecture]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, *input_shape)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    stock = build(keras.Model)
    stock.compile(OPTIMIZERS[optimizer](), "mse")
    peer = build(keras.Model)
    peer.compile(keras.optimizers.LossScaleOptimizer(OPTIMIZERS[optimizer]()), "mse")
    ours = build(mp.MixedPrecisionModel)
    ours.compile(OPTIMIZERS[optimizer](), "mse")
    counted = {
        name: _bytes_accessed(m, x, y) for name, m in (("stock", stock), ("peer", peer), ("ours", ours))
    }
    # The check has no branch that healthy steps skip (XLA would count it):
    # every byte counted is one a healthy step moves.
    assert counted["ours"] <= counted["peer"] + SCALE_STATE_SLACK, counted
    # Choosing after the update instead of gating each write would copy
    # every weight and slot: ours stays well below that.
    variable_bytes = 4 * sum(int(np.prod(v.shape)) for v in stock.trainable_variables)
    assert counted["ours"] < counted["stock"] + variable_bytes, counted


def test_only_keras_own_optimizers_known_to_round_as_stock_gate_each_write():
    class MyAdam(keras.optimizers.Adam):
        pass

    assert jax_step.gates_writes_exactly(keras.optimizers.Adam())
    assert jax_step.gates_writes_exactly(keras.optimizers.SGD(momentum=0.9))
    assert not jax_step.gates_writes_exactly(MyAdam())  # its update may differ
    assert not jax_step.gates_writes_exactly(keras.optimizers.Adam(use_ema=True))
    assert not jax_step.gates_writes_exactly(keras.optimizers.Lion())
    known = {name for name in dir(keras.optimizers) if isinstance(getattr(keras.optimizers, name), type)}
    assert jax_step.GATED_WRITES_EXACT - known <= {"Muon", "Lamb", "ScheduleFreeAdamW"}  # newer Keras


def test_an_optimizer_of_your_own_updates_as_stock_and_skips_exactly():
    class MyAdam(keras.optimizers.Adam):
        pass

    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 256)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    trained = {}
    for cls in (keras.Model, mp.MixedPrecisionModel):
        model = _model(cls)
        model.compile(MyAdam(1e-2), "mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        trained[cls] = [np.array(v.numpy()) for v in model.trainable_variables]
    for stock, ours in zip(trained[keras.Model], trained[mp.MixedPrecisionModel]):
        np.testing.assert_array_equal(ours, stock)
    before = [np.array(v.numpy()) for v in model.variables]
    bad = x.copy()
    bad[0, 0] = np.nan
    history = model.fit(bad[:8], y[:8], batch_size=8, epochs=1, verbose=0).history
    assert history["skipped_steps"] == [1.0]
    for kept, now in zip(before, model.variables):
        if "mp_loss_scale_" not in now.path:  # the scale's own state moves
            np.testing.assert_array_equal(np.array(now.numpy()), kept, err_msg=now.path)
