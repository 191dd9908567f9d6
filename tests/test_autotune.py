"""mp.autotune and PrecisionPlan on purpose-built models: a layer that
overflows float16, a healthy model, a variance that bfloat16 cancels away;
the decision on injected measurements; plans through JSON and .keras."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import mp_callbacks as mp
from mp_callbacks.autotune import choose_plan

FEATURES, CLASSES = 16, 4


@keras.saving.register_keras_serializable(package="test_autotune")
class NaiveSoftmax(keras.layers.Layer):
    """exp(x) / sum(exp(x)): exp leaves float16's range once x passes 11."""

    def call(self, inputs):
        exponentials = keras.ops.exp(inputs)
        return exponentials / keras.ops.sum(exponentials, axis=-1, keepdims=True)


@keras.saving.register_keras_serializable(package="test_autotune")
class Variance(keras.layers.Layer):
    """E[x^2] - E[x]^2, written by hand: cancels catastrophically for a large mean."""

    def call(self, x):
        mean = keras.ops.mean(x, axis=-1, keepdims=True)
        return keras.ops.mean(x * x, axis=-1, keepdims=True) - mean * mean


def overflowing_model():
    inputs = keras.Input((FEATURES,))
    scores = keras.layers.Dense(16, name="scores")(inputs)
    weights = NaiveSoftmax(name="naive_softmax")(scores)
    hidden = keras.layers.Dense(16, activation="relu", name="dense")(weights)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32", name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def healthy_model():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu", name="dense")(inputs)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32", name="head")(hidden)
    return keras.Model(inputs, outputs)  # uncompiled: autotune's defaults


def variance_model():
    inputs = keras.Input((FEATURES,))
    spread = Variance(name="variance")(inputs)
    hidden = keras.layers.Dense(8, activation="relu", name="dense")(inputs)
    features = keras.layers.Concatenate(name="features")([hidden, spread])
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(features)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def _data(samples=256, scale=5.0, offset=0.0):
    rng = np.random.default_rng(0)
    x = (offset + rng.normal(0.0, scale, size=(samples, FEATURES))).astype("float32")
    return x, np.argmax(x[:, :CLASSES], axis=1).astype("int64")


@pytest.mark.slow
def test_the_layer_that_overflows_and_no_other_is_pinned_and_the_plan_trains():
    x, y = _data()
    plan = mp.autotune(
        overflowing_model, x, y, policies=["mixed_float16"], steps=10, batch_size=32, in_subprocess=False
    )
    assert plan.policy == "mixed_float16" and plan.float32_layers == ["naive_softmax"]
    candidate = next(c for c in plan.candidates if c["policy"] == "mixed_float16")
    assert "overflows" in candidate["reasons"]["naive_softmax"]
    # Warm-up, then one step a round (steps=10), five rounds or more.
    assert candidate["divergent_steps"] == 0 and candidate["steps"] == 2 + len(candidate["ratios"]) >= 7
    assert plan.initial_scale is not None and plan.initial_scale >= 1
    assert plan.layer_dtypes == {"naive_softmax": "float32", "head": "float32"}
    keras.config.set_dtype_policy("float32")
    tuned = plan.apply(mp.MixedPrecisionModel.from_model(overflowing_model()))
    assert tuned.get_layer("scores").compute_dtype == "float16"
    assert tuned.get_layer("naive_softmax").compute_dtype == "float32"
    history = tuned.fit(
        x, y, batch_size=32, epochs=1, verbose=0, callbacks=[mp.NaNGradientMonitor(action="raise")]
    ).history
    assert history["skipped_steps"] == [0.0] and tuned.scaler.initial_scale == plan.initial_scale


def named_inputs_model():
    """Named inputs, as KerasHub's text models take them (a dict)."""
    features = keras.Input((FEATURES,), name="features")
    mask = keras.Input((FEATURES,), name="mask")
    hidden = keras.layers.Dense(16, activation="relu", name="dense")(
        keras.layers.Multiply()([features, mask])
    )
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32", name="head")(hidden)
    return keras.Model({"features": features, "mask": mask}, outputs)


@pytest.mark.parametrize("inputs", ["array", "named"])
def test_a_healthy_model_gets_no_pinned_layer(inputs):
    x, y = _data()
    build = healthy_model
    if inputs == "named":
        x, build = {"features": x, "mask": np.ones_like(x)}, named_inputs_model
    plan = mp.autotune(build, x, y, policies=["mixed_bfloat16"], steps=10, batch_size=32, in_subprocess=False)
    assert plan.policy == "mixed_bfloat16" and plan.float32_layers == []
    assert plan.initial_scale is None  # bfloat16 needs no loss scale
    assert [c["policy"] for c in plan.candidates] == ["float32", "mixed_bfloat16"]
    assert plan.candidates[0]["verdict"] == "reference"  # timed beside, not a candidate


def _float8_plan():
    x, y = _data()
    return mp.autotune(
        healthy_model,
        x,
        y,
        policies=["mixed_bfloat16", "float8"],
        steps=10,
        batch_size=32,
        in_subprocess=False,
    )


def test_float8_measured_slower_here_stays_out_of_the_plan_with_its_figures():
    # No CPU has float8 units: Keras fake-quantizes there, which only adds work.
    plan = _float8_plan()
    assert plan.policy == "mixed_bfloat16" and plan.float8_layers == []
    measured = plan.candidates[1]["float8"]
    assert list(measured) == ["dense"]  # the float32 head is not a candidate
    assert measured["dense"]["speed"] != "faster" and measured["dense"]["error"] < 0.05
    (said,) = [r for r in plan.reasons if r.startswith("float8")]
    assert "no layer quantized" in said and "dense (not faster in float8 here: " in said
    assert f"{measured['dense']['speedup']:.2f}x" in said


def test_a_layer_measured_faster_in_float8_is_quantized_in_the_proof_and_the_plan(monkeypatch):
    from mp_callbacks import _float8_candidates
    from mp_callbacks._float8 import float8_layers

    def float8_twice_as_fast(model, inputs, targets, steps):  # injected timing: a GPU with float8 units
        return 0.5 if float8_layers(model) else 1.0

    monkeypatch.setattr(_float8_candidates, "time_steps", float8_twice_as_fast)
    plan = _float8_plan()
    assert plan.float8_layers == ["dense"] and plan.candidates[1]["float8"]["dense"]["speedup"] == 2.0
    assert 'model.get_layer("dense").quantize("float8")' in plan.code
    tuned = plan.apply(healthy_model())
    assert tuned.get_layer("dense").quantization_mode == "float8"
    assert tuned.get_layer("head").quantization_mode is None
    assert mp.PrecisionPlan.from_json(plan.to_json()).float8_layers == ["dense"]
    with pytest.raises(ValueError, match="float8_layers"):
        mp.PrecisionPlan("mixed_bfloat16", float8_layers=["nosuch"]).apply(healthy_model())


def test_bfloat16s_catastrophic_cancellation_is_found():
    x, _ = _data(offset=1000.0, scale=1.0)
    y = x.var(axis=1, keepdims=True).astype("float32")
    keras.config.set_dtype_policy("mixed_bfloat16")
    from mp_callbacks.layer_selection import select_float32_layers

    model = variance_model()
    selection = select_float32_layers(model, [(x[:32], y[:32])])
    assert selection.layers == ["variance"]
    assert "relative error" in selection.reasons["variance"]


def _evidence(ratios, accuracy, divergent=0):
    float32 = {
        "policy": "float32",
        "listed": True,
        "metrics": {"accuracy": 0.90},
        "divergent_steps": 0,
        "weights_finite": True,
    }
    mixed = {
        "policy": "mixed_bfloat16",
        "listed": True,
        "ratios": ratios,
        "skipped_steps": 0,
        "metrics": {"accuracy": accuracy},
        "divergent_steps": divergent,
        "weights_finite": True,
    }
    return [float32, mixed]


@pytest.mark.parametrize(
    "ratios, accuracy, divergent, chosen, said",
    [
        ([0.62, 0.60, 0.65, 0.61, 0.63], 0.90, 0, "float32", "slower"),  # bfloat16 emulated
        ([0.94, 1.47], 0.90, 0, "float32", "a tie"),  # the noisy bench runs: a tie
        ([1.05, 1.03, 1.06, 1.04, 1.05], 0.90, 0, "float32", "a tie"),  # faster, not clearly
        ([1.40, 1.38, 1.42, 1.39, 1.41], 0.85, 0, "float32", "beyond the tolerance"),
        ([1.40, 1.38, 1.42, 1.39, 1.41], 0.90, 3, "float32", "diverged"),
        ([1.40, 1.38, 1.42, 1.39, 1.41], 0.895, 0, "mixed_bfloat16", "1.40x"),
    ],
)
def test_the_decision_from_injected_measurements(ratios, accuracy, divergent, chosen, said):
    evidence = _evidence(ratios, accuracy, divergent)
    policy, reasons = choose_plan(evidence, tolerance=0.01, forced=False)
    assert policy == chosen
    assert said in " ".join(reasons)
    assert evidence[1]["verdict"] == ("chosen" if chosen != "float32" else evidence[1]["verdict"])


def test_listed_candidates_are_chosen_from_whatever_their_speed():
    evidence = _evidence([0.2, 0.21, 0.19, 0.2, 0.2], 0.90)
    evidence[0]["listed"] = False  # only mixed_bfloat16 was asked for
    policy, _ = choose_plan(evidence, tolerance=0.01, forced=True)
    assert policy == "mixed_bfloat16" and evidence[0]["verdict"] == "reference"
    assert evidence[1]["speed"] == "slower" and evidence[1]["speedup"] == pytest.approx(0.2)


@pytest.mark.slow
def test_the_candidates_follow_the_hardware_measurement():
    # A CPU with no bfloat16 and emulated float16, and one with fast bfloat16.
    slow = mp.inspect_hardware(speed={"float32": 1.0, "mixed_bfloat16": 0.2, "mixed_float16": 0.01})
    fast = mp.inspect_hardware(speed={"float32": 1.0, "mixed_bfloat16": 2.5, "mixed_float16": 0.01})
    x, y = _data(128)
    for hardware, expected in ((slow, ["float32"]), (fast, ["float32", "mixed_bfloat16"])):
        plan = mp.autotune(
            healthy_model, x, y, steps=5, batch_size=32, hardware=hardware, in_subprocess=False
        )
        assert [c["policy"] for c in plan.candidates] == expected
        assert any("not a candidate: mixed_float16" in reason for reason in plan.reasons)
    assert plan.policy in ("float32", "mixed_bfloat16")  # decided by this machine's timings


def test_a_plan_round_trips_through_json_and_its_model_through_keras_files(tmp_path):
    plan = mp.PrecisionPlan(
        "mixed_float16",
        float32_layers=["naive_softmax"],
        initial_scale=1024.0,
        layer_dtypes={"naive_softmax": "float32", "head": "float32"},
        reasons=["measured"],
        candidates=[{"policy": "float32", "ratios": [1.0]}],
    )
    again = mp.PrecisionPlan.from_json(plan.to_json())
    assert again == plan and json.loads(plan.to_json())["policy"] == "mixed_float16"
    policy_map = plan.dtype_policy_map()
    assert policy_map["naive_softmax"].name == "float32" and policy_map["dense"].name == "mixed_float16"
    keras.config.set_dtype_policy("float32")
    model = plan.apply(mp.MixedPrecisionModel.from_model(overflowing_model()))
    path = str(tmp_path / "tuned.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert {layer.name: layer.compute_dtype for layer in loaded.layers[1:]} == {
        "scores": "float16",
        "naive_softmax": "float32",
        "dense": "float16",
        "head": "float32",
    }
    assert loaded.scaler.initial_scale == 1024.0
    for ours, theirs in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(ours, theirs)
    assert "mp.with_float32_layers(model, ['naive_softmax'])" in plan.code
    assert "naive_softmax" in str(plan) and "to use it:" in str(plan)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"policies": ["float64"]}, "policies"),
        ({"policies": []}, "policies"),
        ({"policies": ["float32", "float8"]}, "policies"),
        ({"tolerance": 0.0}, "tolerance"),
        ({"steps": 2}, "steps"),
        ({"batch_size": 0}, "batch_size"),
        ({"build": "nosuch:build"}, "build"),
        ({"y": None}, "y"),
        ({"x": {"features": np.ones((64, FEATURES)), "mask": np.ones((63, FEATURES))}}, "x"),
        ({"x": {"features": "text"}}, "x"),
    ],
)
def test_bad_arguments_are_named_before_any_training(kwargs, name):
    x, y = _data(64)
    arguments = {"build": healthy_model, "x": x, "y": y, "in_subprocess": False}
    arguments.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=name):
        mp.autotune(**arguments)


def test_a_model_that_does_not_take_the_data_fails_in_one_line():
    x, y = _data(64)
    with pytest.raises(ValueError, match="does not train on the data"):
        mp.autotune(healthy_model, x[:, :3], y, in_subprocess=False)


def test_ctrl_c_reports_what_was_measured_so_far(monkeypatch):
    from mp_callbacks import _candidate

    calls = {"n": 0}
    original = _candidate.LocalCandidate.request

    def interrupted_on_the_fourth_round(self, command):
        if command["cmd"] == "train" and command["steps"] == 3:  # not the warm-up
            calls["n"] += 1
            if calls["n"] > 6:
                raise KeyboardInterrupt
        return original(self, command)

    monkeypatch.setattr(_candidate.LocalCandidate, "request", interrupted_on_the_fourth_round)
    x, y = _data()
    plan = mp.autotune(
        healthy_model, x, y, policies=["mixed_bfloat16"], steps=30, batch_size=32, in_subprocess=False
    )
    assert plan.interrupted and plan.policy == "float32"
    assert len(plan.candidates[1]["ratios"]) == 3  # three full rounds were measured
    assert "interrupted" in plan.reasons[0] and "interrupted" in str(plan)


def test_float32_copy_serves_without_mixed_precision(tmp_path):
    import tensorflow as tf

    keras.config.set_dtype_policy("mixed_bfloat16")
    model = mp.MixedPrecisionModel.from_model(overflowing_model())
    served = mp.float32_copy(model)
    assert type(served) is not mp.MixedPrecisionModel
    assert {layer.compute_dtype for layer in served.layers[1:]} == {"float32"}
    x, _ = _data(8)
    served.export(str(tmp_path / "served"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "served"))
    np.testing.assert_allclose(loaded.serve(x).numpy(), served.predict(x, verbose=0), rtol=1e-6)
