"""check_model: findings on purpose-built models, none on correct ones."""

from __future__ import annotations

import warnings

import keras
import pytest

import mp_callbacks as mp


def _mlp(output_dtype=None, hidden=16, activation="softmax", loss_scale="auto", cls=mp.MixedPrecisionModel):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(hidden, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(10, activation=activation, dtype=output_dtype, name="out")(x)
    if cls is keras.Model:
        return keras.Model(inputs, outputs)
    return cls(inputs, outputs, loss_scale=loss_scale)


def _kinds(findings):
    return sorted((f.kind, f.layer) for f in findings)


def test_the_seeds_correct_model_has_no_findings():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _mlp(output_dtype="float32")
    model.compile("adam", "sparse_categorical_crossentropy")
    assert mp.check_model(model) == []


def test_float32_models_are_not_checked():
    assert mp.check_model(_mlp(hidden=13)) == []


def test_float16_softmax_output_is_named():
    keras.mixed_precision.set_global_policy("mixed_float16")
    findings = mp.check_model(_mlp())
    assert _kinds(findings) == [("low_precision_output_op", "out"), ("output_dtype", "out")]
    assert "dtype='float32'" in findings[0].message


def test_bfloat16_normalization_output_is_named():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="hidden")(inputs)
    outputs = keras.layers.LayerNormalization(name="norm")(x)
    findings = mp.check_model(keras.Model(inputs, outputs))
    assert ("low_precision_output_op", "norm") in _kinds(findings)
    assert any("LayerNormalization" in f.message for f in findings)


def test_sizes_not_multiple_of_eight_are_named_but_not_the_output():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    findings = mp.check_model(_mlp(output_dtype="float32", hidden=12))
    assert _kinds(findings) == [("tensor_core_alignment", "hidden")]
    assert "units=16" in findings[0].message


def test_missing_loss_scale_under_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    ours = _mlp(output_dtype="float32", loss_scale=None)
    with pytest.warns(mp.MixedPrecisionWarning, match=r"\[missing_loss_scale\]"):
        ours.compile("sgd", "mse")  # compile warns once about the finding
    assert _kinds(mp.check_model(ours)) == [("missing_loss_scale", ours.name)]
    stock = _mlp(output_dtype="float32", cls=keras.Model)
    stock.compile("sgd", "mse", auto_scale_loss=False)
    assert _kinds(mp.check_model(stock)) == [("missing_loss_scale", stock.name)]
    stock.compile("sgd", "mse")  # Keras wraps a LossScaleOptimizer: fine
    assert mp.check_model(stock) == []


def test_compile_warns_once_with_the_findings():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _mlp()
    with pytest.warns(mp.MixedPrecisionWarning, match=r"(?s)2 mixed-precision issue\(s\).*\[output_dtype\] out"):
        model.compile("sgd", "sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("error", mp.MixedPrecisionWarning)
        model.compile("adam", "sparse_categorical_crossentropy")


def test_float16_softmax_behind_a_float32_cast_is_still_named():
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((8,))
    logits = keras.layers.Dense(16, name="logits")(inputs)
    probabilities = keras.layers.Activation("softmax", name="softmax16")(logits)
    outputs = keras.layers.Activation("linear", dtype="float32", name="cast")(probabilities)
    findings = mp.check_model(keras.Model(inputs, outputs))
    assert _kinds(findings) == [("low_precision_output_op", "softmax16")]
