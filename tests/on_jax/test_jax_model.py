"""MixedPrecisionModel on Keras's JAX backend: the scale, the exact skip and
the logs, in an install without TensorFlow."""

from __future__ import annotations

import sys

import jax
import keras
import numpy as np
import pytest
from backend_helpers import data as _data
from backend_helpers import functional as _functional
from backend_helpers import state as _state

import mp_callbacks as mp

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX backend's tests")


def test_runs_without_tensorflow():
    assert mp.BACKEND == "jax"
    assert "tensorflow" not in sys.modules


class _OwnStep(mp.MixedPrecisionModel):
    """keras-io's "Customizing what happens in fit() with JAX" step."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (_, (unscaled, _, non_trainable, metrics_vars)), grads = grad_fn(
            trainable,
            non_trainable,
            metrics_vars,
            x,
            y,
            None,
            training=True,
            optimizer_variables=optimizer_vars,
        )
        trainable, optimizer_vars = self.optimizer.stateless_apply(optimizer_vars, grads, trainable)
        return {"loss": unscaled}, (trainable, non_trainable, optimizer_vars, metrics_vars)


def test_your_own_stateless_step_is_never_less_safe_than_stock():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data(8)
    bad = x.copy()
    bad[0, 0] = np.nan
    kept = {}
    for cls in (keras.Model, _OwnStep):
        model = _functional(cls, batch_norm=False, dropout=False)
        model.compile(keras.optimizers.SGD(0.01), "mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # as stock compiles it
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        before = [v.numpy() for v in model.trainable_variables]
        model.fit(bad, y, batch_size=8, epochs=1, verbose=0)
        kept[cls] = all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
    assert kept[keras.Model] and kept[_OwnStep]


def test_every_public_name_runs_on_jax():
    assert {"LossScaleOptimizer", "LossScaler", "NaNGradientMonitor"} <= set(mp.__all__)
    for name in mp.__all__:
        assert getattr(mp, name) is not None, name


def test_data_parallel_on_two_devices_skips_on_every_device_alike():
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("two host devices are not available")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices[:2]))
    try:
        model = _functional(mp.MixedPrecisionModel, dropout=False)
        model.compile(keras.optimizers.SGD(0.01), "mse")
        x, y = _data(16)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        before = _state(model)
        bad = x[:8].copy()
        bad[7, 2] = np.inf  # in the second device's half of the batch
        history = model.fit(bad, y[:8], batch_size=8, epochs=1, verbose=0).history
        after = _state(model)
    finally:
        keras.distribution.set_distribution(None)
    assert history["skipped_steps"] == [1.0]
    assert [p for p in before if not np.array_equal(before[p], after[p])] == []
    # Each device holds only its half of the batch: none is kept to replay.
    assert model.kept_batch() is None and "keras.distribution" in model.kept_batch_note()


class _ScaledOwnStep(mp.MixedPrecisionModel):
    """A stateless step of your own that scales with the model's scale:
    its own loss (mean absolute error plus an activity penalty), one
    decision, everything kept on a skip."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y = data
        scaling = self.loss_scaling(non_trainable)

        def loss_fn(trainable_values, non_trainable_values):
            y_pred, new_non_trainable = self.stateless_call(
                trainable_values, non_trainable_values, x, training=True
            )
            loss = keras.ops.mean(keras.ops.abs(y - y_pred)) + 1e-3 * keras.ops.mean(keras.ops.square(y_pred))
            return scaling.scale(loss), (loss, new_non_trainable)

        (_, (loss, new_non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable
        )
        grads = scaling.unscale(grads)
        outcome = scaling.check(grads, loss)
        scaling.hand_over_if_skipped(outcome, non_trainable, (x, y, None), self.keep_skipped_batch)
        trainable, optimizer_vars = scaling.apply_if_finite(
            outcome, self.optimizer, optimizer_vars, grads, trainable
        )
        non_trainable = scaling.commit(outcome, list(new_non_trainable), list(non_trainable))
        non_trainable, logs = scaling.finish(outcome, non_trainable, x.shape[0])
        return {"loss": loss, **logs}, (trainable, non_trainable, optimizer_vars, metrics_vars)


def test_your_own_step_scales_and_skips_with_loss_scaling():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(_ScaledOwnStep)
    model.compile(keras.optimizers.Adam(1e-3), auto_scale_loss=False)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.get_scale() == 2.0**15
    x, y = _data(32)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    assert set(mp.LOG_KEYS) <= set(history)
    before = _state(model)
    bad = x[:8].copy()
    bad[1, 1] = np.nan
    history = model.fit(bad, y[:8], batch_size=8, verbose=0).history
    after = _state(model)
    assert [p for p in before if not np.array_equal(before[p], after[p])] == []  # BatchNorm's too
    assert history["skipped_steps"] == [1.0]
    assert model.loss_scale_state()["nonfinite_loss_steps"] == 1
    (kept_x, _, _), step = model.kept_batch()  # handed over by the step, for the replay
    assert step == 4 and np.isnan(kept_x).sum() == 1 and model.kept_batch_note() is None


def test_loss_scaling_refuses_a_keras_loss_scale_optimizer_that_would_unscale_twice():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(_ScaledOwnStep)
    model.compile(keras.optimizers.Adam(1e-3))  # stock: wrapped in Keras's LossScaleOptimizer
    x, y = _data(8)
    with pytest.raises(RuntimeError, match="auto_scale_loss=False"):
        model.fit(x, y, batch_size=8, verbose=0)


class _Subclassed(mp.MixedPrecisionModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8)
        self.norm = keras.layers.BatchNormalization()
        self.out = keras.layers.Dense(1, dtype="float32")

    def call(self, x, training=False):
        return self.out(self.norm(self.hidden(x), training=training))


@pytest.mark.parametrize(
    "fit_options",
    [{}, {"run_eagerly": True}, {"steps_per_execution": 2}, {"jit_compile": True}],
    ids=["default", "eager", "steps_per_execution", "jit"],
)
def test_a_subclassed_model_skips_exactly_however_keras_runs_the_step(fit_options):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(6)
    model = _Subclassed()
    model.compile(keras.optimizers.Adam(1e-3), "mse", **fit_options)
    x, y = _data(32)
    model.fit(x, y, batch_size=8, verbose=0)
    before = _state(model)
    bad = np.repeat(x[:8], 2, axis=0)
    bad[3, 0] = np.inf
    history = model.fit(bad, y[:16], batch_size=8, verbose=0, shuffle=False).history
    after_steps = model.loss_scale_state()["step_count"]
    assert history["skipped_steps"] == [1.0]  # the first batch; the second applies
    assert after_steps == 6
    changed = [p for p in before if not np.array_equal(before[p], _state(model)[p])]
    assert changed  # the healthy batch trained
    (kept_x, _, _), step = model.kept_batch()  # the skipped batch, for the replay
    assert step == 4 and np.isinf(kept_x).sum() == 1 and kept_x.shape == (8, 4)
    loss = model.evaluate(x, y, verbose=0)
    assert np.isfinite(loss)
    assert model.predict(x[:3], verbose=0).shape == (3, 1)


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_the_hand_over_stages_a_host_callback_only_where_fit_cannot_watch_the_step(
    steps_per_execution, monkeypatch
):
    # XLA:CPU runs a step holding any host callback 3-8 % slower, taken or
    # not: with one step per execution the train function watches the
    # step's logs instead. Either way the skipped batch is kept.
    staged = []
    callback = jax.debug.callback
    monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: staged.append(a) or callback(*a, **k))
    keras.mixed_precision.set_global_policy("float32")  # no calibrating skips
    model = _functional(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution=steps_per_execution)
    x, y = _data(16)
    x[10, 1] = np.nan
    history = model.fit(x, y, batch_size=4, verbose=0, shuffle=False).history
    assert history["skipped_steps"] == [1.0] and not any(k.startswith("_mp") for k in history)
    (kept_x, kept_y, _), step = model.kept_batch()
    assert step == 2 and np.isnan(kept_x).sum() == 1
    np.testing.assert_array_equal(kept_y, y[8:12])
    assert bool(staged) == (steps_per_execution > 1)
