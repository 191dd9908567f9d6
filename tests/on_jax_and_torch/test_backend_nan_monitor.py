"""NaNGradientMonitor on Keras's JAX and torch backends: handled overflow told apart
from divergence and from bad data, the variables and the layer named, with
its checks in step order (on JAX, the trained state synced only at a check)."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import mp_callbacks as mp

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)


def _poisoned_matmul_op():
    """`x @ kernel` whose kernel gradient is NaN (its inputs' is fine), in
    the backend's own way of defining a gradient."""
    if keras.backend.backend() == "jax":
        import jax
        import jax.numpy as jnp

        @jax.custom_vjp
        def matmul(x, kernel):
            return x @ kernel

        def forward(x, kernel):
            return x @ kernel, (x, kernel)

        def backward(saved, upstream):
            _, kernel = saved
            return upstream @ kernel.T, jnp.full_like(kernel, jnp.nan)

        matmul.defvjp(forward, backward)
        return matmul
    import torch

    class PoisonedMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, kernel):
            ctx.save_for_backward(kernel)
            return x @ kernel

        @staticmethod
        def backward(ctx, upstream):
            (kernel,) = ctx.saved_tensors
            return upstream @ kernel.T, torch.full_like(kernel, float("nan"))

    return PoisonedMatmul.apply


_poisoned_matmul = _poisoned_matmul_op()


class NaNGradientDense(keras.layers.Layer):
    """A Dense layer whose kernel gradient is NaN; its inputs' gradient is fine."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")

    def call(self, inputs):
        return _poisoned_matmul(inputs, keras.ops.cast(self.kernel, self.compute_dtype))


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, x[:, :3].argmax(axis=1)


def _poisoned_model(loss_scale=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, activation="relu", name="clean")(inputs)
    hidden = NaNGradientDense(4, name="poisoned")(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=loss_scale)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _linear(loss_scale=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1, name="head")(inputs), loss_scale=loss_scale)
    model.compile("sgd", "mse")
    return model


def test_raise_names_the_poisoned_layer_and_nothing_else():
    x, y = _data()
    with pytest.raises(mp.NonFiniteGradientError) as caught:
        _poisoned_model().fit(
            x,
            y,
            epochs=3,
            batch_size=8,
            verbose=0,
            callbacks=[mp.NaNGradientMonitor(patience=2, action="raise", check_every=1)],
        )
    error = caught.value
    assert error.variables == ["poisoned/kernel"] and error.origin == "poisoned"
    assert error.step == 2 and error.scale == 1.0
    assert "clean" not in str(error) and "head" not in str(error)
    assert "found by replaying the batch of the last skipped step" in str(error)
    assert error.report is not None and error.report.origin == "poisoned"


def test_overflow_handled_by_scaling_is_not_divergence():
    x, y = _data()
    # Scale 16 backs off to 1 in four skipped steps, loss scaling handling
    # them; at the floor, skips are divergence.
    model = _poisoned_model(mp.LossScaler(initial_scale=16.0, min_scale=1.0))
    monitor = mp.NaNGradientMonitor(patience=3, action="stop", check_every=1)
    history = model.fit(x, y, epochs=3, batch_size=8, verbose=0, callbacks=[monitor])
    assert monitor.handled_steps == 4 and monitor.skipped_steps == 4 + 3
    assert monitor.error is not None and monitor.error.step == 4 + 1 + 3 - 1
    assert "minimum" in str(monitor.error) and model.stop_training
    assert len(history.history["loss"]) == 2


def test_a_latch_restarted_at_a_check_stays_restarted_for_the_next_steps():
    """A check restarts the longest-divergent-run latch; mid-epoch on JAX a
    write is kept only after the trained state was synced. Lost, the run of
    steps 1-2 would be reported again at step 4."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype("float32")
    for batch in (0, 1, 3):  # divergent, divergent, clean, divergent, clean, clean
        x[batch * 4 : (batch + 1) * 4] = 1e30  # finite inputs whose loss overflows
    model = _linear()
    monitor = mp.NaNGradientMonitor(patience=2, action="warn", check_every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x, np.zeros((24, 1), "float32"), batch_size=4, verbose=0, shuffle=False, callbacks=[monitor]
        )
    diverged = [w for w in caught if "diverged" in str(w.message)]
    assert len(diverged) == 1 and "by step 2" in str(diverged[0].message)
    assert history.history["skipped_steps"] == [3.0] and monitor.skipped_steps == 3
    assert model.nonfinite_gradient_counts() == {"head/kernel": 3, "head/bias": 0}


def test_a_skipped_batch_with_nan_inputs_is_bad_data_not_divergence():
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    x[5, 1], x[6, 0] = np.nan, np.inf  # two rows of the second batch
    model = _linear()
    monitor = mp.NaNGradientMonitor(action="stop", check_every=1)
    with pytest.warns(mp.MixedPrecisionWarning, match=r"by step 2, .*\(2 of its 4 rows have a NaN or inf\)"):
        history = model.fit(
            x, np.zeros((16, 1), "float32"), batch_size=4, verbose=0, shuffle=False, callbacks=[monitor]
        )
    assert monitor.error is None and monitor.bad_data_steps == 1 and not model.stop_training
    assert history.history["skipped_steps"] == [1.0]
    (kept_x, kept_y, kept_weights), step = model.kept_batch()
    assert step == 1 and kept_weights is None
    np.testing.assert_array_equal(kept_x, x[4:8])  # NaN == NaN for assert_array_equal
    np.testing.assert_array_equal(kept_y, np.zeros((4, 1)))


def test_healthy_training_reads_the_device_only_every_check_every_steps():
    x, _ = _data(64)
    model = _linear()
    reads = []
    original = model.scaler.diagnostics
    model.scaler.diagnostics = lambda: reads.append(1) or original()
    monitor = mp.NaNGradientMonitor(check_every=5)
    history = model.fit(x[:, :4], x[:, 4:5], epochs=2, batch_size=4, verbose=0, callbacks=[monitor])
    # 32 steps: one read at train begin, at steps 5,10,15 / 21,26,31 and 2 epoch ends.
    assert len(reads) == 1 + 6 + 2
    assert monitor.error is None and monitor.skipped_steps == 0
    assert history.history["skipped_steps"] == [0.0, 0.0]
    assert model.kept_batch() is None and model.kept_batch_note() is None


def test_the_counters_are_saved_and_restored(tmp_path):
    model = _linear()
    x = np.full((8, 4), 1e30, "float32")
    model.fit(x, np.zeros((8, 1), "float32"), batch_size=4, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert (
        loaded.nonfinite_gradient_counts()
        == model.nonfinite_gradient_counts()
        == {"head/kernel": 2, "head/bias": 0}
    )
