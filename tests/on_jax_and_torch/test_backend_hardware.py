"""The hardware advisor on Keras's JAX and torch backends: the probe runs on
the backend that trains, real work (no folded constants on JAX), and the
advice names that backend."""

from __future__ import annotations

import importlib

import keras
import pytest

import mp_callbacks as mp
from mp_callbacks._cpu_features import CpuInfo

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)

BACKEND = keras.backend.backend()
platform = importlib.import_module(f"mp_callbacks.backends.{BACKEND}.platform")
FRAMEWORK = {"jax": "JAX", "torch": "PyTorch"}.get(BACKEND, "")
BFLOAT16_CPU = CpuInfo("AMD EPYC", "x86_64", frozenset({"avx512_bf16"}), "/proc/cpuinfo")


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled program")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_probe_multiplies_and_convolves_in_the_dtype_it_measures(dtype):
    step = platform.probe_step(dtype)
    program = step.compiled.as_text()
    # Captured arrays would be constants XLA folds away, timing nothing.
    assert "dot(" in program and "convolution(" in program
    assert f"{'bf16' if dtype == 'bfloat16' else 'f32'}[512,512]" in program
    assert step() == step()  # the same work every call


def test_the_measured_report_names_the_backend():
    speed = mp.hardware.measure_policy_speed(["mixed_bfloat16"], rounds=1, calls_per_round=1)
    assert set(speed.ratios) == {"float32", "mixed_bfloat16"} and speed.ratios["float32"] == 1.0
    assert speed.ratios["mixed_bfloat16"] > 0 and speed.device == "CPU:0"
    report = mp.inspect_hardware(cpu=BFLOAT16_CPU, speed=speed)
    assert report.backend == BACKEND and report.tensorflow_version is None
    assert report.as_dict()["backend_version"] == platform.version()
    assert report.format_text().startswith(f"{FRAMEWORK} {platform.version()}, Keras {keras.__version__}")


def test_a_slowdown_measured_on_this_backend_overrules_the_cpus_bfloat16():
    # What JAX's CPU kernels made of bfloat16 on an AMD EPYC with AVX512-BF16.
    report = mp.inspect_hardware(cpu=BFLOAT16_CPU, gpus=[], speed={"float32": 1.0, "mixed_bfloat16": 0.93})
    assert report.recommended_policy == "float32"
    assert "suggests mixed_bfloat16, but it did not run faster here" in report.reason
    rules = mp.inspect_hardware(measure=False, cpu=BFLOAT16_CPU, gpus=[])
    assert rules.recommended_policy == "mixed_bfloat16"
    assert f"{FRAMEWORK}'s CPU kernels" in rules.reason and "TensorFlow" not in rules.format_text()
