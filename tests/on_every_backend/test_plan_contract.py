"""PrecisionPlan and SpeedComparison on every backend."""

from __future__ import annotations

import keras
import numpy as np

import mp_callbacks as mp


def _model(cls=keras.Model):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    return cls(inputs, keras.layers.Dense(1, name="head")(hidden))


def test_a_plan_applies_its_policy_pins_and_initial_scale_to_a_copy():
    model = _model(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    plan = mp.PrecisionPlan("mixed_float16", float32_layers=["norm"], initial_scale=256.0)
    tuned = plan.apply(model)
    dtypes = {layer.name: layer.compute_dtype for layer in tuned.layers[1:]}
    assert dtypes == {"hidden": "float16", "norm": "float32", "head": "float16"}
    assert isinstance(tuned, mp.MixedPrecisionModel) and tuned.get_scale() == 256.0
    assert tuned.loss_scale_state()["scale"] == 256.0
    for original, copied in zip(model.weights, tuned.weights):
        np.testing.assert_array_equal(original.numpy(), copied.numpy())
    x, y = np.ones((16, 4), "float32"), np.zeros((16, 1), "float32")
    history = tuned.fit(x, y, batch_size=8, verbose=0).history
    assert history["skipped_steps"] == [0.0] and history["loss_scale"][0] == 256.0
    assert mp.PrecisionPlan.from_json(plan.to_json()) == plan
    assert "loss_scale=mp.LossScaler(initial_scale=256)" in plan.code
    exec(plan.code, {"keras": keras, "mp": mp, "model": _model()})
    keras.mixed_precision.set_global_policy("float32")


def test_speed_comparison_judges_paired_ratios():
    faster = mp.SpeedComparison([1.31, 1.28, 1.35, 1.30, 1.29])
    assert faster.verdict == "faster" and faster.median == 1.30 and faster.decided
    assert mp.SpeedComparison([0.94, 1.47]).verdict == "tie"
    assert mp.SpeedComparison([0.8, 0.85, 0.9]).verdict == "slower"


def test_a_plan_for_float16_scales_a_model_compiled_under_float32():
    import warnings

    model = _model(mp.MixedPrecisionModel)
    model.compile("adam", "mse")
    assert model.get_scale() == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", mp.MixedPrecisionWarning)  # check_model: no missing scale
        tuned = mp.PrecisionPlan("mixed_float16").apply(model)
    assert tuned.get_scale() == 2.0**15  # the dynamic default
    fixed = mp.MixedPrecisionModel(model.inputs, model.outputs, loss_scale=8.0)
    fixed.compile("adam", "mse")
    assert mp.PrecisionPlan("mixed_float16").apply(fixed).get_scale() == 8.0
    keras.mixed_precision.set_global_policy("float32")
