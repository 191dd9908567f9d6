"""CPU feature detection on each platform, from recorded inputs."""

from __future__ import annotations

import pathlib

import pytest

from mp_callbacks._cpu_features import (
    CpuInfo,
    parse_proc_cpuinfo,
    parse_sysctl,
    read_cpu_info,
)

RECORDED = pathlib.Path(__file__).parent / "data" / "cpuinfo"


def _recorded(name: str) -> str:
    return (RECORDED / name).read_text()


@pytest.mark.parametrize(
    "name, architecture, model, features, bfloat16, float16",
    [
        ("linux-x86_64-amd-epyc-avx512-bf16.txt", "x86_64", "AMD EPYC", {"avx512_bf16"}, True, False),
        (
            "linux-x86_64-xeon-8259cl-no-bf16.txt",
            "x86_64",
            "Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz",
            set(),
            False,
            False,
        ),
        # AVX512-FP16 is float16 arithmetic TensorFlow's training does not
        # use (float16 trained at 0.007x of float32 there): not native.
        (
            "linux-x86_64-xeon-amx-bf16-avx512-fp16.txt",
            "x86_64",
            "Intel(R) Xeon(R) Processor",
            {"amx_bf16", "avx512_bf16", "avx512_fp16"},
            True,
            False,
        ),
        (
            "linux-aarch64-graviton3.txt",
            "aarch64",
            "Arm Neoverse V1 (e.g. AWS Graviton3)",
            {"bf16", "asimdhp"},
            True,
            True,
        ),
        (
            "linux-aarch64-graviton2.txt",
            "aarch64",
            "Arm Neoverse N1 (e.g. AWS Graviton2)",
            {"asimdhp"},
            False,
            True,
        ),
    ],
)
def test_linux_proc_cpuinfo(name, architecture, model, features, bfloat16, float16):
    info = parse_proc_cpuinfo(_recorded(name), architecture)
    assert info == CpuInfo(model, architecture, frozenset(features), "/proc/cpuinfo")
    assert info.native_bfloat16 is bfloat16 and info.native_float16 is float16


def test_only_the_first_processor_is_read():
    # A second block with other flags (it never happens on one machine)
    # must not change the answer: parsing stops at the first blank line.
    text = "model name\t: first\nflags\t\t: sse avx512_bf16\n\nmodel name\t: second\nflags\t\t: sse\n"
    info = parse_proc_cpuinfo(text, "x86_64")
    assert info.model == "first" and info.features == {"avx512_bf16"}


def test_an_unknown_arm_part_is_named_by_its_numbers():
    info = parse_proc_cpuinfo("CPU implementer\t: 0x61\nCPU part\t: 0x999\nFeatures\t: fp bf16\n", "aarch64")
    assert info.model == "Arm CPU (implementer 0x61, part 0x999)"
    assert info.native_bfloat16 is True


@pytest.mark.parametrize(
    "name, model, bfloat16, float16",
    [
        ("macos-arm64-apple-m2.txt", "Apple M2", True, True),
        ("macos-arm64-apple-m1.txt", "Apple M1", False, True),
    ],
)
def test_macos_sysctl(name, model, bfloat16, float16):
    info = parse_sysctl(_recorded(name), "arm64")
    assert (info.model, info.source) == (model, "sysctl")
    assert info.native_bfloat16 is bfloat16 and info.native_float16 is float16
    assert info.features <= {"FEAT_BF16", "FEAT_FP16"}  # FEAT_I8MM etc. are not relevant


def test_intel_mac_features_take_linux_spelling():
    text = (
        "machdep.cpu.brand_string: Intel(R) Xeon(R) W-3245 CPU @ 3.20GHz\n"
        "machdep.cpu.leaf7_features: RDWRFSGS TSC_THREAD_OFFSET SGX BMI1 AVX2 AVX512F "
        "AVX512BF16 AVX512VNNI\n"
    )
    info = parse_sysctl(text, "x86_64")
    assert info.features == {"avx512_bf16"} and info.native_bfloat16 is True


def test_read_cpu_info_picks_the_platform_reader():
    linux = read_cpu_info(
        "Linux",
        "aarch64",
        read_file=lambda path: _recorded("linux-aarch64-graviton3.txt"),
        run_sysctl=lambda: pytest.fail("sysctl is not read on Linux"),
    )
    assert linux.native_bfloat16 is True and linux.source == "/proc/cpuinfo"
    mac = read_cpu_info(
        "Darwin",
        "arm64",
        read_file=lambda path: pytest.fail("no file on macOS"),
        run_sysctl=lambda: _recorded("macos-arm64-apple-m2.txt"),
    )
    assert mac.model == "Apple M2" and mac.native_bfloat16 is True


@pytest.mark.parametrize("system", ["Windows", "Linux", "Darwin", "FreeBSD"])
def test_unreadable_features_are_unknown_not_absent(system):
    info = read_cpu_info(system, "AMD64", read_file=lambda path: None, run_sysctl=lambda: None)
    assert not info.known and info.features == frozenset()
    assert info.native_bfloat16 is None and info.native_float16 is None
    assert info.as_dict()["native_bfloat16"] is None


def test_this_machine_is_read():
    info = read_cpu_info()
    assert info.model and info.architecture


def test_amx_is_named_and_an_old_linux_kernel_is_called_out():
    from mp_callbacks.hardware import _amx_note

    amx = parse_proc_cpuinfo(_recorded("linux-x86_64-xeon-amx-bf16-avx512-fp16.txt"), "x86_64")
    assert "AMX-BF16: yes" in _amx_note(amx)
    no_amx = CpuInfo("Intel(R) Xeon(R) Platinum 8480+", "x86_64", frozenset({"avx512_bf16"}), "/proc/cpuinfo")
    if __import__("platform").system() == "Linux":
        assert "below 5.16" in _amx_note(no_amx, release="5.15.0-91-generic")
        assert _amx_note(no_amx, release="6.8.0") is None
