"""What the hardware advisor asks of the backend, on JAX: the probe's unit
of work, the default device, the GPUs and the build.
`backends/tensorflow/platform.py` holds TensorFlow's answers; the advice
itself (`hardware.py`) is the same for both."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["build_info", "default_device", "gpus", "probe_step", "version"]


def version() -> str:
    return jax.__version__


def probe_step(compute_dtype: str, seed: int = 0) -> Callable[[], float]:
    """TensorFlow's probe, in JAX: a 512x512 matrix multiply and a 3x3
    convolution (16x32x32x32), forward and backward. Every array is an
    argument (a captured one is a constant XLA would fold away), and the
    backward pass takes random upstream gradients (ones would let XLA turn
    the multiply into a sum). Compiled ahead, so that the first call is
    timed running, not compiling."""
    keys = jax.random.split(jax.random.key(seed), 6)
    shapes = [(512, 512), (512, 512), (16, 32, 32, 32), (3, 3, 32, 32), (512, 512), (16, 32, 32, 32)]
    arrays = [(jax.random.normal(key, shape) * 0.1).astype(compute_dtype) for key, shape in zip(keys, shapes)]

    def work(a: Any, b: Any, images: Any, kernel: Any, up_product: Any, up_map: Any) -> Any:
        def forward(b: Any, kernel: Any) -> Any:
            feature_map = jax.lax.conv_general_dilated(
                images, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            return a @ b, feature_map

        outputs, pullback = jax.vjp(forward, b, kernel)
        return outputs, pullback((up_product, up_map))

    compiled = jax.jit(work).lower(*arrays).compile()

    def step() -> float:
        _, (grad_b, grad_kernel) = compiled(*arrays)
        return float(grad_b[0, 0]) + float(grad_kernel[0, 0, 0, 0])  # a read waits for the device

    step.compiled = compiled  # type: ignore[attr-defined]  # what XLA runs, for the tests to read
    return step


def default_device() -> str:
    device = jax.devices()[0]
    return f"{device.platform.upper()}:{device.id}"


def gpus() -> list[tuple[str, tuple[int, ...] | None]]:
    """(name, compute capability) of each GPU JAX sees."""
    found = []
    for device in jax.devices():
        if device.platform != "gpu":
            continue
        capability = getattr(device, "compute_capability", None)
        numbers = tuple(int(part) for part in str(capability).split(".")) if capability else None
        found.append((str(device.device_kind), numbers))
    return found


def build_info() -> dict[str, Any]:
    """Whether this jaxlib can run on CUDA (its plugin is installed)."""
    cuda = any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return {"is_cuda_build": cuda, "cuda_version": None, "cudnn_version": None}
