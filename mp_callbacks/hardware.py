"""The hardware advisor: which dtype policy can this machine speed up?

Mixed-precision guides ask users to check by hand that their GPU is Volta or newer,
that it has Tensor Cores, and which CUDA/cuDNN they run. `inspect_hardware`
does that (and looks at the CPU's bfloat16/float16 instructions, since
mixed precision pays on modern CPUs too) and `recommend_policy` turns it
into one answer.
"""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass, field
from typing import Any

from mp_callbacks._backend import keras, tf

__all__ = [
    "GPUInfo",
    "HardwareReport",
    "inspect_hardware",
    "recommend_policy",
    "POLICIES",
]

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")

# Slowdown of float16 matrix multiplies on a CPU without native float16,
# measured on this project's machines (emulated, per element).
CPU_FLOAT16_SLOWDOWN = 250

_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "avx512_fp16", "amx_fp16")


@dataclass
class GPUInfo:
    name: str
    compute_capability: tuple[int, int] | None

    @property
    def float16_tensor_cores(self) -> bool:
        """Volta (7.0) and newer have float16 Tensor Cores."""
        return self.compute_capability is not None and self.compute_capability >= (7, 0)

    @property
    def fast_bfloat16(self) -> bool:
        """Ampere (8.0) and newer run bfloat16 on Tensor Cores."""
        return self.compute_capability is not None and self.compute_capability >= (8, 0)

    def as_dict(self) -> dict[str, Any]:
        cc = self.compute_capability
        return {
            "name": self.name,
            "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
            "float16_tensor_cores": self.float16_tensor_cores,
            "fast_bfloat16": self.fast_bfloat16,
        }


@dataclass
class HardwareReport:
    tensorflow_version: str
    keras_version: str
    cuda_build: bool
    cuda_version: str | None
    cudnn_version: str | None
    gpus: list[GPUInfo]
    cpu_model: str
    cpu_flags: dict[str, bool]
    recommended_policy: str = "float32"
    reason: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def fast_policies(self) -> list[str]:
        """Mixed policies this hardware computes natively (can speed up)."""
        policies = []
        if self.gpus:
            if all(g.float16_tensor_cores for g in self.gpus):
                policies.append("mixed_float16")
            if all(g.fast_bfloat16 for g in self.gpus):
                policies.append("mixed_bfloat16")
            return policies
        if self.cpu_flags.get("avx512_fp16") or self.cpu_flags.get("amx_fp16"):
            policies.append("mixed_float16")
        if self.cpu_flags.get("amx_bf16") or self.cpu_flags.get("avx512_bf16"):
            policies.append("mixed_bfloat16")
        return policies

    @property
    def native_float16(self) -> bool:
        return "mixed_float16" in self.fast_policies

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["gpus"] = [g.as_dict() for g in self.gpus]
        data["fast_policies"] = self.fast_policies
        data["device"] = self.device_summary()
        return data

    def device_summary(self) -> str:
        if self.gpus:
            return ", ".join(
                f"{g.name} (compute capability {g.as_dict()['compute_capability']})"
                for g in self.gpus
            )
        flags = [name for name, present in self.cpu_flags.items() if present]
        return f"CPU {self.cpu_model}" + (f" [{', '.join(flags)}]" if flags else "")


def _read_cpu_info() -> tuple[str, dict[str, bool]]:
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine()):
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:  # not Linux: flags unknown, treated as absent
        pass
    return model, {name: name in flags for name in _CPU_FLAGS}


def _read_gpus() -> list[GPUInfo]:
    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(device)
        except (ValueError, RuntimeError):
            details = {}
        cc = details.get("compute_capability")
        gpus.append(
            GPUInfo(
                name=details.get("device_name", device.name),
                compute_capability=tuple(cc) if cc else None,
            )
        )
    return gpus


def _advise(report: HardwareReport) -> None:
    """Fills in the recommendation, its reason and the warnings."""
    if report.gpus:
        weakest = min(
            report.gpus, key=lambda g: g.compute_capability or (0, 0)
        )
        cc = weakest.as_dict()["compute_capability"]
        if weakest.fast_bfloat16:
            report.recommended_policy = "mixed_bfloat16"
            report.reason = (
                f"{weakest.name} (compute capability {cc}) runs bfloat16 on "
                "Tensor Cores as fast as float16, and bfloat16 has float32's "
                "range, so no loss scaling is needed."
            )
        elif weakest.float16_tensor_cores:
            report.recommended_policy = "mixed_float16"
            report.reason = (
                f"{weakest.name} (compute capability {cc}) has float16 Tensor "
                "Cores but no fast bfloat16; MixedPrecisionModel handles the "
                "loss scaling float16 needs."
            )
        else:
            report.recommended_policy = "float32"
            report.reason = (
                f"{weakest.name} (compute capability {cc or 'unknown'}) predates "
                "Volta (7.0): no Tensor Cores, so mixed precision saves memory "
                "but rarely time."
            )
            report.warnings.append(
                "mixed_float16 on a GPU without Tensor Cores is usually no faster "
                "than float32."
            )
        if not weakest.fast_bfloat16:
            report.warnings.append(
                f"mixed_bfloat16 on {weakest.name} (compute capability {cc or 'unknown'}) "
                "has no bfloat16 Tensor Cores and is slower than mixed_float16."
            )
        if weakest.float16_tensor_cores:
            report.warnings.append(
                "mixed_float16 needs loss scaling or small gradients underflow to "
                "zero: MixedPrecisionModel does it in fit(); hand-written loops "
                "need mp_callbacks.LossScaleOptimizer or DynamicLossScale."
            )
        if not report.cuda_build:
            report.warnings.append(
                "This TensorFlow build has no CUDA support; install "
                "mp_callbacks[gpu] (tensorflow[and-cuda])."
            )
        return

    flags = report.cpu_flags
    if flags.get("amx_bf16") or flags.get("avx512_bf16"):
        found = [n for n in ("amx_bf16", "avx512_bf16") if flags.get(n)]
        report.recommended_policy = "mixed_bfloat16"
        report.reason = (
            f"no GPU; this CPU has native bfloat16 ({', '.join(found)}), which "
            "oneDNN uses for matrix multiplies and convolutions."
        )
    else:
        report.recommended_policy = "float32"
        report.reason = (
            "no GPU and no native bfloat16 on this CPU: mixed precision would be "
            "emulated and slower than float32."
        )
    if not report.native_float16:
        report.warnings.append(
            "mixed_float16 on this CPU is emulated (no AVX512-FP16/AMX-FP16): "
            f"measured about {CPU_FLOAT16_SLOWDOWN}x slower than float32 here."
        )


def inspect_hardware() -> HardwareReport:
    """Versions, CUDA/cuDNN build, GPUs and CPU features, plus advice."""
    build = tf.sysconfig.get_build_info()
    model, flags = _read_cpu_info()
    report = HardwareReport(
        tensorflow_version=tf.__version__,
        keras_version=keras.__version__,
        cuda_build=bool(build.get("is_cuda_build", False)),
        cuda_version=build.get("cuda_version"),
        cudnn_version=build.get("cudnn_version"),
        gpus=_read_gpus(),
        cpu_model=model,
        cpu_flags=flags,
    )
    _advise(report)
    return report


def recommend_policy() -> str:
    """The dtype policy `mp-callbacks doctor` recommends for this machine:
    `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`."""
    return inspect_hardware().recommended_policy
