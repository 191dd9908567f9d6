"""`mp-callbacks` on Keras's JAX backend: doctor and tune measure there,
bench says in one line that it needs TensorFlow."""

from __future__ import annotations

import json

import keras
import pytest

from mp_callbacks_bench.cli import main

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX backend's tests")


def test_doctor_reports_the_jax_backend_and_its_version(capsys):
    import jax

    assert main(["doctor", "--no-probe", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["backend"] == "jax" and document["backend_version"] == jax.__version__
    assert document["versions"]["jax"] == jax.__version__ and "tensorflow" not in document["versions"]
    assert document["recommended_policy"] in ("float32", "mixed_float16", "mixed_bfloat16")
    assert main(["doctor", "--no-probe"]) == 0
    assert capsys.readouterr().out.startswith(f"JAX {jax.__version__}, Keras")


def test_bench_refuses_jax_in_one_line(capsys):
    assert main(["bench", "--quick"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert error.startswith("mp-callbacks bench: error:") and "'jax'" in error
    assert "KERAS_BACKEND=tensorflow" in error


def test_tune_measures_its_plan_on_jax(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["tune", "--quick", "--train-samples", "256", "--steps", "5", "--policies", "mixed_bfloat16"]
    assert main([*argv, "--json", str(path)]) == 0
    plan = json.loads(path.read_text())
    assert [c["policy"] for c in plan["candidates"]] == ["float32", "mixed_bfloat16"]
    assert plan["policy"] in ("float32", "mixed_bfloat16") and plan["measured_on"]
    assert all(c["steps"] > 0 for c in plan["candidates"])
    assert capsys.readouterr().out.splitlines()[0].startswith("plan: ")
