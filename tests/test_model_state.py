"""MixedPrecisionModel: a skipped step changes no state at all; a failed
load changes nothing; weights and exports serve without mp_callbacks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from helpers import classification_data, tiny_classifier

import mp_callbacks as mp

# Tiny layers (4 units) keep float16 cheap on CPU; compile's check_model
# hint about Tensor-Core sizes is expected here and tested in test_model_checks.
pytestmark = pytest.mark.filterwarnings("ignore:check_model found:mp_callbacks.errors.MixedPrecisionWarning")


def _bn_model(policy: str, units: int = 4):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,))]
    for i in range(4):
        layers += [
            keras.layers.Dense(units, name=f"dense_{i}"),
            keras.layers.BatchNormalization(name=f"bn_{i}"),
        ]
    layers.append(keras.layers.Dense(3, dtype="float32", name="head"))
    model = mp.MixedPrecisionModel.from_model(keras.Sequential(layers))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _values(variables):
    return [np.array(v.numpy()) for v in variables]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_a_skipped_step_leaves_batch_norm_statistics_untouched(policy):
    model = _bn_model(policy)
    x, y = classification_data(n=16)
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # build + one real step
    before = _values(model.variables)
    iterations = int(model.optimizer.iterations.numpy())
    bad = x[8:].copy()
    bad[3, 2] = np.nan  # one value in one batch
    history = model.fit(bad, y[8:], batch_size=8, epochs=1, verbose=0)
    assert history.history["skipped_steps"] == [1.0]
    after = _values(model.variables)
    for variable, old, new in zip(model.variables, before, after):
        np.testing.assert_array_equal(old, new, err_msg=variable.path)
    assert int(model.optimizer.iterations.numpy()) == iterations
    moving = [v for v in model.non_trainable_variables if "moving" in v.path]
    assert len(moving) == 8
    assert np.isfinite(model.predict(x, verbose=0)).all()
    assert np.isfinite(model.evaluate(x, y, verbose=0))
    # A healthy step after it still updates the statistics.
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    assert any(
        not np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables) if "moving" in v.path
    )


def test_a_skipped_step_on_a_model_without_forward_state():
    model = tiny_classifier(loss_scale=None)
    model.compile("adam", "sparse_categorical_crossentropy")
    x, y = classification_data(n=8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.non_trainable_variables == []
    before = _values(model.variables) + _values(model.optimizer.variables)
    x[0, 0] = np.inf
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    after = _values(model.variables) + _values(model.optimizer.variables)
    for old, new in zip(before, after):
        np.testing.assert_array_equal(old, new)


def _trained(loss_scale, units=4, seed=0):
    model = tiny_classifier(units=units, loss_scale=loss_scale, seed=seed)
    model.compile("adam", "sparse_categorical_crossentropy")
    x, y = classification_data(n=16)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model


# Keras's own warning when the file holds another architecture: part of the case.
@pytest.mark.filterwarnings("ignore:Skipping nested container:UserWarning")
@pytest.mark.parametrize("case", ["other_architecture", "corrupted_scale", "missing_file"])
def test_a_failed_load_changes_nothing(tmp_path, case):
    target = _trained(mp.LossScaler(initial_scale=512.0, growth_interval=1), seed=1)
    path = str(tmp_path / "source.weights.h5")
    if case == "other_architecture":
        _trained(mp.LossScaler(initial_scale=8.0), units=5).save_weights(path)
    elif case == "corrupted_scale":
        source = _trained(mp.LossScaler(initial_scale=8.0))
        source.scaler._state["scale"].assign(np.nan)
        source.save_weights(path)
    else:
        path = str(tmp_path / "absent.weights.h5")
    weights = _values(target.variables) + _values(target.optimizer.variables)
    state = target.scaler.diagnostics()
    with pytest.raises(Exception) as caught:
        target.load_weights(path)
    if case == "corrupted_scale":
        assert "loss scale" in str(caught.value)
    assert target.scaler.diagnostics() == state
    for old, new in zip(weights, _values(target.variables) + _values(target.optimizer.variables)):
        np.testing.assert_array_equal(old, new)


def test_weights_load_into_a_plain_keras_model_for_serving(tmp_path):
    model = _trained(mp.LossScaler(initial_scale=64.0))
    path = str(tmp_path / "trained.weights.h5")
    model.save_weights(path)

    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32", name="head")(hidden)
    plain = keras.Model(inputs, outputs)
    plain.load_weights(path)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    # And back: the loss scale is still in the file for a MixedPrecisionModel.
    again = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=2.0), seed=3)
    again.load_weights(path)
    assert again.get_scale() == 64.0


@pytest.mark.slow
def test_export_serves_without_mp_callbacks(tmp_path):
    model = _trained(mp.LossScaler(initial_scale=64.0))
    x, _ = classification_data(n=4)
    expected = model.predict(x, verbose=0)
    export_dir = str(tmp_path / "exported")
    model.export(export_dir, verbose=False)
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import sys, numpy as np, tensorflow as tf
        sys.modules["mp_callbacks"] = None  # importing it would fail
        served = tf.saved_model.load({export_dir!r})
        out = served.serve(tf.constant(np.load({str(tmp_path / "x.npy")!r})))
        np.save({str(tmp_path / "out.npy")!r}, out.numpy())
    """)
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-6)


@pytest.mark.parametrize("built", ["functional", "from_model"])
def test_a_trained_model_pickles_and_trains_on_as_the_original(built):
    # Keras pickles a model as its .keras archive (for distributed
    # frameworks); a functional MixedPrecisionModel's class is made at run
    # time, which pickle could not find by name.
    import pickle

    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = classification_data(n=64)
    if built == "functional":
        model = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=1024.0, growth_interval=1))
    else:
        model = mp.MixedPrecisionModel.from_model(
            tiny_classifier(cls=keras.Model),
            loss_scale=mp.LossScaler(initial_scale=1024.0, growth_interval=1),
        )
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert model.get_scale() == 1024.0 * 2**4
    copy = pickle.loads(pickle.dumps(model))
    assert isinstance(copy, mp.MixedPrecisionModel)
    assert copy.get_scale() == model.get_scale()
    for a, b in zip(model.get_weights(), copy.get_weights()):
        np.testing.assert_array_equal(a, b)
    histories = [
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history for m in (model, copy)
    ]
    assert histories[0] == histories[1]
    for a, b in zip(
        model.get_weights() + [v.numpy() for v in model.optimizer.variables],
        copy.get_weights() + [v.numpy() for v in copy.optimizer.variables],
    ):
        np.testing.assert_array_equal(a, b)
