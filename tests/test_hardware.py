"""The advisor: its rules and its measurement, on this machine and on
described ones (CPU features, GPUs and measurements are injected, so the
advice for a machine without native bfloat16 is tested here too)."""

from __future__ import annotations

import pathlib

import pytest

import mp_callbacks as mp
from mp_callbacks._cpu_features import CpuInfo, parse_proc_cpuinfo
from mp_callbacks.hardware import (
    MIN_SPEEDUP,
    PATHOLOGICAL_SPEED,
    POLICIES,
    GPUInfo,
    PolicySpeed,
    inspect_hardware,
    measure_policy_speed,
)

# Its module-scoped fixtures are built once: the whole file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_hardware")

RECORDED = pathlib.Path(__file__).parent / "data" / "cpuinfo"
EPYC_BF16 = parse_proc_cpuinfo((RECORDED / "linux-x86_64-amd-epyc-avx512-bf16.txt").read_text(), "x86_64")
XEON_NO_BF16 = parse_proc_cpuinfo((RECORDED / "linux-x86_64-xeon-8259cl-no-bf16.txt").read_text(), "x86_64")
GRAVITON3 = parse_proc_cpuinfo((RECORDED / "linux-aarch64-graviton3.txt").read_text(), "aarch64")
UNKNOWN_CPU = CpuInfo("Intel64 Family 6 Model 85", "AMD64")  # Windows: features not readable


def _report(cpu=XEON_NO_BF16, gpus=(), speed=None):
    return inspect_hardware(measure=False, cpu=cpu, gpus=list(gpus), speed=speed)


# ------------------------------------------------------ rules (no probe)
@pytest.mark.parametrize(
    "capability, policy, fast",
    [
        ((8, 0), "mixed_bfloat16", ["mixed_float16", "mixed_bfloat16"]),
        ((7, 5), "mixed_float16", ["mixed_float16"]),
        ((7, 0), "mixed_float16", ["mixed_float16"]),
        ((6, 1), "float32", []),
    ],
)
def test_gpu_generations(capability, policy, fast):
    report = _report(gpus=[GPUInfo("gpu", capability)])
    assert report.recommended_policy == policy
    assert report.fast_policies == report.expected_fast_policies == fast
    assert "not measured" in report.reason


def test_mixed_gpus_follow_the_weakest():
    report = _report(gpus=[GPUInfo("a100", (8, 0)), GPUInfo("t4", (7, 5))])
    assert report.recommended_policy == "mixed_float16"
    assert "t4" in report.reason


def test_gpu_warnings():
    assert any("Tensor Cores" in w for w in _report(gpus=[GPUInfo("p100", (6, 0))]).warnings)
    t4 = _report(gpus=[GPUInfo("t4", (7, 5))])
    assert any("loss scaling" in w for w in t4.warnings)
    assert any("mixed_bfloat16" in w and "slower" in w for w in t4.warnings)
    assert not any("mixed_bfloat16" in w for w in _report(gpus=[GPUInfo("a100", (8, 0))]).warnings)


@pytest.mark.parametrize(
    "cpu, policy, fast",
    [
        (EPYC_BF16, "mixed_bfloat16", ["mixed_bfloat16"]),
        (XEON_NO_BF16, "float32", []),
        (GRAVITON3, "mixed_bfloat16", ["mixed_float16", "mixed_bfloat16"]),
        (UNKNOWN_CPU, "float32", []),
    ],
)
def test_cpu_rules_without_measurement(cpu, policy, fast):
    report = _report(cpu=cpu)
    assert report.measured is None
    assert report.recommended_policy == policy
    assert report.fast_policies == fast


# ------------------------------------------- rules checked by measurement
def test_native_bfloat16_that_measures_fast_is_recommended():
    report = _report(EPYC_BF16, speed={"float32": 1.0, "mixed_float16": 0.24, "mixed_bfloat16": 1.62})
    assert report.recommended_policy == "mixed_bfloat16"
    assert report.fast_policies == ["mixed_bfloat16"]
    assert "1.62x" in report.reason and "avx512_bf16" in report.reason
    assert report.warnings == ["mixed_float16 is slower than float32 here: measured 0.24x of its speed."]
    assert report.slow_policies() == {
        "mixed_float16": "measured 0.24x of float32's speed in the probe on given"
    }


def test_cpu_without_bfloat16_is_told_float32_with_the_measured_figures():
    # Figures of an Intel Xeon with AVX-512 but no bfloat16.
    report = _report(XEON_NO_BF16, speed={"float32": 1.0, "mixed_float16": 0.56, "mixed_bfloat16": 0.35})
    assert report.recommended_policy == "float32"
    assert report.fast_policies == []
    assert "mixed_float16 0.56x, mixed_bfloat16 0.35x" in report.reason
    assert len(report.warnings) == 2 and all("slower than float32" in w for w in report.warnings)
    assert report.slow_policies() == {}  # slower, but not emulated: bench still runs them


def test_measurement_overrules_flags_that_promise_too_much():
    report = _report(EPYC_BF16, speed={"float32": 1.0, "mixed_float16": 0.23, "mixed_bfloat16": 0.45})
    assert report.expected_fast_policies == ["mixed_bfloat16"]
    assert report.recommended_policy == "float32"
    assert "The hardware suggests mixed_bfloat16, but it did not run faster here." in report.reason


def test_measurement_finds_what_the_platform_does_not_tell():
    report = _report(UNKNOWN_CPU, speed={"float32": 1.0, "mixed_float16": 0.9, "mixed_bfloat16": 1.3})
    assert report.recommended_policy == "mixed_bfloat16"
    assert any("does not tell the CPU's features" in w for w in report.warnings)


def test_speed_just_below_the_threshold_is_not_a_gain():
    just_below = MIN_SPEEDUP - 0.01
    report = _report(EPYC_BF16, speed={"float32": 1.0, "mixed_bfloat16": just_below})
    assert report.recommended_policy == "float32"
    assert (
        _report(EPYC_BF16, speed={"float32": 1.0, "mixed_bfloat16": MIN_SPEEDUP}).recommended_policy
        == "mixed_bfloat16"
    )


def test_gpu_prefers_bfloat16_when_nearly_as_fast_as_float16():
    a100 = [GPUInfo("a100", (8, 0))]
    close = _report(gpus=a100, speed={"float32": 1.0, "mixed_float16": 2.0, "mixed_bfloat16": 1.9})
    assert close.recommended_policy == "mixed_bfloat16"
    far = _report(gpus=a100, speed={"float32": 1.0, "mixed_float16": 2.0, "mixed_bfloat16": 1.2})
    assert far.recommended_policy == "mixed_float16"


def test_an_emulated_policy_is_pathological_and_marked_as_a_bound():
    speed = PolicySpeed(
        {"float32": 1.0, "mixed_float16": 0.004, "mixed_bfloat16": 2.5},
        seconds=3.0,
        device="CPU:0",
        bounded=["mixed_float16"],
    )
    report = _report(EPYC_BF16, speed=speed)
    assert report.slow_policies() == {
        "mixed_float16": "measured at most 0.004x of float32's speed in the probe on CPU:0"
    }
    assert PATHOLOGICAL_SPEED > 0.004
    text = report.format_text()
    assert "mixed_float16 at most 0.004x" in text and "(probe, 3.0 s)" in text


def test_doctor_text_is_the_reports_own():
    text = _report(
        XEON_NO_BF16, speed={"float32": 1.0, "mixed_float16": 0.56, "mixed_bfloat16": 0.35}
    ).format_text()
    lines = text.splitlines()
    assert lines[2] == "GPU: none"
    assert lines[3] == (
        "CPU: Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz (x86_64); native bfloat16 no, native float16 no"
    )
    assert lines[4] == "Expected from the hardware: no mixed policy faster than float32"
    assert "float32 1.00x, mixed_float16 0.56x, mixed_bfloat16 0.35x" in lines[5]
    assert lines[6] == "Recommended policy: float32"
    unmeasured = _report(UNKNOWN_CPU).format_text()
    assert "native bfloat16 unknown, native float16 unknown" in unmeasured
    assert "Measured: not measured (--no-probe)" in unmeasured


# ------------------------------------------------- the probe, for real
@pytest.fixture(scope="module")
def probe():
    return measure_policy_speed()


def test_probe_measures_every_policy_against_float32(probe):
    assert list(probe.ratios) == list(POLICIES)
    assert probe.ratios["float32"] == 1.0
    assert all(ratio > 0 for ratio in probe.ratios.values())
    assert probe.device in ("CPU:0", "GPU:0")
    assert set(probe.bounded) <= {"mixed_float16", "mixed_bfloat16"}


def test_probe_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy 'float64'"):
        measure_policy_speed(["float64"])


def test_recommend_policy_follows_the_measurement_of_this_machine(probe):
    measured = inspect_hardware()  # the process's one probe
    fast = [p for p, ratio in measured.speed.ratios.items() if p != "float32" and ratio >= 1.1]
    # The measured ratios decide: a policy is advised only where it was fast here.
    assert mp.recommend_policy() in (fast or ["float32"])
    if not fast:
        assert mp.recommend_policy() == "float32"
    # Without the probe: the rules alone, from this CPU's features.
    rules = inspect_hardware(measure=False)
    expected = "mixed_bfloat16" if rules.cpu.native_bfloat16 and not rules.gpus else rules.recommended_policy
    assert mp.recommend_policy(measure=False) == expected
