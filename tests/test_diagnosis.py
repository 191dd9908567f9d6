"""diagnose_batch, the kept batch, the true origin in NonFiniteGradientError,
with_float32_layers and HeadroomMonitor, with tiny float16 models."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import mp_callbacks as mp

# Tiny float16 layers keep the emulated float16 cheap on CPU; compile's
# check_model hint about their sizes is expected (tested in test_model_checks).
pytestmark = pytest.mark.filterwarnings("ignore:check_model found:mp_callbacks.errors.MixedPrecisionWarning")


@keras.saving.register_keras_serializable(package="mp_callbacks_tests")
class Boost(keras.layers.Layer):
    """Weightless: multiplies by `factor` (1e5 overflows float16's 65504)."""

    def __init__(self, factor=1e5, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return (
            x * tf.cast(self.factor, tf.float32)
            if x.dtype == tf.float32
            else tf.cast(tf.cast(x, tf.float32) * self.factor, x.dtype)
        )

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


@keras.saving.register_keras_serializable(package="mp_callbacks_tests")
class Rescale(keras.layers.Layer):
    """Weightless: (x * 300 * 300) / 90000, the identity in float32; in
    float16 the intermediate overflows (65504) once |x| > 0.73, as a
    normalization's sum of squares does."""

    def call(self, x):
        return x * 300.0 * 300.0 / 90000.0


@keras.saving.register_keras_serializable(package="mp_callbacks_tests")
class AmplifyGradient(keras.layers.Layer):
    """Weightless identity whose backward pass multiplies the gradient by 1e9."""

    def call(self, x):
        @tf.custom_gradient
        def identity(value):
            def grad(upstream):
                return tf.cast(tf.cast(upstream, tf.float32) * 1e9, upstream.dtype)

            return tf.identity(value), grad

        return identity(x)


def _float16_model(middle, loss_scale="auto"):
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="pre")(inputs)
    hidden = middle()(hidden)  # made under the float16 policy
    outputs = keras.layers.Dense(2, dtype="float32", name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=loss_scale)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), np.zeros((n, 2), "float32")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the overflow under test
def test_forward_overflow_in_a_weightless_layer_is_named():
    model = _float16_model(lambda: Rescale(name="boost"))
    x, y = _data()
    with pytest.raises(mp.NonFiniteGradientError) as caught:
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=1,
            verbose=0,
            callbacks=[mp.NaNGradientMonitor(patience=1, action="raise", check_every=1)],
        )
    error = caught.value
    assert error.origin == "boost"
    assert "'boost'" in str(error) and "forward pass" in str(error)
    assert error.report.first_nonfinite_layer == "boost"
    assert error.report.float32_layers == ["boost"]


@keras.saving.register_keras_serializable(package="mp_callbacks_tests")
class RescaleThenSublayer(keras.layers.Layer):
    """`Rescale`'s overflow made by its own operations, then handed to a
    sublayer, as an attention hands its softmax to its dropout."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.after = keras.layers.Activation("linear", name="after")

    def call(self, x):
        return self.after(x * 300.0 * 300.0 / 90000.0)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the overflow under test
def test_the_origin_is_the_caller_whose_own_operations_overflowed_not_its_sublayer():
    model = _float16_model(lambda: RescaleThenSublayer(name="outer"))
    report = mp.diagnose_batch(model, *_data())
    # The sublayer finishes first, with the caller's non-finite values.
    assert report.first_nonfinite_layer == "after"
    assert report.forward_origin == report.origin == "outer"
    assert report.float32_layers == ["outer"]
    assert "made non-finite by its own operations: outer" in str(report)


def test_backward_only_overflow_in_a_weightless_custom_gradient_layer_is_named():
    model = _float16_model(lambda: AmplifyGradient(name="amplify"), loss_scale=None)
    x, y = _data()
    with pytest.raises(mp.NonFiniteGradientError) as caught:
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=1,
            verbose=0,
            callbacks=[mp.NaNGradientMonitor(patience=1, action="raise", check_every=1)],
        )
    error = caught.value
    assert error.origin == "amplify"
    assert "backward pass" in str(error)
    assert error.report.first_nonfinite_layer is None and error.report.loss_finite
    assert error.report.first_nonfinite_gradient_layer == "amplify"
    assert error.variables == ["pre/kernel", "pre/bias"]  # still listed


def test_report_fields_hold_real_values():
    model = _float16_model(lambda: Boost(50.0, name="boost"))
    x, y = _data(8)
    # At the default 2**15 the backward pass overflows (a true finding:
    # this model needs a lower scale); at 1 it does not.
    assert mp.diagnose_batch(model, x, y).first_nonfinite_gradient_layer is not None
    report = mp.diagnose_batch(model, x, y, loss_scale=1.0)
    assert [r.name for r in report.layers] == ["pre", "boost", "head"]
    pre_max = float(np.max(np.abs(model.get_layer("pre")(x).numpy().astype("float32"))))
    assert report.activation_max["pre"] == pytest.approx(pre_max, rel=1e-3)
    assert report.activation_max["boost"] == pytest.approx(pre_max * 50, rel=2e-3)
    assert report.headroom["boost"] == pytest.approx(pre_max * 50 / 65504.0, rel=2e-3)
    assert report.headroom["head"] < 1e-30  # float32's range is vast
    assert report.first_nonfinite_layer is None and report.first_nonfinite_gradient_layer is None
    assert report.loss_finite and report.loss == pytest.approx(
        float(model.evaluate(x, y, verbose=0)), rel=1e-2
    )
    assert report.loss_scale == 1.0
    assert set(report.underflow) == {"pre", "boost", "head"}
    assert all(0.0 <= v <= 1.0 for v in report.underflow.values())
    table = str(report)
    assert table.splitlines()[0].split()[:2] == ["layer", "dtype"]
    assert "boost" in table and "float16" in table


def test_underflow_counts_gradient_values_lost_at_a_tiny_scale():
    model = _float16_model(lambda: keras.layers.Identity(name="same"))
    x, y = _data(8)
    tiny = mp.diagnose_batch(model, x, y, loss_scale=2.0**-40)
    large = mp.diagnose_batch(model, x, y, loss_scale=2.0**10)
    assert tiny.underflow["same"] == 1.0  # every float16 gradient value vanished
    assert large.underflow["same"] == 0.0


def test_subclassed_models_say_what_cannot_be_seen():
    class Net(mp.MixedPrecisionModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = keras.layers.Dense(4, name="first")
            self.second = keras.layers.Dense(2, name="second")

        def call(self, x):
            return self.second(self.first(x) * 2.0)

    net = Net(loss_scale=None)
    net.compile("sgd", "mse")
    x, y = _data(8)
    net.fit(x, y, verbose=0)
    report = mp.diagnose_batch(net, x, y)
    assert [r.name for r in report.layers] == ["first", "second"]
    assert any("subclassed" in note for note in report.notes)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the overflow under test
def test_with_float32_layers_keeps_weights_and_then_trains_without_skips():
    model = _float16_model(lambda: Rescale(name="boost"), loss_scale=mp.LossScaler(initial_scale=256.0))
    x, y = _data()
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert history.history["skipped_steps"] == [4.0]
    report = mp.diagnose_batch(model, *model.kept_batch()[0])
    assert report.float32_layers == ["boost"]
    fixed = mp.with_float32_layers(model, report.float32_layers)
    assert type(fixed) is type(model)
    assert fixed.get_layer("boost").compute_dtype == "float32"
    assert fixed.get_layer("pre").compute_dtype == "float16"
    for a, b in zip(model.get_weights(), fixed.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert fixed.compiled and type(fixed.optimizer) is type(model.optimizer)
    history = fixed.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert history.history["skipped_steps"] == [0.0, 0.0]
    assert all(math.isfinite(v) for v in history.history["loss"])


def test_with_float32_layers_refuses_unknown_names_and_subclassed_models():
    model = _float16_model(lambda: Boost(name="boost"))
    with pytest.raises(ValueError, match="names"):
        mp.with_float32_layers(model, ["nope"])


def test_kept_batch_is_the_one_that_broke():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="head")(keras.layers.Dense(4, name="pre")(inputs))
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=None)
    model.compile("sgd", "mse")
    x, y = _data(40)
    assert model.kept_batch() is None
    x[26, 3] = np.inf  # batch 3 of 5 (batch size 8), step 3
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    (kept_x, kept_y, kept_weights), step = model.kept_batch()
    assert step == 3 and kept_weights is None
    np.testing.assert_array_equal(kept_x, x[24:32])
    np.testing.assert_array_equal(kept_y, y[24:32])


def test_headroom_monitor_logs_every_layer_and_warns_before_overflow():
    model = _float16_model(lambda: Boost(2e4, name="boost"))
    x, y = _data(16)
    monitor = mp.HeadroomMonitor(probe=x[:4], every_n_steps=1, warn_above=0.05)
    with pytest.warns(mp.MixedPrecisionWarning, match="'boost' computes in float16"):
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    assert len(monitor.history) == 2
    probe_max = float(np.max(np.abs(model.get_layer("pre")(x[:4]).numpy().astype("float32"))))
    assert history.history["headroom/boost"][0] > 0.05
    # float16 layers only: the float32 head has float32's range.
    assert {k for k in history.history if k.startswith("headroom/")} == {"headroom/pre", "headroom/boost"}
    last = monitor.history[-1]["headroom"]
    assert last["boost"] == pytest.approx(probe_max * 2e4 / 65504.0, rel=5e-3)


def test_the_replay_uses_the_kept_sample_weights():
    model = _float16_model(lambda: AmplifyGradient(name="amplify"), loss_scale=None)
    x, y = _data()
    weights = np.linspace(0.1, 2.0, len(x)).astype("float32")
    with pytest.raises(mp.NonFiniteGradientError) as caught:
        model.fit(
            x,
            y + 1.0,
            sample_weight=weights,
            batch_size=8,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[mp.NaNGradientMonitor(patience=1, action="raise", check_every=1)],
        )
    (kept_x, kept_y, kept_weights), _ = model.kept_batch()
    np.testing.assert_array_equal(kept_weights, weights[:8])
    weighted = mp.diagnose_batch(model, kept_x, kept_y, kept_weights).loss
    unweighted = mp.diagnose_batch(model, kept_x, kept_y).loss
    assert caught.value.report.loss == pytest.approx(weighted) and weighted != pytest.approx(unweighted)
    assert "mp_callbacks.with_float32_layers(model, ['amplify'])" in str(caught.value)
