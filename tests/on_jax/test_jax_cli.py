"""`mp-callbacks` on Keras's JAX backend: doctor measures there, bench and
tune say in one line that they need TensorFlow."""

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


@pytest.mark.parametrize("command", [["bench", "--quick"], ["tune"]])
def test_bench_and_tune_refuse_jax_in_one_line(command, capsys):
    assert main(command) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert error.startswith(f"mp-callbacks {command[0]}: error:") and "'jax'" in error
    assert "KERAS_BACKEND=tensorflow" in error
