"""Real keras-tuner searches with MixedPrecisionModel and the callbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import keras_tuner as kt
import pytest
from helpers import classification_data

import mp_callbacks as mp
from mp_callbacks.tuner import MixedPrecisionHyperModel, policy_scope

X, Y = classification_data(n=96)
X_VAL, Y_VAL = classification_data(n=32, seed=1)
POLICIES_AT_BUILD: list[tuple[str, str]] = []


def build_model(hp):
    POLICIES_AT_BUILD.append((hp.get("dtype_policy"), keras.config.dtype_policy().name))
    units = hp.Choice("units", [8, 16])
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(units, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32", name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


TUNERS = {
    "random": lambda **kw: kt.RandomSearch(max_trials=3, **kw),
    "bayesian": lambda **kw: kt.BayesianOptimization(max_trials=3, num_initial_points=2, **kw),
    "hyperband": lambda **kw: kt.Hyperband(max_epochs=2, factor=2, hyperband_iterations=1, **kw),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(TUNERS))
def test_search_with_the_three_callbacks_and_epoch_time_objective(kind, tmp_path):
    POLICIES_AT_BUILD.clear()
    keras.config.set_dtype_policy("float32")
    callbacks = [mp.LossScaleMonitor(), mp.NaNGradientMonitor(), mp.EpochTimer()]
    tuner = TUNERS[kind](
        hypermodel=MixedPrecisionHyperModel(build_model, policies=["float32", "mixed_bfloat16"]),
        objective=kt.Objective("epoch_time", "min"),
        directory=str(tmp_path),
        project_name=kind,
        overwrite=True,
        seed=1,
    )
    tuner.search(
        X, Y, epochs=2, batch_size=16, validation_data=(X_VAL, Y_VAL), callbacks=callbacks, verbose=0
    )

    completed = [t for t in tuner.oracle.trials.values() if t.status == "COMPLETED"]
    assert len(completed) >= 2
    for trial in completed:
        assert trial.score > 0
        for metric in ("epoch_time", "loss_scale", "samples_per_sec", "skipped_steps", "grad_norm"):
            assert trial.metrics.exists(metric), metric
    # Every build saw exactly its trial's policy, and nothing leaked out.
    assert POLICIES_AT_BUILD and all(chosen == seen for chosen, seen in POLICIES_AT_BUILD)
    assert keras.config.dtype_policy().name == "float32"
    # keras-tuner deep-copied the callbacks: the originals never trained.
    assert callbacks[2].records == [] and getattr(callbacks[0], "_model", None) is None

    best_hp = tuner.get_best_hyperparameters(1)[0]
    best = tuner.get_best_models(1)[0]
    assert isinstance(best, mp.MixedPrecisionModel)
    expected = "bfloat16" if best_hp.get("dtype_policy") == "mixed_bfloat16" else "float32"
    assert best.get_layer("hidden").compute_dtype == expected


@pytest.mark.slow
def test_accuracy_and_epoch_time_together_and_loss_scale_space_for_float16_trials_only(tmp_path):
    tuner = kt.GridSearch(
        MixedPrecisionHyperModel(
            build_model,
            policies=["float32", "mixed_float16"],
            loss_scale_space={"initial_scale": [256.0, 1024.0]},
        ),
        objective=[kt.Objective("val_accuracy", "max"), kt.Objective("epoch_time", "min")],
        max_trials=6,
        directory=str(tmp_path),
        project_name="multi",
        overwrite=True,
    )
    tuner.search(
        X,
        Y,
        epochs=1,
        batch_size=32,
        validation_data=(X_VAL, Y_VAL),
        callbacks=[mp.EpochTimer(), mp.LossScaleMonitor()],
        verbose=0,
    )
    seen = set()
    for trial in tuner.oracle.trials.values():
        assert trial.status == "COMPLETED"
        policy = trial.hyperparameters.get("dtype_policy")
        logged = trial.metrics.get_history("loss_scale")[0].value
        if policy == "mixed_float16":
            chosen = trial.hyperparameters.get("loss_scale_initial_scale")
            assert logged == [chosen]
        else:  # no loss scale where it would do nothing
            assert not trial.hyperparameters.is_active("loss_scale_initial_scale")
            assert logged == [1.0]
        seen.add((policy, logged[0]))
    assert seen == {("float32", 1.0), ("mixed_float16", 256.0), ("mixed_float16", 1024.0)}


def test_policy_scope_restores_on_error():
    keras.config.set_dtype_policy("float32")
    with pytest.raises(RuntimeError), policy_scope("mixed_bfloat16"):
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
        raise RuntimeError("build failed")
    assert keras.config.dtype_policy().name == "float32"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"policies": ["float64"]}, "policies"),
        ({"policies": []}, "policies"),
        ({"loss_scale_space": {"scale": [1.0]}}, "loss_scale_space"),
        (
            {"policies": ["float32", "mixed_bfloat16"], "loss_scale_space": {"hysteresis": [1, 2]}},
            "loss_scale_space",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        MixedPrecisionHyperModel(build_model, **kwargs)


def test_loss_scale_space_needs_a_mixed_precision_model():
    hypermodel = MixedPrecisionHyperModel(
        lambda hp: keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
        policies=["mixed_float16"],
        loss_scale_space={"hysteresis": [1, 2]},
    )
    with pytest.raises(TypeError, match="MixedPrecisionModel"):
        hypermodel.build(kt.HyperParameters())


@pytest.mark.slow
def test_distributed_search_with_a_chief_and_two_workers_on_localhost(tmp_path):
    """keras-tuner's own distribution (KERASTUNER_TUNER_ID / ORACLE_IP /
    ORACLE_PORT), as the guide runs it: every trial completes, with its
    policy and `epoch_time`, over both policies."""
    example = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "examples", "distributed_tuner_search.py"
    )
    environment = {key: value for key, value in os.environ.items() if not key.startswith("KERASTUNER_")}
    done = subprocess.run(
        [sys.executable, example, "--directory", str(tmp_path), "--max-trials", "4", "--timeout", "240"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**environment, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    logs = {path.name: path.read_text()[-1500:] for path in tmp_path.glob("*.log")}
    assert done.returncode == 0, (done.stderr[-2000:], logs)
    trials = json.loads((tmp_path / "trials.json").read_text())
    assert len(trials) == 4 and {t["status"] for t in trials} == {"COMPLETED"}
    assert sorted((t["policy"], t["units"]) for t in trials) == [
        ("float32", 8),
        ("float32", 16),
        ("mixed_bfloat16", 8),
        ("mixed_bfloat16", 16),
    ]
    assert all(t["epoch_time"] > 0 and 0 <= t["val_accuracy"] <= 1 for t in trials)
    assert "4 trials on 2 workers" in done.stdout
    # Both workers ran the search: each saves its tuner state as <tuner id>.json.
    assert {"worker0.json", "worker1.json"} <= {path.name for path in (tmp_path / "distributed").iterdir()}
