"""keras-tuner on Keras's JAX backend: the policy and the loss scale as
hyperparameters, as on TensorFlow, in an install without TensorFlow."""

from __future__ import annotations

import keras
import keras_tuner as kt
import numpy as np
import pytest

import mp_callbacks as mp
from mp_callbacks.tuner import MixedPrecisionHyperModel

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(64, 6)).astype("float32")
Y = _RNG.integers(0, 3, size=(64,))
POLICIES_AT_BUILD: list[tuple[str, str]] = []


def build_model(hp):
    POLICIES_AT_BUILD.append((hp.get("dtype_policy"), keras.config.dtype_policy().name))
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(hp.Choice("units", [8]), activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32", name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_each_trial_trains_under_its_policy_with_its_loss_scale(tmp_path):
    POLICIES_AT_BUILD.clear()
    keras.config.set_dtype_policy("float32")
    tuner = kt.GridSearch(
        MixedPrecisionHyperModel(
            build_model,
            policies=["float32", "mixed_float16", "mixed_bfloat16"],
            loss_scale_space={"initial_scale": [256.0, 1024.0]},
        ),
        objective=kt.Objective("epoch_time", "min"),
        max_trials=8,
        directory=str(tmp_path),
        overwrite=True,
    )
    tuner.search(X, Y, epochs=1, batch_size=16, callbacks=[mp.EpochTimer(), mp.LossScaleMonitor()], verbose=0)
    seen = set()
    for trial in tuner.oracle.trials.values():
        assert trial.status == "COMPLETED" and trial.score > 0
        policy = trial.hyperparameters.get("dtype_policy")
        logged = trial.metrics.get_history("loss_scale")[0].value[0]
        if policy == "mixed_float16":
            assert logged == trial.hyperparameters.get("loss_scale_initial_scale")
        else:  # no loss scale where it would do nothing
            assert not trial.hyperparameters.is_active("loss_scale_initial_scale") and logged == 1.0
        assert trial.metrics.exists("skipped_steps") and trial.metrics.exists("grad_norm")
        seen.add((policy, logged))
    assert seen == {
        ("float32", 1.0),
        ("mixed_float16", 256.0),
        ("mixed_float16", 1024.0),
        ("mixed_bfloat16", 1.0),
    }
    assert POLICIES_AT_BUILD and all(chosen == at_build for chosen, at_build in POLICIES_AT_BUILD)
    assert keras.config.dtype_policy().name == "float32"
    best_hp = tuner.get_best_hyperparameters(1)[0]
    best = tuner.get_best_models(1)[0]
    expected = keras.dtype_policies.get(best_hp.get("dtype_policy")).compute_dtype
    assert best.get_layer("hidden").compute_dtype == expected


def test_bad_loss_scale_values_are_refused_before_the_search():
    with pytest.raises(ValueError, match=r"`hysteresis`.*received hysteresis=0"):
        MixedPrecisionHyperModel(
            build_model, policies=["mixed_float16"], loss_scale_space={"hysteresis": [1, 0]}
        )
    with pytest.raises(ValueError, match="`loss_scale_space`"):
        MixedPrecisionHyperModel(
            build_model, policies=["mixed_bfloat16"], loss_scale_space={"hysteresis": [1]}
        )
