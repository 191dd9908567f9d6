"""The advisor's rules, on reports of other machines."""

from __future__ import annotations

import pytest

from mp_callbacks.hardware import GPUInfo, HardwareReport, _advise


def _report(gpus=(), **flags):
    cpu_flags = {"amx_bf16": False, "avx512_bf16": False, "avx512_fp16": False, "amx_fp16": False}
    cpu_flags.update(flags)
    report = HardwareReport("2.21.0", "3.15.1", bool(gpus), "12.5" if gpus else None, "9" if gpus else None,
                            list(gpus), "test cpu", cpu_flags)
    _advise(report)
    return report


@pytest.mark.parametrize(
    "capability, policy, fast",
    [((8, 0), "mixed_bfloat16", ["mixed_float16", "mixed_bfloat16"]),
     ((7, 5), "mixed_float16", ["mixed_float16"]),
     ((7, 0), "mixed_float16", ["mixed_float16"]),
     ((6, 1), "float32", [])],
)
def test_gpu_generations(capability, policy, fast):
    report = _report([GPUInfo("gpu", capability)])
    assert report.recommended_policy == policy
    assert report.fast_policies == fast
    assert report.reason


def test_mixed_gpus_follow_the_weakest():
    report = _report([GPUInfo("a100", (8, 0)), GPUInfo("t4", (7, 5))])
    assert report.recommended_policy == "mixed_float16"
    assert "t4" in report.reason


def test_old_gpu_warns_that_float16_will_not_be_faster():
    report = _report([GPUInfo("p100", (6, 0))])
    assert any("Tensor Cores" in w for w in report.warnings)


@pytest.mark.parametrize(
    "flags, policy, fast",
    [(dict(amx_bf16=True), "mixed_bfloat16", ["mixed_bfloat16"]),
     (dict(avx512_bf16=True), "mixed_bfloat16", ["mixed_bfloat16"]),
     (dict(), "float32", []),
     (dict(avx512_fp16=True, amx_bf16=True), "mixed_bfloat16", ["mixed_float16", "mixed_bfloat16"])],
)
def test_cpu_features(flags, policy, fast):
    report = _report(**flags)
    assert report.recommended_policy == policy
    assert report.fast_policies == fast
    emulated_warning = any("emulated" in w for w in report.warnings)
    assert emulated_warning is ("mixed_float16" not in fast)


def test_float16_gpus_are_reminded_of_loss_scaling_and_bfloat16_speed():
    report = _report([GPUInfo("t4", (7, 5))])
    assert any("loss scaling" in w for w in report.warnings)
    assert any("mixed_bfloat16" in w and "slower" in w for w in report.warnings)
    assert not any("mixed_bfloat16" in w for w in _report([GPUInfo("a100", (8, 0))]).warnings)
