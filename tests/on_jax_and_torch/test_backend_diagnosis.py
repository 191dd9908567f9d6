"""diagnose_batch on Keras's JAX and torch backends: the same report as on
TensorFlow, its backward figures from the gradients at zero probes
(`jax.grad`, `torch.autograd.grad`), and no variable changed."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mp_callbacks as mp

pytestmark = [
    pytest.mark.skipif(
        keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
    ),
    # Tiny float16 layers; compile's check_model hint about their sizes is expected.
    pytest.mark.filterwarnings("ignore:check_model found:mp_callbacks.errors.MixedPrecisionWarning"),
]


class Rescale(keras.layers.Layer):
    """Weightless: (x * 300 * 300) / 90000, the identity in float32; in
    float16 the intermediate overflows once |x| > 0.73."""

    def call(self, x):
        return x * 300.0 * 300.0 / 90000.0


def _amplified_identity_op():
    """The identity whose backward pass multiplies the gradient by 1e9, in
    the backend's own way of defining a gradient."""
    if keras.backend.backend() == "jax":
        import jax

        @jax.custom_vjp
        def identity(x):
            return x

        identity.defvjp(
            lambda x: (x, None),
            lambda _, upstream: ((upstream.astype("float32") * 1e9).astype(upstream.dtype),),
        )
        return identity
    import torch

    class AmplifiedIdentity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, upstream):
            return (upstream.float() * 1e9).to(upstream.dtype)

    return AmplifiedIdentity.apply


_amplified_identity = _amplified_identity_op()


class AmplifyGradient(keras.layers.Layer):
    """Weightless identity whose backward pass multiplies the gradient by 1e9."""

    def call(self, x):
        return _amplified_identity(x)


def _float16_model(middle, loss_scale="auto", batch_norm=False):
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="pre")(inputs)
    if batch_norm:
        hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    hidden = middle()(hidden)
    outputs = keras.layers.Dense(2, dtype="float32", name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=loss_scale)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32") * 3, np.zeros((n, 2), "float32")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_forward_overflow_is_named_and_no_variable_changes():
    model = _float16_model(lambda: Rescale(name="rescale"), batch_norm=True)
    x, y = _data()
    before = [np.array(v.numpy()) for v in model.variables]
    report = mp.diagnose_batch(model, x, y)
    assert report.first_nonfinite_layer == "rescale" and report.origin == "rescale"
    assert report.float32_layers == ["rescale"]
    assert not report.loss_finite
    assert [r.name for r in report.layers] == ["pre", "norm", "rescale", "head"]
    assert [r.output_finite for r in report.layers] == [True, True, False, False]
    for value, variable in zip(before, model.variables):  # BatchNormalization's statistics included
        np.testing.assert_array_equal(value, variable.numpy(), err_msg=variable.path)


def test_an_overflow_only_on_the_way_back_is_named():
    model = _float16_model(lambda: AmplifyGradient(name="amplify"), loss_scale=None)
    x, y = _data()
    report = mp.diagnose_batch(model, x, y)
    assert report.loss_finite and report.first_nonfinite_layer is None
    assert report.first_nonfinite_gradient_layer == "amplify" and report.origin == "amplify"
    by_name = {r.name: r for r in report.layers}
    assert by_name["head"].gradient_finite and not by_name["amplify"].gradient_finite
    assert report.float32_layers == ["amplify"]


def test_the_default_scale_is_the_models_and_underflow_follows_it():
    model = _float16_model(lambda: keras.layers.Identity(name="same"))
    x, y = _data()
    assert mp.diagnose_batch(model, x, y).loss_scale == model.get_scale()
    assert mp.diagnose_batch(model, x, y, loss_scale=2.0**-40).underflow["same"] == 1.0
    assert mp.diagnose_batch(model, x, y, loss_scale=2.0**10).underflow["same"] == 0.0


def test_the_figures_are_the_layers_own_values_and_gradients():
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2, name="only")(inputs)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 3)).astype("float32")
    y = rng.normal(size=(5, 2)).astype("float32")
    report = mp.diagnose_batch(model, x, y, loss_scale=8.0)
    kernel, bias = (v.numpy() for v in model.get_layer("only").weights)

    # The gradients of mean((x @ kernel + bias - y) ** 2) at x, the
    # weights and the output, by hand.
    upstream = 2.0 * (x @ kernel + bias - y) / y.size
    grads = [upstream @ kernel.T, x.T @ upstream, upstream.sum(axis=0), upstream]
    expected = max(float(np.max(np.abs(g))) for g in grads)
    assert report.gradient_max["only"] == pytest.approx(expected, rel=1e-5)
    assert report.activation_max["only"] == pytest.approx(float(np.max(np.abs(x @ kernel + bias))), rel=1e-5)
    assert report.loss == pytest.approx(float(model.evaluate(x, y, verbose=0)), rel=1e-5)
    assert report.loss_scale == 8.0


def test_a_shared_layer_and_a_subclassed_model_are_seen_layer_by_layer():
    keras.config.set_dtype_policy("float32")

    class Twice(mp.MixedPrecisionModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.shared = keras.layers.Dense(4, name="shared")
            self.head = keras.layers.Dense(2, name="head")

        def call(self, x):
            return self.head(self.shared(keras.ops.tanh(self.shared(x))))

    model = Twice()
    model.compile("sgd", "mse")
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 2), "float32")
    model(x)
    x[1, 2] = np.nan
    report = mp.diagnose_batch(model, x, y)
    assert [r.name for r in report.layers] == ["shared (call 1)", "shared (call 2)", "head"]
    assert report.first_nonfinite_layer == "shared (call 1)" and report.origin == "shared (call 1)"
    assert report.layer_of(report.origin) == "shared"
    assert any("subclassed" in note for note in report.notes)


def _headroom_model(seed=3):
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    hidden = keras.layers.Dropout(0.3, name="drop")(hidden)
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def test_headroom_monitor_probes_the_trained_weights_and_changes_nothing():
    x, y = _data(64)
    probe = x[:4] * 3000.0
    plain = _headroom_model()
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    model = _headroom_model()
    monitor = mp.HeadroomMonitor(probe=probe, every_n_steps=4, warn_above=1.0)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[monitor]).history
    assert not monitor.async_safe  # it runs the model: never beside the next step
    assert [record["step"] for record in monitor.history] == [4, 8, 12, 16]
    # Training is bit for bit what it is without the monitor (seeds, statistics).
    for expected, variable in zip(plain.variables, model.variables):
        np.testing.assert_array_equal(expected.numpy(), variable.numpy(), err_msg=variable.path)
    # The last probe saw the weights the last step wrote, not the epoch's first.
    ranges = mp.diagnosis.layer_output_ranges(model, probe)
    last = monitor.history[-1]["headroom"]
    assert set(last) == {"hidden", "norm", "drop"}
    assert last["hidden"] == pytest.approx(ranges["hidden"].largest / 65504.0, rel=1e-6)
    assert monitor.history[0]["headroom"]["hidden"] != last["hidden"]
    assert history["headroom/hidden"][-1] == max(r["headroom"]["hidden"] for r in monitor.history[2:])
