"""check_model: findings on purpose-built models, none on correct ones."""

from __future__ import annotations

import warnings

import keras
import numpy as np
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
        "keras.layers.Activation('softmax', dtype='float32') after it."
    )


def test_bfloat16_normalization_output_is_named():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="hidden")(inputs)
    outputs = keras.layers.LayerNormalization(name="norm")(x)
    findings = mp.check_model(keras.Model(inputs, outputs))
    assert _kinds(findings) == [("output_dtype", "norm")]
    assert findings[0].message == (
        "model output is bfloat16 under a mixed policy; its LayerNormalization is computed in "
        "bfloat16. Give this layer dtype='float32'."
    )


def test_sizes_not_multiple_of_eight_are_named_but_not_the_output():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((2048,))
    x = keras.layers.Dense(1020, activation="relu", name="hidden")(inputs)  # 2.1M multiply-adds
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32", name="out")(x)
    findings = mp.check_model(keras.Model(inputs, outputs))
    assert _kinds(findings) == [("tensor_core_alignment", "hidden")]
    assert "hidden units=1020 -> 1024" in findings[0].message and findings[0].layers == ("hidden",)
    assert "at least 2**20 a sample" in findings[0].message


def test_alignment_is_not_advised_for_layers_too_small_for_it_to_matter():
    # A keras-tuner trial's 4-unit hidden layer: most of a tiny model's
    # multiply-adds, but 3,136 a sample, far below what tiles could speed up.
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((784,))
    x = keras.layers.Dense(4, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(x)
    assert mp.check_model(keras.Model(inputs, outputs)) == []


def test_the_output_size_exemption_follows_shape_preserving_layers():
    # A GAN generator's one-channel image: Conv2D(1) -> BatchNormalization
    # -> tanh -> Cropping2D. Its one filter is the output's, not a choice.
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((64, 64, 64))
    x = keras.layers.Conv2D(1, 5, padding="same", name="to_image")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("tanh")(x)
    x = keras.layers.Cropping2D(2)(x)
    outputs = keras.layers.Activation("linear", dtype="float32")(x)
    model = mp.MixedPrecisionModel(inputs, outputs)
    assert "tensor_core_alignment" not in [f.kind for f in mp.check_model(model)]


def _transformer_classifier(ids_dtype=None, policy="mixed_bfloat16"):
    # keras-io's text classification with a Transformer: token ids from an
    # untyped keras.Input reach the Embedding inside a custom layer.
    keras.mixed_precision.set_global_policy(policy)

    class TokenAndPositionEmbedding(keras.layers.Layer):
        def __init__(self, maxlen, vocab_size, embed_dim):
            super().__init__()
            self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
            self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

        def call(self, x):
            positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
            return self.token_emb(x) + self.pos_emb(positions)

    inputs = keras.Input((4,), dtype=ids_dtype)
    x = TokenAndPositionEmbedding(4, 20000, 8)(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(2, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("policy, exact", [("mixed_bfloat16", 256), ("mixed_float16", 2048)])
def test_float_ids_cast_to_low_precision_before_an_embedding_are_named(policy, exact):
    model = _transformer_classifier(policy=policy)
    findings = [f for f in mp.check_model(model) if f.kind == "float_index_input"]
    assert len(findings) == 1
    message = findings[0].message
    assert f"ids above {exact} are rounded" in message and "dtype='int32'" in message
    # The harm is real: rounded ids look up other rows.
    ids = np.array([[4001.0, 1001.0, 257.0, 3.0]], "float32")
    embedding = model.layers[1].token_emb
    rows = embedding(ids.astype("int32")).numpy()
    looked_up = embedding(keras.ops.cast(ids, policy.split("_")[1])).numpy()
    wrong = [not np.array_equal(looked_up[0, i], rows[0, i]) for i in range(4)]
    bfloat16 = policy == "mixed_bfloat16"
    assert wrong == [True, bfloat16, bfloat16, False]
    assert mp.check_model(_transformer_classifier(ids_dtype="int32", policy=policy)) == []


def test_a_subclassed_models_sub_models_are_checked_and_the_rest_said():
    from keras_io_models import vae

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = vae()
    model.decoder.layers[-1].dtype_policy = keras.dtype_policies.get("mixed_bfloat16")  # a bfloat16 sigmoid
    findings = mp.check_model(model)
    kinds = _kinds(findings)
    assert ("not_checked", model.name) in kinds
    feeding = [f for f in findings if f.kind in ("output_dtype", "low_precision_output_op")]
    assert feeding and "in sub-model 'decoder'" in feeding[0].message
    note = next(f for f in findings if f.kind == "not_checked").message
    assert "call()" in note and "'encoder'" in note and "'decoder'" in note


def test_the_compile_warning_is_not_given_again_when_the_model_is_loaded(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _mlp()
    with pytest.warns(mp.MixedPrecisionWarning, match=r"\[output_dtype\] out"):
        model.compile("sgd", "sparse_categorical_crossentropy")
    path = str(tmp_path / "m.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mp.MixedPrecisionWarning)
        for _ in range(2):  # every ModelCheckpoint reload
            keras.models.load_model(path)


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
    with pytest.warns(
        mp.MixedPrecisionWarning, match=r"(?s)1 mixed-precision issue\(s\).*\[output_dtype\] out"
    ):
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


@pytest.mark.parametrize(
    "remedy",
    [
        # "Give this layer dtype='float32'"
        lambda x: keras.layers.Dense(10, activation="softmax", dtype="float32", name="out")(x),
        # "let it output the logits and add Activation('softmax', dtype='float32')"
        lambda x: keras.layers.Activation("softmax", dtype="float32", name="probs")(
            keras.layers.Dense(10, name="out")(x)
        ),
    ],
)
def test_each_remedy_for_a_float16_softmax_clears_the_finding(remedy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    before = mp.check_model(
        _dense_head(lambda x: keras.layers.Dense(10, activation="softmax", name="out")(x))
    )
    assert _kinds(before) == [("output_dtype", "out")]
    assert mp.check_model(_dense_head(remedy)) == []


def test_float16_logits_are_no_finding_since_keras_losses_compute_in_float32():
    # BERT-style classifiers of KerasHub output float16 logits: no false alarm.
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _dense_head(lambda x: keras.layers.Dense(10, name="out")(x))
    assert mp.check_model(model) == []
    logits = keras.ops.convert_to_tensor(np.random.default_rng(0).normal(0, 4, size=(8, 10)), "float16")
    labels = np.arange(8) % 10
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # The reason, checked: the loss of float16 logits is the loss of the same logits cast to float32.
    assert float(loss(labels, logits)) == float(loss(labels, keras.ops.cast(logits, "float32")))


def test_alignment_is_kept_for_layers_that_carry_compute_and_grouped():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    inputs = keras.Input((32, 32, 8))
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
    assert "se_" not in finding.message  # far too small to matter


# ---------------------------------------------- real models: applications
def _application(name, float32_head):
    build = getattr(keras.applications, name)
    kwargs = {"weights": None, "input_shape": (32, 32, 3)}
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


def _regularized(policy, remedy=False):
    keras.mixed_precision.set_global_policy(policy)
    inputs = keras.Input((8,))
    if remedy:
        hidden = keras.layers.Dense(16, name="hidden")(inputs)
        hidden = keras.layers.ActivityRegularization(l2=0.01, dtype="float32", name="penalty")(hidden)
    else:
        hidden = keras.layers.Dense(16, activity_regularizer=keras.regularizers.L2(0.01), name="hidden")(
            inputs
        )
    outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
    return keras.Model(inputs, outputs)


def test_a_float16_activity_regularizer_is_named_and_its_remedy_computes_what_float16_cannot():
    large = np.full((64, 8), 40.0, "float32")  # a sum of squares far past 65504
    model = _regularized("mixed_float16")
    assert [f.layer for f in mp.check_model(model) if f.kind == "float16_activity_regularizer"] == ["hidden"]
    model(large, training=True)
    assert not np.isfinite(float(keras.ops.convert_to_numpy(model.losses[0])))
    remedied = _regularized("mixed_float16", remedy=True)
    remedied.set_weights(model.get_weights())
    assert not [f for f in mp.check_model(remedied) if f.kind == "float16_activity_regularizer"]
    remedied(large, training=True)
    assert np.isfinite(float(keras.ops.convert_to_numpy(remedied.losses[0])))
    bfloat16 = _regularized("mixed_bfloat16")  # bfloat16 has float32's range
    assert not [f for f in mp.check_model(bfloat16) if f.kind == "float16_activity_regularizer"]
    keras.mixed_precision.set_global_policy("float32")
