"""MixedPrecisionModel on Keras's PyTorch backend: what is torch's own (the
backend-neutral tests are in `on_jax_and_torch`): no TensorFlow or JAX in
the install, one host read per step, the keras-io torch step as safe as
stock, and `loss_scaling()` for a step of your own."""

from __future__ import annotations

import contextlib
import sys

import keras
import numpy as np
import pytest
from backend_helpers import OURS, functional
from backend_helpers import data as _data
from hypothesis import given, settings
from hypothesis import strategies as st
from scale_reference import configs

import mp_callbacks as mp
from mp_callbacks import _scale_state
from mp_callbacks.backends.common.step import StepOutcome, finished_state

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch backend's tests")

#: What turns a tensor into a Python value: on a GPU, each waits for the device.
HOST_READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy", "cpu")


def _functional(cls=keras.Model, batch_norm=True, **kwargs):
    return functional(cls, batch_norm=batch_norm, dropout=False, **kwargs)


@contextlib.contextmanager
def _counted_host_reads():
    """Counts the calls that read a tensor's value on the host."""
    count = [0]
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(original):
        def read(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _host_reads_per_step(model, x, y):
    model.fit(x, y, batch_size=len(x), verbose=0)  # builds the optimizer and the step
    model.make_train_function()
    step = model.train_function
    counts = []
    for batch in (x, np.where(np.arange(x.size).reshape(x.shape) == 0, np.nan, x).astype("float32")):
        data = [(torch.as_tensor(batch), torch.as_tensor(y))]
        with _counted_host_reads() as count:
            step(data)
        counts.append(count[0])
    return counts  # [healthy step, skipped step]


def test_runs_without_tensorflow_or_jax():
    assert mp.BACKEND == "torch"
    assert "tensorflow" not in sys.modules and "jax" not in sys.modules


def test_every_public_name_runs_on_torch():
    assert {"LossScaleOptimizer", "LossScaler", "NaNGradientMonitor"} <= set(mp.__all__)
    for name in mp.__all__:
        assert getattr(mp, name) is not None, name


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_a_step_reads_the_device_once_healthy_or_skipped(policy):
    keras.mixed_precision.set_global_policy(policy)
    x, y = _data(8)
    stock = _functional()
    stock.compile(keras.optimizers.Adam(1e-3), "mse", metrics=["mae"])
    ours = _functional(mp.MixedPrecisionModel)
    ours.compile(keras.optimizers.Adam(1e-3), "mse", metrics=["mae"])
    stock_reads = _host_reads_per_step(stock, x, y)
    # Stock Keras reads none in float32 and bfloat16 (and skips nothing);
    # under mixed_float16 its LossScaleOptimizer branches on the host, twice
    # on a healthy step in Keras 3.15 (the finite check, the growth). Ours
    # reads once, healthy or skipped: the decision.
    if policy == "mixed_float16":
        assert min(stock_reads) >= 1
    else:
        assert stock_reads == [0, 0]
    assert _host_reads_per_step(ours, x, y) == [1, 1]


class _KerasIoStep(mp.MixedPrecisionModel):
    """keras-io's "Customizing what happens in fit() with PyTorch" step."""

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        trainable_weights = list(self.trainable_weights)
        gradients = [v.value.grad for v in trainable_weights]
        with torch.no_grad():
            self.optimizer.apply(gradients, trainable_weights)
        return {"loss": loss}


def test_the_keras_io_torch_step_is_never_less_safe_than_stock():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data(8)
    bad = x.copy()
    bad[0, 0] = np.nan
    kept, trained = {}, {}
    for cls in (keras.Model, _KerasIoStep):
        model = _functional(cls, batch_norm=False)
        if cls is keras.Model:
            model.train_step = _KerasIoStep.train_step.__get__(model)
        model.compile(keras.optimizers.SGD(0.01), "mse")
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # as stock compiles it
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        before = [v.numpy() for v in model.trainable_variables]
        model.fit(bad, y, batch_size=8, epochs=1, verbose=0)
        kept[cls] = all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
        trained[cls] = before
    assert kept[keras.Model] and kept[_KerasIoStep]
    assert all(np.array_equal(a, b) for a, b in zip(trained[keras.Model], trained[_KerasIoStep]))


class _Gan(mp.MixedPrecisionModel):
    """Two optimizers, two losses, one scale and one decision: a step of
    your own with `loss_scaling()`."""

    def compile(self, **kwargs):
        super().compile(optimizer=keras.optimizers.Adam(1e-3), auto_scale_loss=False, **kwargs)
        self.second_optimizer = keras.optimizers.SGD(0.01)

    def train_step(self, data):
        x, y = data
        first = self.layers[1].trainable_weights
        rest = [w for w in self.trainable_weights if all(w is not f for f in first)]
        scaling = self.loss_scaling()
        with scaling.forward() as forward:
            y_pred = self(x, training=True)
            self.zero_grad()
            main_loss = keras.ops.mean((y - y_pred) ** 2)
            side_loss = keras.ops.mean(keras.ops.abs(y_pred))
        scaling.scale(main_loss + side_loss).backward()
        grads = scaling.unscale([w.value.grad for w in first + rest])
        outcome = scaling.check(grads, [main_loss, side_loss])
        scaling.apply_if_finite(outcome, self.optimizer, grads[: len(first)], first)
        scaling.apply_if_finite(outcome, self.second_optimizer, grads[len(first) :], rest)
        scaling.commit(outcome, forward)
        return {"loss": main_loss, **scaling.finish(outcome, x.shape[0])}


def test_your_own_step_with_two_optimizers_takes_one_decision_and_skips_exactly():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(_Gan)
    model.compile()
    assert model.get_scale() == 2.0**15
    x, y = _data(16)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    assert set(mp.LOG_KEYS) <= set(history)
    assert int(model.second_optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) >= 1

    def everything():
        variables = model.variables + model.optimizer.variables + model.second_optimizer.variables
        return [np.array(v.numpy()) for v in variables if OURS not in v.path]

    before = everything()
    bad = x[:8].copy()
    bad[1, 1] = np.nan
    history = model.fit(bad, y[:8], batch_size=8, verbose=0).history
    after = everything()
    assert all(np.array_equal(a, b) for a, b in zip(before, after))  # BatchNorm's and both optimizers'
    assert history["skipped_steps"] == [1.0]
    assert model.loss_scale_state()["nonfinite_loss_steps"] == 1
    assert _host_reads_per_step(model, x[:8], y[:8]) == [1, 1]  # two optimizers, one read


def test_loss_scaling_refuses_a_keras_loss_scale_optimizer_that_would_unscale_twice():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(_Gan)
    mp.MixedPrecisionModel.compile(model, keras.optimizers.Adam(1e-3))  # stock: Keras's LossScaleOptimizer
    model.second_optimizer = keras.optimizers.SGD(0.01)
    x, y = _data(8)
    with pytest.raises(RuntimeError, match="auto_scale_loss=False"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_stock_keras_on_torch_leaves_batchnorm_nan_where_the_model_keeps_it():
    # Why the step defers the forward pass's writes: stock Keras on torch
    # keeps the weights on a skipped step but not BatchNormalization's statistics.
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data(8)
    bad = x.copy()
    bad[0, 0] = np.nan
    finite = {}
    for cls in (keras.Model, mp.MixedPrecisionModel):
        model = _functional(cls)
        model.compile(keras.optimizers.SGD(0.01), "mse")
        model.fit(bad, y, batch_size=8, verbose=0)
        moving = [v for v in model.non_trainable_variables if "moving" in v.path]
        finite[cls] = all(np.isfinite(v.numpy()).all() for v in moving)
    assert finite == {keras.Model: False, mp.MixedPrecisionModel: True}


def test_the_kept_batch_of_a_skipped_step_is_the_batch_and_its_step():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(16)
    x[9, 2] = np.inf
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    (kept_x, kept_y, _), step = model.kept_batch()
    assert step == 1 and np.isinf(kept_x).sum() == 1 and kept_x.shape == (8, 4)
    np.testing.assert_array_equal(kept_y, y[8:])
    report = mp.diagnose_batch(model, kept_x, kept_y)
    assert report.first_nonfinite_layer is not None


def test_pytorchs_gradscaler_recipe_unscales_once_clips_true_gradients_and_skips():
    """scale(loss).backward(), unscale, clip, step: as with
    torch.amp.GradScaler, the clip sees the true gradients, and the step
    divides nothing again."""
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(2)
    layer.build((None, 4))
    optimizer = mp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0**12)
    x = torch.as_tensor(np.random.default_rng(0).normal(size=(8, 4)).astype("float32"))
    weights = list(layer.trainable_weights)
    before = [w.numpy().copy() for w in weights]

    loss = keras.ops.mean(layer(x) ** 2) * 100.0
    optimizer.scale_loss(loss).backward()
    scaled = [w.value.grad.clone() for w in weights]
    grads = optimizer.get_unscaled_gradients(scaled)
    true = [g / 2.0**12 for g in scaled]
    for got, want in zip(grads, true):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Clip by the global norm, as clip_grad_norm_ does, on the true gradients.
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(norm) > 1.0
    clipped = [g * (1.0 / norm) for g in grads]
    assert float(torch.sqrt(sum((g**2).sum() for g in clipped))) == pytest.approx(1.0, rel=1e-5)
    optimizer.apply(clipped, weights)
    for w, start, g in zip(weights, before, clipped):
        np.testing.assert_allclose(w.numpy(), start - g.numpy(), rtol=1e-6, atol=1e-7)
    assert int(optimizer.iterations.numpy()) == 1 and optimizer.get_scale() == 2.0**12

    # An inf gradient: nothing written, the scale halves.
    after = [w.numpy().copy() for w in weights]
    bad = [torch.full_like(g, float("inf")) for g in clipped]
    with _counted_host_reads() as count:
        optimizer.apply(bad, weights)
    assert count[0] == 1
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(after, weights))
    assert int(optimizer.iterations.numpy()) == 1 and optimizer.get_scale() == 2.0**11


def test_a_plain_model_with_the_loss_scale_optimizer_skips_in_fit_with_one_host_read():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(batch_norm=False)
    model.compile(mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10), "mse")
    x, y = _data(8)
    assert _host_reads_per_step(model, x, y) == [1, 1]
    assert model.optimizer.scaler.diagnostics()["skipped_steps"] == 1


_OUTCOMES = st.lists(st.sampled_from(["finite", "overflow", "bad_loss"]), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(config=configs(), outcomes=_OUTCOMES)
def test_the_state_machine_in_torchs_own_functions_equals_it_in_keras_ops(config, outcomes):
    from mp_callbacks.backends.torch import tensor_ops

    settings_ = _scale_state.ScaleSettings.checked(**config)
    initial = _scale_state.initial_values(settings_)
    start = {
        spec.name: torch.tensor(initial[spec.name], dtype=getattr(torch, spec.dtype))
        for spec in _scale_state.STATE_VARIABLES
    }
    epoch = {
        name: torch.tensor(0.0)
        for name in ("epoch_norm_sum", "epoch_applied", "epoch_skipped", "epoch_samples")
    }
    states = {"keras.ops": {**start, **epoch}, "torch": {**start, **epoch}}
    for number, outcome in enumerate(outcomes):
        applied = torch.tensor(outcome == "finite")
        flags = torch.tensor([int(outcome != "finite"), 0, int(outcome == "bad_loss")], dtype=torch.int64)
        step = StepOutcome(applied, flags, torch.tensor(0.5 + number))
        for way, xp in (("keras.ops", None), ("torch", tensor_ops)):
            after, logs = finished_state(settings_, states[way], step, 8, xp)
            states[way] = {**states[way], **after}
            states[way]["logs"] = logs
        for name, value in states["keras.ops"].items():
            other = states["torch"][name]
            if name == "logs":
                for key in value:
                    np.testing.assert_array_equal(np.asarray(value[key]), np.asarray(other[key]), err_msg=key)
                continue
            # (Keras 3.15's maximum of two int64 tensors on torch is int32;
            # the variables it is written to keep their dtype.)
            np.testing.assert_array_equal(value.numpy(), other.numpy(), err_msg=name)


_SCALES = st.one_of(
    st.floats(2.0**-24, 2.0**30, width=32),
    st.sampled_from([0.0, -1.0, -(2.0**10), float("inf"), float("-inf"), float("nan")]),
)
_COUNTS = st.integers(0, 2**40)


@settings(max_examples=200, deadline=None)
@given(
    config=configs(),
    scale=_SCALES,
    lowest=_SCALES,
    counters=st.fixed_dictionaries(dict.fromkeys(_scale_state.COUNTERS, _COUNTS)),
    epoch=st.lists(st.integers(0, 1000).map(float), min_size=4, max_size=4),
    norm=st.one_of(st.floats(0.0, 2.0**100, width=32), st.just(float("nan"))),
    loss_diverged=st.booleans(),
    batch_size=st.integers(1, 512),
)
def test_an_applied_step_in_place_equals_the_state_machine_bit_for_bit(
    config, scale, lowest, counters, epoch, norm, loss_diverged, batch_size
):
    """The healthy step's update on the host, from the one read
    (`backends/torch/applied_step`), against the general transition with
    `applied` true, on any state: hand-written scales (0, negative, inf,
    NaN) and counters included."""
    from mp_callbacks.backends.torch import tensor_ops
    from mp_callbacks.backends.torch.applied_step import (
        EPOCH_READ,
        READ_WITH_THE_DECISION,
        update_after_applied_step,
    )
    from mp_callbacks.backends.torch.step import read_on_host

    settings_ = _scale_state.ScaleSettings.checked(**config)
    start = {name: torch.tensor(value, dtype=torch.int64) for name, value in counters.items()}
    start.update(scale=torch.tensor(scale, dtype=torch.float32), lowest_scale=torch.tensor(lowest))
    names = ("epoch_norm_sum", "epoch_applied", "epoch_skipped", "epoch_samples")
    start.update({name: torch.tensor(value) for name, value in zip(names, epoch)})
    flags = torch.tensor([0, 0, int(loss_diverged)], dtype=torch.int64)
    outcome = StepOutcome(torch.tensor(True), flags, torch.tensor(norm))
    expected, expected_logs = finished_state(settings_, start, outcome, batch_size, tensor_ops)
    ours = {name: value.clone() for name, value in start.items()}
    loss = torch.tensor(float("nan") if loss_diverged else 0.25)
    reading = read_on_host(
        outcome.global_norm, loss, {n: ours[n] for n in READ_WITH_THE_DECISION + EPOCH_READ}
    )
    assert reading.loss_diverged == loss_diverged and reading.applied == np.isfinite(norm)
    logs = update_after_applied_step(
        settings_, ours, reading.values, loss_diverged, outcome.global_norm, batch_size
    )
    for name, value in expected.items():
        np.testing.assert_array_equal(ours[name].numpy(), value.to(ours[name].dtype).numpy(), err_msg=name)
    assert set(logs) == set(expected_logs)
    for key, value in expected_logs.items():
        np.testing.assert_array_equal(np.float32(logs[key]), np.asarray(value), err_msg=key)


@pytest.mark.slow
def test_under_torch_compile_the_step_skips_exactly_and_compiles_once(caplog):
    # jit_compile=True runs the step through torch.compile: the host
    # decision is a graph break, not a recompile per step.
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.Adam(1e-3), "mse", jit_compile=True)
    assert model.jit_compile
    x, y = _data(32)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert set(mp.LOG_KEYS) <= set(history) and len(history["loss"]) == 2
    before = {
        v.path: np.array(v.numpy()) for v in model.variables + model.optimizer.variables if OURS not in v.path
    }
    bad = x[:8].copy()
    bad[0, 0] = np.nan
    assert model.fit(bad, y[:8], verbose=0).history["skipped_steps"] == [1.0]
    after = {
        v.path: np.array(v.numpy()) for v in model.variables + model.optimizer.variables if OURS not in v.path
    }
    assert [p for p in before if not np.array_equal(before[p], after[p])] == []
    assert "recompile_limit" not in caplog.text


def test_adding_in_place_in_one_call_adds_to_each_tensor_in_its_dtype():
    # torch._foreach_add_ (through the fence): the healthy step's counters
    # (int64) and epoch figures (float32) in one call.
    from mp_callbacks._keras_internals import add_in_place

    counter, figure = torch.tensor(2**40, dtype=torch.int64), torch.tensor(0.5)
    add_in_place([counter, figure], [1, 32.0])
    assert counter.dtype == torch.int64 and int(counter) == 2**40 + 1
    assert figure.dtype == torch.float32 and float(figure) == 32.5
