"""`mp-callbacks` on Keras's JAX and torch backends: doctor, bench and tune
measure there."""

from __future__ import annotations

import importlib
import json

import keras
import pytest

from mp_callbacks_bench.cli import main

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)
BACKEND = keras.backend.backend()
FRAMEWORK = {"jax": "JAX", "torch": "PyTorch"}.get(BACKEND, "")


def test_doctor_reports_the_backend_and_its_version(capsys):
    version = str(importlib.import_module(BACKEND).__version__)
    assert main(["doctor", "--no-probe", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["backend"] == BACKEND and document["backend_version"] == version
    assert document["versions"][BACKEND] == version and "tensorflow" not in document["versions"]
    assert document["recommended_policy"] in ("float32", "mixed_float16", "mixed_bfloat16")
    assert main(["doctor", "--no-probe"]) == 0
    assert capsys.readouterr().out.startswith(f"{FRAMEWORK} {version}, Keras")


def test_tune_measures_its_plan_on_this_backend(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["tune", "--quick", "--train-samples", "256", "--steps", "5", "--policies", "mixed_bfloat16"]
    assert main([*argv, "--json", str(path)]) == 0
    plan = json.loads(path.read_text())
    assert [c["policy"] for c in plan["candidates"]] == ["float32", "mixed_bfloat16"]
    assert plan["policy"] in ("float32", "mixed_bfloat16") and plan["measured_on"]
    assert all(c["steps"] > 0 for c in plan["candidates"])
    assert capsys.readouterr().out.splitlines()[0].startswith("plan: ")


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_a_bench_run_trains_and_reports_on_this_backend(policy):
    from mp_callbacks_bench.runner import run_policy
    from mp_callbacks_bench.settings import BenchSettings

    settings = BenchSettings(
        policies=[policy], epochs=2, batch_size=64, train_samples=256, test_samples=64, quiet=True
    )
    row = run_policy(policy, settings)
    assert row["policy"] == policy and row["epochs"] == 2 and not row["diverged"]
    assert row["memory_kind"] == "process peak RSS" and row["peak_memory_mb"] > 0
    assert row["skipped_steps"] == 0 and row["epoch_time"] > 0 and row["samples_per_sec"] > 0
    assert row["final_loss_scale"] == (2.0**15 if policy == "mixed_float16" else 1.0)
    assert 0.0 <= row["accuracy"] <= 1.0
    keras.mixed_precision.set_global_policy("float32")
