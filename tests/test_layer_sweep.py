"""Every layer class `keras.layers` offers, through every library function.

A tiny model is built around each layer (wrappers with a layer inside,
cells in an RNN, merge and attention layers on two inputs, preprocessing
layers adapted on built-in data), under a mixed policy, and checked:
`float32_copy` computes every layer in float32 and predicts exactly what the
same weights give when built under float32; `with_float32_layers` and
`PrecisionPlan.apply` likewise; `check_model` has no findings;
`diagnose_batch` runs; a `MixedPrecisionModel` fit skips a poisoned batch
with every variable left as it was. The classes that cannot be built
without external data or another backend are listed with the reason, and
the test fails on a class that is neither swept nor listed, so a Keras
release's new layer is not missed.
"""

from __future__ import annotations

import inspect
import warnings

import keras
import numpy as np
import pytest

import mp_callbacks as mp

# A sweep of what the installed Keras offers: CI runs it on the oldest Keras too.
pytestmark = [pytest.mark.slow, pytest.mark.sweep]

_RNG = np.random.default_rng(0)

# (input shape without batch, constructor); merge and attention layers take
# two inputs of the shape.
_FLAT, _SEQ, _IMG, _VOL = (6,), (5, 6), (8, 8, 3), (4, 4, 4, 2)

_SWEPT: dict[str, tuple[tuple[int, ...], object]] = {
    "Activation": (_FLAT, lambda: keras.layers.Activation("tanh")),
    "ActivityRegularization": (_FLAT, lambda: keras.layers.ActivityRegularization(l1=0.01)),
    "AdaptiveAveragePooling1D": (_SEQ, lambda: keras.layers.AdaptiveAveragePooling1D(2)),
    "AdaptiveAveragePooling2D": (_IMG, lambda: keras.layers.AdaptiveAveragePooling2D(2)),
    "AdaptiveAveragePooling3D": (_VOL, lambda: keras.layers.AdaptiveAveragePooling3D(2)),
    "AdaptiveMaxPooling1D": (_SEQ, lambda: keras.layers.AdaptiveMaxPooling1D(2)),
    "AdaptiveMaxPooling2D": (_IMG, lambda: keras.layers.AdaptiveMaxPooling2D(2)),
    "AdaptiveMaxPooling3D": (_VOL, lambda: keras.layers.AdaptiveMaxPooling3D(2)),
    "AlphaDropout": (_FLAT, lambda: keras.layers.AlphaDropout(0.1)),
    "AugMix": (_IMG, lambda: keras.layers.AugMix(value_range=(0, 1))),
    "AutoContrast": (_IMG, lambda: keras.layers.AutoContrast(value_range=(0, 1))),
    "AveragePooling1D": (_SEQ, lambda: keras.layers.AveragePooling1D(2)),
    "AveragePooling2D": (_IMG, lambda: keras.layers.AveragePooling2D(2)),
    "AveragePooling3D": (_VOL, lambda: keras.layers.AveragePooling3D(2)),
    "BatchNormalization": (_FLAT, lambda: keras.layers.BatchNormalization()),
    "Bidirectional": (_SEQ, lambda: keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True))),
    "CategoryEncoding": ((3,), None),  # integer ids: built below
    "CenterCrop": (_IMG, lambda: keras.layers.CenterCrop(6, 6)),
    "ContrastLimitedAdaptiveHistogramEqualization": (
        _IMG,
        lambda: keras.layers.ContrastLimitedAdaptiveHistogramEqualization(value_range=(0, 1)),
    ),
    "Conv1D": (_SEQ, lambda: keras.layers.Conv1D(4, 2)),
    "Conv1DTranspose": (_SEQ, lambda: keras.layers.Conv1DTranspose(4, 2)),
    "Conv2D": (_IMG, lambda: keras.layers.Conv2D(4, 3)),
    "Conv2DTranspose": (_IMG, lambda: keras.layers.Conv2DTranspose(4, 3)),
    "Conv3D": (_VOL, lambda: keras.layers.Conv3D(2, 2)),
    "Conv3DTranspose": (_VOL, lambda: keras.layers.Conv3DTranspose(2, 2)),
    "ConvLSTM1D": ((3, 5, 2), lambda: keras.layers.ConvLSTM1D(2, 2)),
    "ConvLSTM2D": ((3, 5, 5, 2), lambda: keras.layers.ConvLSTM2D(2, 2)),
    "ConvLSTM3D": ((2, 4, 4, 4, 1), lambda: keras.layers.ConvLSTM3D(1, 2)),
    "Cropping1D": (_SEQ, lambda: keras.layers.Cropping1D(1)),
    "Cropping2D": (_IMG, lambda: keras.layers.Cropping2D(1)),
    "Cropping3D": (_VOL, lambda: keras.layers.Cropping3D(1)),
    "CutMix": (_IMG, lambda: keras.layers.CutMix()),
    "Dense": (_FLAT, lambda: keras.layers.Dense(4)),
    "DepthwiseConv1D": (_SEQ, lambda: keras.layers.DepthwiseConv1D(2)),
    "DepthwiseConv2D": (_IMG, lambda: keras.layers.DepthwiseConv2D(3)),
    "Discretization": (_FLAT, lambda: keras.layers.Discretization(bin_boundaries=[-1.0, 0.0, 1.0])),
    "Dropout": (_FLAT, lambda: keras.layers.Dropout(0.2)),
    "ELU": (_FLAT, lambda: keras.layers.ELU()),
    "EinsumDense": (_FLAT, lambda: keras.layers.EinsumDense("ab,bc->ac", output_shape=4, bias_axes="c")),
    "Embedding": ((3,), None),  # integer ids: built below
    "Equalization": (_IMG, lambda: keras.layers.Equalization(value_range=(0, 1))),
    "Flatten": (_SEQ, lambda: keras.layers.Flatten()),
    "GRU": (_SEQ, lambda: keras.layers.GRU(3)),
    "GRUCell": (_SEQ, lambda: keras.layers.RNN(keras.layers.GRUCell(3))),
    "GaussianDropout": (_FLAT, lambda: keras.layers.GaussianDropout(0.1)),
    "GaussianNoise": (_FLAT, lambda: keras.layers.GaussianNoise(0.1)),
    "GlobalAveragePooling1D": (_SEQ, lambda: keras.layers.GlobalAveragePooling1D()),
    "GlobalAveragePooling2D": (_IMG, lambda: keras.layers.GlobalAveragePooling2D()),
    "GlobalAveragePooling3D": (_VOL, lambda: keras.layers.GlobalAveragePooling3D()),
    "GlobalMaxPooling1D": (_SEQ, lambda: keras.layers.GlobalMaxPooling1D()),
    "GlobalMaxPooling2D": (_IMG, lambda: keras.layers.GlobalMaxPooling2D()),
    "GlobalMaxPooling3D": (_VOL, lambda: keras.layers.GlobalMaxPooling3D()),
    "GroupNormalization": (_SEQ, lambda: keras.layers.GroupNormalization(groups=2)),
    "Hashing": ((3,), None),  # integer ids: built below
    "Identity": (_FLAT, lambda: keras.layers.Identity()),
    "IntegerLookup": ((3,), None),  # integer ids: built below
    "LSTM": (_SEQ, lambda: keras.layers.LSTM(3)),
    "LSTMCell": (_SEQ, lambda: keras.layers.RNN(keras.layers.LSTMCell(3))),
    "Lambda": (_FLAT, lambda: keras.layers.Lambda(lambda t: t * 2.0)),
    "LayerNormalization": (_FLAT, lambda: keras.layers.LayerNormalization()),
    "LeakyReLU": (_FLAT, lambda: keras.layers.LeakyReLU()),
    "Masking": (_SEQ, lambda: keras.layers.Masking()),
    "MaxPooling1D": (_SEQ, lambda: keras.layers.MaxPooling1D(2)),
    "MaxPooling2D": (_IMG, lambda: keras.layers.MaxPooling2D(2)),
    "MaxPooling3D": (_VOL, lambda: keras.layers.MaxPooling3D(2)),
    "MixUp": (_IMG, lambda: keras.layers.MixUp()),
    "Normalization": (_FLAT, None),  # adapted: built below
    "PReLU": (_FLAT, lambda: keras.layers.PReLU()),
    "Permute": (_SEQ, lambda: keras.layers.Permute((2, 1))),
    "Pipeline": (
        _IMG,
        lambda: keras.layers.Pipeline([keras.layers.RandomFlip(), keras.layers.Rescaling(0.5)]),
    ),
    "RMSNormalization": (_FLAT, lambda: keras.layers.RMSNormalization()),
    "RNN": (_SEQ, lambda: keras.layers.RNN(keras.layers.SimpleRNNCell(3))),
    "RandAugment": (_IMG, lambda: keras.layers.RandAugment(value_range=(0, 1))),
    "RandomBrightness": (_IMG, lambda: keras.layers.RandomBrightness(0.1, value_range=(0, 1))),
    "RandomColorDegeneration": (_IMG, lambda: keras.layers.RandomColorDegeneration(0.2)),
    "RandomColorJitter": (
        _IMG,
        lambda: keras.layers.RandomColorJitter(value_range=(0, 1), brightness_factor=0.1),
    ),
    "RandomContrast": (_IMG, lambda: keras.layers.RandomContrast(0.2)),
    "RandomCrop": (_IMG, lambda: keras.layers.RandomCrop(6, 6)),
    "RandomElasticTransform": (_IMG, lambda: keras.layers.RandomElasticTransform(value_range=(0, 1))),
    "RandomErasing": (_IMG, lambda: keras.layers.RandomErasing(value_range=(0, 1))),
    "RandomFlip": (_IMG, lambda: keras.layers.RandomFlip()),
    "RandomGaussianBlur": (_IMG, lambda: keras.layers.RandomGaussianBlur(value_range=(0, 1))),
    "RandomGrayscale": (_IMG, lambda: keras.layers.RandomGrayscale()),
    "RandomHue": (_IMG, lambda: keras.layers.RandomHue(0.2, value_range=(0, 1))),
    "RandomInvert": (_IMG, lambda: keras.layers.RandomInvert(value_range=(0, 1))),
    "RandomPerspective": (_IMG, lambda: keras.layers.RandomPerspective()),
    "RandomPosterization": (_IMG, lambda: keras.layers.RandomPosterization(factor=4, value_range=(0, 1))),
    "RandomRotation": (_IMG, lambda: keras.layers.RandomRotation(0.1)),
    "RandomSaturation": (_IMG, lambda: keras.layers.RandomSaturation(0.2, value_range=(0, 1))),
    "RandomSharpness": (_IMG, lambda: keras.layers.RandomSharpness(0.2, value_range=(0, 1))),
    "RandomShear": (_IMG, lambda: keras.layers.RandomShear(0.1)),
    "RandomTranslation": (_IMG, lambda: keras.layers.RandomTranslation(0.1, 0.1)),
    "RandomZoom": (_IMG, lambda: keras.layers.RandomZoom(0.1)),
    "ReLU": (_FLAT, lambda: keras.layers.ReLU()),
    "RepeatVector": (_FLAT, lambda: keras.layers.RepeatVector(2)),
    "Rescaling": (_FLAT, lambda: keras.layers.Rescaling(0.5)),
    "Reshape": (_FLAT, lambda: keras.layers.Reshape((2, 3))),
    "Resizing": (_IMG, lambda: keras.layers.Resizing(4, 4)),
    "ReversibleEmbedding": ((3,), None),  # integer ids: built below
    "STFTSpectrogram": (
        (64, 1),
        lambda: keras.layers.STFTSpectrogram(frame_length=16, frame_step=8, fft_length=16),
    ),
    "MelSpectrogram": (
        (64,),
        lambda: keras.layers.MelSpectrogram(
            fft_length=16, sequence_stride=8, sampling_rate=100, num_mel_bins=4
        ),
    ),
    "SeparableConv1D": (_SEQ, lambda: keras.layers.SeparableConv1D(4, 2)),
    "SeparableConv2D": (_IMG, lambda: keras.layers.SeparableConv2D(4, 3)),
    "SimpleRNN": (_SEQ, lambda: keras.layers.SimpleRNN(3)),
    "SimpleRNNCell": (_SEQ, lambda: keras.layers.RNN(keras.layers.SimpleRNNCell(3))),
    "Softmax": (_FLAT, lambda: keras.layers.Softmax()),
    "Solarization": (_IMG, lambda: keras.layers.Solarization(value_range=(0, 1))),
    "SpatialDropout1D": (_SEQ, lambda: keras.layers.SpatialDropout1D(0.2)),
    "SpatialDropout2D": (_IMG, lambda: keras.layers.SpatialDropout2D(0.2)),
    "SpatialDropout3D": (_VOL, lambda: keras.layers.SpatialDropout3D(0.2)),
    "SpectralNormalization": (_FLAT, lambda: keras.layers.SpectralNormalization(keras.layers.Dense(4))),
    "StackedRNNCells": (
        _SEQ,
        lambda: keras.layers.RNN(
            keras.layers.StackedRNNCells([keras.layers.SimpleRNNCell(3), keras.layers.SimpleRNNCell(2)])
        ),
    ),
    "TimeDistributed": (_SEQ, lambda: keras.layers.TimeDistributed(keras.layers.Dense(3))),
    "UnitNormalization": (_FLAT, lambda: keras.layers.UnitNormalization()),
    "UpSampling1D": (_SEQ, lambda: keras.layers.UpSampling1D(2)),
    "UpSampling2D": (_IMG, lambda: keras.layers.UpSampling2D(2)),
    "UpSampling3D": (_VOL, lambda: keras.layers.UpSampling3D(2)),
    "ZeroPadding1D": (_SEQ, lambda: keras.layers.ZeroPadding1D(1)),
    "ZeroPadding2D": (_IMG, lambda: keras.layers.ZeroPadding2D(1)),
    "ZeroPadding3D": (_VOL, lambda: keras.layers.ZeroPadding3D(1)),
    # Two inputs.
    "Add": (_FLAT, keras.layers.Add),
    "Average": (_FLAT, keras.layers.Average),
    "Concatenate": (_FLAT, keras.layers.Concatenate),
    "Dot": (_FLAT, lambda: keras.layers.Dot(axes=1)),
    "Maximum": (_FLAT, keras.layers.Maximum),
    "Minimum": (_FLAT, keras.layers.Minimum),
    "Multiply": (_FLAT, keras.layers.Multiply),
    "Subtract": (_FLAT, keras.layers.Subtract),
    "AdditiveAttention": (_SEQ, keras.layers.AdditiveAttention),
    "Attention": (_SEQ, keras.layers.Attention),
    "MultiHeadAttention": (_SEQ, lambda: keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)),
    "GroupQueryAttention": (
        _SEQ,
        lambda: keras.layers.GroupQueryAttention(head_dim=3, num_query_heads=2, num_key_value_heads=1),
    ),
}

_TWO_INPUTS = {
    "Add", "Average", "Concatenate", "Dot", "Maximum", "Minimum", "Multiply", "Subtract",
    "AdditiveAttention", "Attention", "MultiHeadAttention", "GroupQueryAttention",
}  # fmt: skip
_INTEGER_IDS = {"CategoryEncoding", "Embedding", "Hashing", "IntegerLookup", "ReversibleEmbedding"}

#: Classes not swept, and why: each needs data, code or a backend a tiny
#: model cannot have, or is not a layer to compute with.
NOT_SWEPT = {
    "Layer": "the base class",
    "InputLayer": "every model's input: in every model of the sweep",
    "Wrapper": "an abstract base class (Bidirectional, TimeDistributed are swept)",
    "FlaxLayer": "wraps a Flax module: the JAX backend only",
    "JaxLayer": "wraps a JAX function: the JAX backend only",
    "TorchModuleWrapper": "wraps a torch.nn.Module: the PyTorch backend only",
    "TFSMLayer": "loads a TensorFlow SavedModel from disk (external data)",
    "TextVectorization": "string inputs and a vocabulary adapted on text: nothing a float policy computes",
    "StringLookup": "string inputs: nothing a float policy computes",
    "HashedCrossing": "crosses categorical (integer or string) features into integer ids",
    "MaxNumBoundingBoxes": "pads bounding-box dictionaries for detection pipelines, not tensors",
    # Aliases of swept classes.
    "AvgPool1D": "alias of AveragePooling1D",
    "AvgPool2D": "alias of AveragePooling2D",
    "AvgPool3D": "alias of AveragePooling3D",
    "MaxPool1D": "alias of MaxPooling1D",
    "MaxPool2D": "alias of MaxPooling2D",
    "MaxPool3D": "alias of MaxPooling3D",
    "GlobalAvgPool1D": "alias of GlobalAveragePooling1D",
    "GlobalAvgPool2D": "alias of GlobalAveragePooling2D",
    "GlobalAvgPool3D": "alias of GlobalAveragePooling3D",
    "GlobalMaxPool1D": "alias of GlobalMaxPooling1D",
    "GlobalMaxPool2D": "alias of GlobalMaxPooling2D",
    "GlobalMaxPool3D": "alias of GlobalMaxPooling3D",
    "Convolution1D": "alias of Conv1D",
    "Convolution2D": "alias of Conv2D",
    "Convolution3D": "alias of Conv3D",
    "Convolution1DTranspose": "alias of Conv1DTranspose",
    "Convolution2DTranspose": "alias of Conv2DTranspose",
    "Convolution3DTranspose": "alias of Conv3DTranspose",
    "SeparableConvolution1D": "alias of SeparableConv1D",
    "SeparableConvolution2D": "alias of SeparableConv2D",
}

_OFFERED = sorted(
    name
    for name, cls in inspect.getmembers(keras.layers, inspect.isclass)
    if issubclass(cls, keras.layers.Layer)
)
_SWEEP = [name for name in _OFFERED if name in _SWEPT]


def test_every_layer_keras_offers_is_swept_or_said_why_not():
    unaccounted = [name for name in _OFFERED if name not in _SWEPT and name not in NOT_SWEPT]
    assert unaccounted == [], f"new Keras layers to add to the sweep: {unaccounted}"


def _layer_under_test(name: str):
    shape, make = _SWEPT[name]
    if name == "Normalization":
        layer = keras.layers.Normalization()
        layer.adapt(np.random.default_rng(1).normal(3.0, 5.0, size=(32, *shape)).astype("float32"))
        return layer
    if name == "Embedding":
        return keras.layers.Embedding(10, 4)
    if name == "ReversibleEmbedding":
        return keras.layers.ReversibleEmbedding(10, 4)
    if name == "CategoryEncoding":
        return keras.layers.CategoryEncoding(num_tokens=10, output_mode="multi_hot")
    if name == "Hashing":
        return keras.layers.Hashing(num_bins=10)
    if name == "IntegerLookup":
        return keras.layers.IntegerLookup(vocabulary=[1, 2, 3, 4])
    return make()


def _model(name: str, cls=keras.Model):
    """Input(s) -> the layer -> Flatten -> Dense(2, float32), under the
    global policy, with the same initial weights for the same name."""
    keras.utils.set_random_seed(7)
    shape, _ = _SWEPT[name]
    layer = _layer_under_test(name)
    if name in _INTEGER_IDS:
        inputs = keras.Input(shape, dtype="int32")
        h = layer(inputs)
        if name in ("Hashing", "IntegerLookup"):
            h = keras.layers.Embedding(12, 4)(h)  # ids in, vectors out
        h = keras.layers.Activation("linear")(h)
        inputs_list = [inputs]
    elif name in _TWO_INPUTS:
        first, second = keras.Input(shape), keras.Input(shape)
        h = layer(first, second) if "MultiHead" in name or "GroupQuery" in name else layer([first, second])
        inputs_list = [first, second]
    else:
        inputs = keras.Input(shape)
        h = layer(inputs)
        inputs_list = [inputs]
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(2, dtype="float32", name="head")(h)
    return cls(inputs_list if len(inputs_list) > 1 else inputs_list[0], outputs), layer


def _data(name: str, n: int = 8):
    shape, _ = _SWEPT[name]
    if name in _INTEGER_IDS:
        return _RNG.integers(1, 5, size=(n, *shape)).astype("int32")
    x = _RNG.random((n, *shape)).astype("float32")
    return [x, _RNG.random((n, *shape)).astype("float32")] if name in _TWO_INPUTS else x


def _low_precision(model):
    return sorted(
        layer.name
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if not isinstance(layer, keras.layers.InputLayer) and layer.compute_dtype in ("float16", "bfloat16")
    )


#: Layers stock Keras itself cannot copy or run in float32 (Keras 3.15):
#: the copy must then fail with an error that names the cause.
_KERAS_OWN_LIMITS = {
    # get_config gives factor (-0.1, 0.1), which its constructor refuses:
    # stock save / load_model fails the same way.
    "RandomShear": "Keras cannot rebuild it from its own config",
}
#: Layers a float32 model of stock Keras cannot predict with: at inference
#: RandomCrop returns the input uncropped, against the shape it declared.
_NO_FLOAT32_REFERENCE = {"RandomCrop"}


@pytest.mark.parametrize("name", _SWEEP)
def test_copies_of_every_layer_compute_in_float32_with_the_same_predictions(name):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model, layer = _model(name, mp.MixedPrecisionModel)
    assert mp.check_model(model) == []
    if name in _KERAS_OWN_LIMITS:
        with pytest.raises(ValueError, match=_KERAS_OWN_LIMITS[name]):
            mp.float32_copy(model)
        return
    copies = [mp.float32_copy(model), mp.PrecisionPlan("float32").apply(model)]
    for copy in copies:
        assert _low_precision(copy) == []
    pinned = mp.with_float32_layers(model, [layer.name])
    assert _low_precision(pinned.get_layer(layer.name)) == []
    if name in _NO_FLOAT32_REFERENCE:
        return
    keras.mixed_precision.set_global_policy("float32")
    reference, _ = _model(name)
    reference.set_weights(model.get_weights())
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x = _data(name)
    expected = reference.predict(x, verbose=0)
    for copy in copies:
        np.testing.assert_array_equal(copy.predict(x, verbose=0), expected)


@pytest.mark.parametrize("name", _SWEEP)
def test_every_layer_skips_a_poisoned_batch_with_every_variable_kept(name):
    keras.mixed_precision.set_global_policy("mixed_float16")
    # Half the layers come in through from_model, as an existing model would.
    if _SWEEP.index(name) % 2:
        stock_model, _ = _model(name)
        model = mp.MixedPrecisionModel.from_model(stock_model)
    else:
        model, _ = _model(name, mp.MixedPrecisionModel)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    x = _data(name, 16)
    y = np.zeros((16, 2), "float32")
    probe = x[:4] if not isinstance(x, list) else [t[:4] for t in x]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(
                x, y, batch_size=8, epochs=1, verbose=0, callbacks=[mp.HeadroomMonitor(probe)]
            ).history
    except Exception as error:
        # Only where stock Keras fails the same way (TensorFlow has no
        # float16 CPU kernel for AvgPool3D, CutMix's range, ...): no worse.
        stock, _ = _model(name)
        stock.compile(keras.optimizers.Adam(1e-3), "mse")
        with pytest.raises(type(error)):
            stock.fit(x, y, batch_size=8, verbose=0)
        return
    # HeadroomMonitor logs a share of float16's range for each float16 layer it watched,
    # or says once why the probe cannot run (and training goes on).
    shares = [value for key, value in history.items() if key.startswith("headroom/")]
    assert all(np.isfinite(v[0]) and v[0] >= 0 for v in shares)
    cannot = [w for w in caught if "probe batch cannot run" in str(w.message)]
    assert len(cannot) <= 1 and (not cannot or name in _NO_FLOAT32_REFERENCE)
    before = [v.numpy() for v in model.variables + model.optimizer.variables]
    bad_y = y.copy()
    bad_y[:8] = np.nan  # the labels: every layer's input stays valid
    history = model.fit(
        x[:8] if not isinstance(x, list) else [t[:8] for t in x], bad_y[:8], verbose=0
    ).history
    assert history["skipped_steps"] == [1.0]
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    report = mp.diagnose_batch(model, x[:8] if not isinstance(x, list) else [t[:8] for t in x], y[:8])
    assert report.loss_finite
    # The replay puts back what its training-mode passes write (SpectralNormalization's kernel).
    for a, b in zip(after, model.variables + model.optimizer.variables):
        np.testing.assert_array_equal(a, b.numpy(), err_msg=b.path)


@pytest.mark.parametrize("name", ["Conv2D", "LSTM", "LayerNormalization"])
def test_autotune_plans_for_a_few_layers(name):
    x = _data(name, 64)
    y = np.random.default_rng(2).random((64, 2)).astype("float32")

    def build():
        model, _ = _model(name)
        model.compile("adam", "mse")
        return model

    plan = mp.autotune(
        build, x, y, policies=["float32", "mixed_bfloat16"], steps=5, batch_size=16, in_subprocess=False
    )
    assert plan.policy in ("float32", "mixed_bfloat16") and plan.reasons
    assert [c["policy"] for c in plan.candidates] == ["float32", "mixed_bfloat16"]
    applied = plan.apply(build())
    assert np.isfinite(applied.predict(x[:4], verbose=0)).all()
