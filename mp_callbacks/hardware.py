"""The hardware advisor: which dtype policy can this machine speed up?

Mixed-precision guides ask users to check by hand that their GPU is Volta
or newer, which CUDA/cuDNN they run, and (on CPUs) whether the CPU has
bfloat16 instructions. Those rules say what the silicon can do, not what
TensorFlow's kernels make of it on this machine: the same `mixed_bfloat16`
has trained 2.5x faster than float32 on one CPU and 3x slower on another.
So the advisor measures: `measure_policy_speed` runs a short probe (matrix
multiply and convolution, forward and backward) in each policy's compute
dtype on the device the running Keras backend will use (TensorFlow's here,
JAX's in `backends/jax/platform.py`, torch's in `backends/torch/platform.py`), and `inspect_hardware` checks the
rules against that measurement. `recommend_policy` gives the one answer.

Everything the advice rests on (CPU features, GPUs, the measurement) can be
passed in, so the advice for any machine can be tested on any other.
"""

from __future__ import annotations

import functools
import importlib
import platform
import re
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mp_callbacks._backend import BACKEND, keras, tf
from mp_callbacks._cpu_features import CpuInfo, read_cpu_info

__all__ = [
    "MIN_SPEEDUP",
    "PATHOLOGICAL_SPEED",
    "POLICIES",
    "GPUInfo",
    "HardwareReport",
    "PolicySpeed",
    "inspect_hardware",
    "measure_policy_speed",
    "recommend_policy",
]

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
MIXED_POLICIES = POLICIES[1:]
_COMPUTE_DTYPE = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
_FRAMEWORK = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}
_KERNELS_USING_AMX = {
    "tensorflow": "TensorFlow's oneDNN kernels",
    "jax": "XLA's CPU kernels can",
    "torch": "PyTorch's oneDNN kernels can",
}
_NO_CUDA = {
    "tensorflow": "This TensorFlow build has no CUDA support; install mp_callbacks[gpu] (tensorflow[and-cuda]).",
    "jax": 'This jaxlib has no CUDA plugin; install jax with CUDA (pip install "jax[cuda12]").',
    "torch": "This torch build has no CUDA support; install a CUDA build of torch (pytorch.org lists them).",
}

# A mixed policy is recommended only when the probe finds it at least this
# much faster than float32: below that, the gain does not pay for the care
# mixed precision needs (and is within the probe's noise).
MIN_SPEEDUP = 1.1
# Below this speed (4x slower than float32) a policy is emulated in software
# on this device; `mp-callbacks bench` does not run it unless forced.
PATHOLOGICAL_SPEED = 0.25


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

    @property
    def float8_units(self) -> bool:
        """Ada (8.9), Hopper (9.0) and newer have float8 Tensor Cores."""
        return self.compute_capability is not None and self.compute_capability >= (8, 9)

    def as_dict(self) -> dict[str, Any]:
        cc = self.compute_capability
        return {
            "name": self.name,
            "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
            "float16_tensor_cores": self.float16_tensor_cores,
            "fast_bfloat16": self.fast_bfloat16,
            "float8_units": self.float8_units,
        }


@dataclass
class PolicySpeed:
    """What the probe measured.

    Attributes:
        ratios: policy -> its speed relative to float32 (float32's time
            divided by the policy's; 2.0 is twice as fast, 0.5 half).
        seconds: how long the probe took.
        device: where it ran ("CPU:0", "GPU:0").
        bounded: policies so slow that one call was all the probe timed;
            their ratio is an upper bound.
    """

    ratios: dict[str, float]
    seconds: float = 0.0
    device: str = ""
    bounded: list[str] = field(default_factory=list)


@dataclass
class HardwareReport:
    """Versions, devices, the probe's measurement and the advice.

    `expected_fast_policies` is what the rules expect from the hardware
    (GPU compute capability, CPU features); `fast_policies` is what this
    machine actually speeds up: the measured ones when there is a
    measurement, else the expected ones.
    """

    tensorflow_version: str | None
    keras_version: str
    cuda_build: bool
    cuda_version: str | None
    cudnn_version: str | None
    gpus: list[GPUInfo]
    cpu: CpuInfo
    speed: PolicySpeed | None = None
    recommended_policy: str = "float32"
    reason: str = ""
    warnings: list[str] = field(default_factory=list)
    #: the Keras backend the probe ran on, and its version
    backend: str = "tensorflow"
    backend_version: str = ""

    @property
    def measured(self) -> dict[str, float] | None:
        return None if self.speed is None else self.speed.ratios

    @property
    def float8_units(self) -> bool:
        """Every GPU has float8 Tensor Cores (a CPU has none)."""
        return bool(self.gpus) and all(g.float8_units for g in self.gpus)

    @property
    def expected_fast_policies(self) -> list[str]:
        """Mixed policies the hardware rules say it computes natively."""
        policies = []
        if self.gpus:
            if all(g.float16_tensor_cores for g in self.gpus):
                policies.append("mixed_float16")
            if all(g.fast_bfloat16 for g in self.gpus):
                policies.append("mixed_bfloat16")
            return policies
        if self.cpu.native_float16:
            policies.append("mixed_float16")
        if self.cpu.native_bfloat16:
            policies.append("mixed_bfloat16")
        return policies

    @property
    def fast_policies(self) -> list[str]:
        """Mixed policies that speed this machine up: measured at least
        `MIN_SPEEDUP` times float32's speed, or expected by the rules when
        nothing was measured."""
        if self.measured is None:
            return self.expected_fast_policies
        return [p for p in MIXED_POLICIES if self.measured.get(p, 0.0) >= MIN_SPEEDUP]

    def slow_policies(self) -> dict[str, str]:
        """Policies the probe found pathologically slow, with the reason."""
        if self.measured is None or self.speed is None:
            return {}
        device = self.speed.device or "this device"
        return {
            policy: (
                f"measured {_ratio_text(ratio, self.speed, policy)} of float32's speed "
                f"in the probe on {device}"
            )
            for policy, ratio in self.measured.items()
            if policy != "float32" and ratio < PATHOLOGICAL_SPEED
        }

    def device_summary(self) -> str:
        if self.gpus:
            return ", ".join(
                f"{g.name} (compute capability {g.as_dict()['compute_capability']})" for g in self.gpus
            )
        features = sorted(self.cpu.features)
        return f"CPU {self.cpu.model}" + (f" [{', '.join(features)}]" if features else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "tensorflow_version": self.tensorflow_version,
            "keras_version": self.keras_version,
            "backend": self.backend,
            "backend_version": self.backend_version,
            "cuda_build": self.cuda_build,
            "cuda_version": self.cuda_version,
            "cudnn_version": self.cudnn_version,
            "gpus": [g.as_dict() for g in self.gpus],
            "cpu": self.cpu.as_dict(),
            "device": self.device_summary(),
            "expected_fast_policies": self.expected_fast_policies,
            "fast_policies": self.fast_policies,
            "measured": None if self.speed is None else dict(self.speed.ratios),
            "probe": None
            if self.speed is None
            else {
                "seconds": round(self.speed.seconds, 2),
                "device": self.speed.device,
                "upper_bounds": list(self.speed.bounded),
            },
            "recommended_policy": self.recommended_policy,
            "reason": self.reason,
            "warnings": list(self.warnings),
        }

    def format_text(self) -> str:
        """The report as `mp-callbacks doctor` prints it."""
        yes = {True: "yes", False: "no", None: "unknown"}
        lines = [f"{_FRAMEWORK[self.backend]} {self.backend_version}, Keras {self.keras_version}"]
        cuda = f" (CUDA {self.cuda_version}, cuDNN {self.cudnn_version})" if self.cuda_build else ""
        lines.append(f"CUDA build: {yes[self.cuda_build]}{cuda}")
        for gpu in self.gpus:
            info = gpu.as_dict()
            lines.append(
                f"GPU: {info['name']}, compute capability {info['compute_capability']}: "
                f"float16 Tensor Cores {yes[gpu.float16_tensor_cores]}, "
                f"fast bfloat16 {yes[gpu.fast_bfloat16]}"
            )
        if not self.gpus:
            lines.append("GPU: none")
        cpu = self.cpu
        lines.append(
            f"CPU: {cpu.model} ({cpu.architecture}); native bfloat16 {yes[cpu.native_bfloat16]}, "
            f"native float16 {yes[cpu.native_float16]}"
            + (f" [{', '.join(sorted(cpu.features))}]" if cpu.features else "")
        )
        note = _amx_note(cpu)
        if note:
            lines.append(note)
        lines.append(
            "Expected from the hardware: "
            + (", ".join(self.expected_fast_policies) or "no mixed policy faster than float32")
        )
        if self.speed is None:
            lines.append("Measured: not measured (--no-probe)")
        else:
            measured = ", ".join(
                f"{policy} {_ratio_text(ratio, self.speed, policy)}"
                for policy, ratio in self.speed.ratios.items()
            )
            lines.append(
                f"Measured speed vs float32 on {self.speed.device} "
                f"(probe, {self.speed.seconds:.1f} s): {measured}"
            )
        lines.append(f"Recommended policy: {self.recommended_policy}")
        lines.append(f"  why: {self.reason}")
        lines += [f"warning: {warning}" for warning in self.warnings]
        return "\n".join(lines)


def _ratio_text(ratio: float, speed: PolicySpeed | None, policy: str) -> str:
    bound = "at most " if speed is not None and policy in speed.bounded else ""
    return f"{bound}{ratio:.3f}x" if ratio < 0.1 else f"{bound}{ratio:.2f}x"


# ------------------------------------------------------------------ probe
def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def measure_policy_speed(
    policies: Iterable[str] = POLICIES, rounds: int = 7, calls_per_round: int = 2
) -> PolicySpeed:
    """Measures each policy's compute speed relative to float32 on the
    device TensorFlow uses by default, in about a second (more where a
    dtype is emulated).

    The dtypes take turns, round after round, and each policy's median
    round counts, so that a slow spell of a shared machine hits all alike.
    A dtype whose first call is both over half a second and 20 times
    float32's is timed no further: its ratio is then an upper bound.
    """
    policies = list(dict.fromkeys(["float32", *policies]))
    for policy in policies:
        if policy not in _COMPUTE_DTYPE:
            raise ValueError(f"policies: unknown policy {policy!r}; choose from {POLICIES}")
    start = time.perf_counter()
    steps = {policy: _platform().probe_step(_COMPUTE_DTYPE[policy]) for policy in policies}
    first_call = {policy: _timed(steps[policy]) for policy in policies}
    bounded = [p for p in policies if p != "float32" and first_call[p] > max(0.5, 20 * first_call["float32"])]
    timed = [p for p in policies if p not in bounded]
    round_times: dict[str, list[float]] = {p: [] for p in timed}
    for round_index in range(rounds):
        order = timed if round_index % 2 == 0 else timed[::-1]
        for policy in order:
            round_times[policy].append(
                sum(_timed(steps[policy]) for _ in range(calls_per_round)) / calls_per_round
            )
    float32_time = statistics.median(round_times["float32"])
    ratios = {}
    for policy in policies:
        seconds = first_call[policy] if policy in bounded else statistics.median(round_times[policy])
        ratios[policy] = round(float32_time / seconds, 3)
    device = _platform().default_device()
    return PolicySpeed(ratios, time.perf_counter() - start, device, bounded)


@functools.lru_cache(maxsize=1)
def _measured_once() -> PolicySpeed:
    return measure_policy_speed()


# ----------------------------------------------------------------- advice
def _gpu_rules_reason(report: HardwareReport) -> tuple[str, str]:
    weakest = min(report.gpus, key=lambda g: g.compute_capability or (0, 0))
    cc = weakest.as_dict()["compute_capability"] or "unknown"
    if weakest.fast_bfloat16:
        return "mixed_bfloat16", (
            f"{weakest.name} (compute capability {cc}) runs bfloat16 on Tensor Cores as fast "
            "as float16, and bfloat16 has float32's range, so no loss scaling is needed."
        )
    if weakest.float16_tensor_cores:
        return "mixed_float16", (
            f"{weakest.name} (compute capability {cc}) has float16 Tensor Cores but no fast "
            "bfloat16; MixedPrecisionModel handles the loss scaling float16 needs."
        )
    return "float32", (
        f"{weakest.name} (compute capability {cc}) predates Volta (7.0): no Tensor Cores, "
        "so mixed precision saves memory but rarely time."
    )


def _amx_note(cpu: Any, release: str | None = None) -> str | None:
    """What the CPU line needs said about Intel AMX: AMX-BF16 by name, and
    that Linux below 5.16 does not enable AMX (its CPUs then show none)."""
    if "amx_bf16" in cpu.features:
        return f"AMX-BF16: yes (Intel AMX tiles; {_KERNELS_USING_AMX[BACKEND]} use them for bfloat16)"
    if cpu.architecture not in ("x86_64", "AMD64") or platform.system() != "Linux":
        return None
    release = platform.release() if release is None else release
    numbers = re.match(r"(\d+)\.(\d+)", release)
    if numbers and (int(numbers.group(1)), int(numbers.group(2))) < (5, 16):
        return (
            f"AMX: not visible: Linux {numbers.group(0)} is below 5.16, which is needed to enable "
            "Intel AMX; an AMX CPU computes bfloat16 far faster on a newer kernel."
        )
    return None


def _cpu_rules_reason(report: HardwareReport) -> tuple[str, str]:
    cpu = report.cpu
    if not cpu.known:
        return "float32", (
            "no GPU, and this platform does not tell the CPU's features: without a "
            "measurement, float32 is the safe choice."
        )
    bfloat16 = sorted(f for f in cpu.features if "bf16" in f.lower())
    if cpu.native_bfloat16:
        return "mixed_bfloat16", (
            f"no GPU; this CPU has native bfloat16 ({', '.join(bfloat16)}), which "
            f"{_FRAMEWORK[BACKEND]}'s CPU kernels can use for matrix multiplies and convolutions."
        )
    return "float32", "no GPU and no native bfloat16 on this CPU: mixed precision would be emulated."


def _advise(report: HardwareReport) -> None:
    """Fills in the recommendation, its reason and the warnings: the rules
    alone when nothing was measured, else the rules checked against the
    measurement (the measurement wins)."""
    rules_policy, rules_reason = _gpu_rules_reason(report) if report.gpus else _cpu_rules_reason(report)
    report.warnings = []
    measured = report.measured
    if measured is None:
        report.recommended_policy = rules_policy
        report.reason = rules_reason + " (Expected from the hardware, not measured.)"
    else:
        _advise_from_measurement(report, rules_policy)
    _add_warnings(report)


def _advise_from_measurement(report: HardwareReport, rules_policy: str) -> None:
    measured = report.measured
    assert measured is not None  # called with a measurement only
    speed = report.speed
    fast = report.fast_policies
    expected = report.expected_fast_policies
    measured_text = ", ".join(
        f"{p} {_ratio_text(measured[p], speed, p)}" for p in MIXED_POLICIES if p in measured
    )
    if not fast:
        report.recommended_policy = "float32"
        report.reason = (
            f"no mixed policy was at least {MIN_SPEEDUP:g}x faster than float32 in the probe "
            f"({measured_text})."
        )
        if expected:
            report.reason += (
                f" The hardware suggests {' and '.join(expected)}, but it did not run faster here."
            )
        return
    best = max(fast, key=lambda p: measured[p])
    # On GPUs with fast bfloat16, prefer it over a float16 that is only a
    # little faster: bfloat16 needs no loss scaling.
    if (
        best == "mixed_float16"
        and "mixed_bfloat16" in fast
        and measured["mixed_bfloat16"] >= 0.9 * measured["mixed_float16"]
    ):
        best = "mixed_bfloat16"
    report.recommended_policy = best
    report.reason = f"{best} ran at {measured[best]:.2f}x float32's speed in the probe ({measured_text})."
    if best in expected:
        report.reason += (
            " As the hardware suggests: "
            + (_gpu_rules_reason(report) if report.gpus else _cpu_rules_reason(report))[1]
        )
    elif report.cpu.known or report.gpus:
        report.reason += " The hardware rules did not predict this; the measurement decides."


def _add_warnings(report: HardwareReport) -> None:
    measured = report.measured
    if measured is not None:
        for policy in MIXED_POLICIES:
            ratio = measured.get(policy)
            if ratio is not None and ratio < 1 / MIN_SPEEDUP:
                report.warnings.append(
                    f"{policy} is slower than float32 here: measured "
                    f"{_ratio_text(ratio, report.speed, policy)} of its speed."
                )
    if not report.gpus and not report.cpu.known:
        report.warnings.append(
            "this platform does not tell the CPU's features; the advice rests on the measurement."
        )
    if report.gpus:
        weakest = min(report.gpus, key=lambda g: g.compute_capability or (0, 0))
        cc = weakest.as_dict()["compute_capability"] or "unknown"
        if not weakest.float16_tensor_cores:
            report.warnings.append(
                "mixed_float16 on a GPU without Tensor Cores is usually no faster than float32."
            )
        if not weakest.fast_bfloat16 and measured is None:
            report.warnings.append(
                f"mixed_bfloat16 on {weakest.name} (compute capability {cc}) has no bfloat16 "
                "Tensor Cores and is slower than mixed_float16."
            )
        if weakest.float16_tensor_cores:
            report.warnings.append(
                "mixed_float16 needs loss scaling or small gradients underflow to zero: "
                "MixedPrecisionModel does it in fit(); hand-written loops need "
                "mp_callbacks.LossScaleOptimizer or LossScaler."
            )
        if not report.cuda_build:
            report.warnings.append(_NO_CUDA[report.backend])


# ---------------------------------------------------------------- entries
def _platform() -> Any:
    """The backend's answers to what the advisor asks (`backends/<backend>/platform.py`)."""
    return importlib.import_module(f"mp_callbacks.backends.{BACKEND}.platform")


def _read_gpus() -> list[GPUInfo]:
    return [GPUInfo(name, capability) for name, capability in _platform().gpus()]


def inspect_hardware(
    measure: bool = True,
    *,
    cpu: CpuInfo | None = None,
    gpus: list[GPUInfo] | None = None,
    speed: PolicySpeed | Mapping[str, float] | None = None,
) -> HardwareReport:
    """Versions, CUDA/cuDNN build, GPUs, CPU features and the probe's
    measurement, with advice.

    Args:
        measure: bool. Run the probe (once per process; about a second
            plus the backend's start, and on JAX a few seconds compiling it). False gives the hardware rules'
            advice alone. Defaults to `True`.
        cpu: `CpuInfo` or None. Describe another machine's CPU instead of
            this one's. Defaults to None.
        gpus: list of `GPUInfo` or None. Describe another machine's GPUs.
            Defaults to None.
        speed: `PolicySpeed`, mapping or None. A measurement to use
            instead of probing (policy -> speed relative to float32).
            Defaults to None.
    """
    build = _platform().build_info()
    if speed is not None and not isinstance(speed, PolicySpeed):
        speed = PolicySpeed(dict(speed), device="given")
    if speed is None and measure:
        speed = _measured_once()
    report = HardwareReport(
        tensorflow_version=tf.__version__ if tf is not None else None,
        keras_version=keras.__version__,
        cuda_build=bool(build.get("is_cuda_build", False)),
        cuda_version=build.get("cuda_version"),
        cudnn_version=build.get("cudnn_version"),
        gpus=_read_gpus() if gpus is None else list(gpus),
        cpu=read_cpu_info() if cpu is None else cpu,
        speed=speed,
        backend=BACKEND,
        backend_version=_platform().version(),
    )
    _advise(report)
    return report


def recommend_policy(measure: bool = True) -> str:
    """The dtype policy `mp-callbacks doctor` recommends for this machine:
    `"mixed_float16"`, `"mixed_bfloat16"` or `"float32"`.

    The first call with `measure=True` runs the probe (about a second); the
    measurement is kept for the rest of the process. `measure=False` applies
    the hardware rules alone, at no cost.

    Args:
        measure: bool. Measure each policy's speed on this machine.
            Defaults to `True`.

    Returns:
        The policy name, for `keras.mixed_precision.set_global_policy`.
    """
    return inspect_hardware(measure=measure).recommended_policy
