"""Which low-precision arithmetic the CPU has, on Linux (x86_64 and
aarch64) and macOS; unknown elsewhere.

The answer is a hint for the hardware advisor, never the last word: the
advisor measures (see `mp_callbacks.hardware.measure_policy_speed`), because
a CPU flag says what the silicon can do, not whether TensorFlow's kernels
use it. Parsing is separate from reading so that each platform's format is
tested with recorded inputs.
"""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CpuInfo", "parse_proc_cpuinfo", "parse_sysctl", "read_cpu_info"]

# Feature names as each platform spells them.
_BFLOAT16 = {
    "amx_bf16",  # x86: Intel AMX (Sapphire Rapids and newer)
    "avx512_bf16",  # x86: Cooper Lake, AMD Zen 4 and newer
    "bf16",  # aarch64 Linux: Arm v8.6 BF16 (Graviton 3 and 4)
    "FEAT_BF16",  # macOS on Apple silicon (M2 and newer)
}
_FLOAT16 = {
    # x86: Granite Rapids. AVX512-FP16 (Sapphire Rapids) is float16
    # arithmetic that TensorFlow's training kernels do not use: float16
    # training measured 0.007x of float32 on such a CPU (2026-12, Intel Xeon
    # with AMX-BF16 and AVX512-FP16), so it is shown but is not native.
    "amx_fp16",
    "asimdhp",  # aarch64 Linux: half-precision SIMD arithmetic
    "FEAT_FP16",  # macOS on Apple silicon
}
RELEVANT_FEATURES = frozenset(_BFLOAT16 | _FLOAT16 | {"avx512_fp16"})

# aarch64 /proc/cpuinfo has no model name, only these part numbers.
_ARM_PARTS = {
    ("0x41", "0xd0c"): "Arm Neoverse N1 (e.g. AWS Graviton2)",
    ("0x41", "0xd40"): "Arm Neoverse V1 (e.g. AWS Graviton3)",
    ("0x41", "0xd4f"): "Arm Neoverse V2 (e.g. AWS Graviton4)",
    ("0x41", "0xd49"): "Arm Neoverse N2",
}


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as far as the operating system tells.

    Attributes:
        model: a readable name ("AMD EPYC", "Apple M2", ...).
        architecture: `platform.machine()`: "x86_64", "aarch64", "arm64", ...
        features: the relevant features found (see `RELEVANT_FEATURES`).
        source: where they came from ("/proc/cpuinfo", "sysctl"), or "" when
            this platform's features could not be read: then
            `native_bfloat16` and `native_float16` are None (unknown).
    """

    model: str
    architecture: str
    features: frozenset[str] = frozenset()
    source: str = ""

    @property
    def known(self) -> bool:
        return bool(self.source)

    @property
    def native_bfloat16(self) -> bool | None:
        return bool(self.features & _BFLOAT16) if self.known else None

    @property
    def native_float16(self) -> bool | None:
        return bool(self.features & _FLOAT16) if self.known else None

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "architecture": self.architecture,
            "features": sorted(self.features),
            "source": self.source or None,
            "native_bfloat16": self.native_bfloat16,
            "native_float16": self.native_float16,
        }


def parse_proc_cpuinfo(text: str, architecture: str) -> CpuInfo:
    """Linux `/proc/cpuinfo`: x86's `model name` and `flags`, or
    aarch64's `Features` and `CPU implementer`/`CPU part`. Only the first
    processor is read (all cores of a machine have the same features)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # end of the first processor's block
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    words = set((fields.get("flags") or fields.get("Features") or "").split())
    model = fields.get("model name") or _ARM_PARTS.get(
        (fields.get("CPU implementer", ""), fields.get("CPU part", "")), ""
    )
    if not model and "CPU part" in fields:
        model = f"Arm CPU (implementer {fields.get('CPU implementer')}, part {fields['CPU part']})"
    return CpuInfo(model or architecture, architecture, frozenset(words & RELEVANT_FEATURES), "/proc/cpuinfo")


def parse_sysctl(text: str, architecture: str) -> CpuInfo:
    """macOS `sysctl -a` (or just `machdep.cpu` and `hw.optional`): the
    brand string and `hw.optional.arm.FEAT_*: 1` lines. Intel Macs list
    their x86 features in `machdep.cpu.leaf7_features`."""
    model = architecture
    features: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "machdep.cpu.brand_string":
            model = value
        elif key.startswith("hw.optional.arm.") and value == "1":
            features.add(key.rsplit(".", 1)[1])
        elif key in ("machdep.cpu.features", "machdep.cpu.leaf7_features"):
            # "AVX512F AVX512BF16 ..." -> Linux's spelling, "avx512_bf16"
            for word in value.lower().split():
                features.add(word.replace("avx512bf16", "avx512_bf16").replace("avx512fp16", "avx512_fp16"))
    return CpuInfo(model, architecture, frozenset(features & RELEVANT_FEATURES), "sysctl")


def _read_text_file(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _run_sysctl() -> str | None:
    try:
        completed = subprocess.run(
            ["sysctl", "machdep.cpu", "hw.optional"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout if completed.returncode == 0 or completed.stdout else None


def read_cpu_info(
    system: str | None = None,
    architecture: str | None = None,
    read_file: Callable[[str], str | None] = _read_text_file,
    run_sysctl: Callable[[], str | None] = _run_sysctl,
) -> CpuInfo:
    """This machine's `CpuInfo`. The arguments exist for tests: a recorded
    `/proc/cpuinfo` or `sysctl` output can stand in for the machine's."""
    system = system or platform.system()
    architecture = architecture or platform.machine() or "unknown"
    if system == "Linux":
        text = read_file("/proc/cpuinfo")
        if text:
            return parse_proc_cpuinfo(text, architecture)
    elif system == "Darwin":
        text = run_sysctl()
        if text:
            return parse_sysctl(text, architecture)
    # Windows and anything unreadable: the measurement decides alone.
    return CpuInfo(platform.processor() or architecture, architecture)
