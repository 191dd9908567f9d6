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


def test_the_guides_correct_model_has_no_findings():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _mlp(output_dtype="float32")
    model.compile("adam", "sparse_categorical_crossentropy")
    assert mp.check_model(model) == []


def test_float32_models_are_not_checked():
    assert mp.check_model(_mlp(hidden=13)) == []


def test_float16_softmax_output_is_named():
    keras.mixed_precision.set_global_policy("mixed_float16")
    findings = mp.check_model(_mlp())
    # One finding for the layer: the fix for its dtype is the fix for its softmax.
    assert _kinds(findings) == [("output_dtype", "out")]
    assert findings[0].message == (
        "model output is float16 under a mixed policy; its softmax is computed in float16, where "
        "it saturates. Give this layer dtype='float32', or let it output the logits and add "
        "keras.layers.Activation('softmax', dtype='float32') after it.")


def test_bfloat16_normalization_output_is_named():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="hidden")(inputs)
    outputs = keras.layers.LayerNormalization(name="norm")(x)
    findings = mp.check_model(keras.Model(inputs, outputs))
    assert _kinds(findings) == [("output_dtype", "norm")]
    assert findings[0].message == (
        "model output is bfloat16 under a mixed policy; its LayerNormalization is computed in "
        "bfloat16. Give this layer dtype='float32'.")


def test_sizes_not_multiple_of_eight_are_named_but_not_the_output():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    findings = mp.check_model(_mlp(output_dtype="float32", hidden=12))
    assert _kinds(findings) == [("tensor_core_alignment", "hidden")]
    assert "hidden units=12 -> 16" in findings[0].message and findings[0].layers == ("hidden",)


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
    with pytest.warns(mp.MixedPrecisionWarning, match=r"(?s)1 mixed-precision issue\(s\).*\[output_dtype\] out"):
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


# ------------------------------------------------- the remedies it offers
def _dense_head(head):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, head(x))


@pytest.mark.parametrize("remedy", [
    # "Give this layer dtype='float32'"
    lambda x: keras.layers.Dense(10, activation="softmax", dtype="float32", name="out")(x),
    # "let it output the logits and add Activation('softmax', dtype='float32')"
    lambda x: keras.layers.Activation("softmax", dtype="float32", name="probs")(
        keras.layers.Dense(10, name="out")(x)),
])
def test_each_remedy_for_a_float16_softmax_clears_the_finding(remedy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    before = mp.check_model(_dense_head(
        lambda x: keras.layers.Dense(10, activation="softmax", name="out")(x)))
    assert _kinds(before) == [("output_dtype", "out")]
    assert mp.check_model(_dense_head(remedy)) == []


def test_the_linear_cast_remedy_clears_a_float16_logits_output():
    keras.mixed_precision.set_global_policy("mixed_float16")
    before = mp.check_model(_dense_head(lambda x: keras.layers.Dense(10, name="out")(x)))
    assert _kinds(before) == [("output_dtype", "out")]
    assert "add keras.layers.Activation('linear', dtype='float32') after it" in before[0].message
    after = _dense_head(lambda x: keras.layers.Activation("linear", dtype="float32")(
        keras.layers.Dense(10, name="out")(x)))
    assert mp.check_model(after) == []


def test_alignment_is_kept_for_layers_that_carry_compute_and_grouped():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((16, 16, 8))
    x = keras.layers.Conv2D(30, 3, padding="same", name="wide")(inputs)
    x = keras.layers.Conv2D(20, 3, padding="same", name="wide2")(x)
    pooled = keras.layers.GlobalAveragePooling2D(keepdims=True)(x)
    # A squeeze-excite pair: 1x1 convolutions on one position, a sliver of the compute.
    squeezed = keras.layers.Conv2D(5, 1, name="se_reduce")(pooled)
    excited = keras.layers.Conv2D(20, 1, activation="sigmoid", name="se_expand")(squeezed)
    x = keras.layers.Multiply()([x, excited])
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(x)
    findings = mp.check_model(keras.Model(inputs, outputs))
    assert len(findings) == 1
    finding = findings[0]
    assert finding.kind == "tensor_core_alignment" and finding.layers == ("wide", "wide2")
    assert finding.layer == "wide, wide2"
    assert "wide filters=30 -> 32, wide2 filters=20 -> 24" in finding.message
    assert "(2 more such layers, each under 1% of the compute, not listed.)" in finding.message


# ---------------------------------------------- real models: applications
def _application(name, float32_head):
    build = getattr(keras.applications, name)
    kwargs = dict(weights=None, input_shape=(32, 32, 3))
    if name == "MobileNetV3Small":
        kwargs["include_preprocessing"] = False
    if not float32_head:
        return build(classes=10, **kwargs)
    base = build(include_top=False, pooling="avg", **kwargs)
    logits = keras.layers.Dense(10, name="logits")(base.output)
    probabilities = keras.layers.Activation("softmax", dtype="float32", name="probs")(logits)
    return keras.Model(base.input, probabilities)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ResNet50", "MobileNetV3Small", "EfficientNetB0"])
def test_applications_get_one_finding_for_a_float16_head_and_none_for_a_float32_one(name):
    keras.mixed_precision.set_global_policy("mixed_float16")
    float16_head = mp.check_model(_application(name, float32_head=False))
    # The class-count layer is not an alignment finding; EfficientNet's small
    # squeeze-excite convolutions (about 1 % of its compute together) are not
    # either. What is left is the one real mistake: a float16 softmax output.
    assert [(f.kind, f.layer) for f in float16_head] == [("output_dtype", "predictions")]
    assert mp.check_model(_application(name, float32_head=True)) == []
