"""What the hardware advisor asks of the backend, on TensorFlow: the probe's
unit of work, the default device, the GPUs and the build. JAX's answers:
`backends/jax/platform.py`; the advice itself (`hardware.py`) is the same
for both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

__all__ = ["build_info", "default_device", "gpus", "probe_step", "version"]


def version() -> str:
    return str(tf.__version__)


def probe_step(compute_dtype: str, seed: int = 0) -> Callable[[], float]:
    """One training-like unit of work in `compute_dtype`: a 512x512 matrix
    multiply and a 3x3 convolution (16x32x32x32), each forward and backward.
    Small enough that an emulated dtype costs seconds, not minutes."""
    generator = tf.random.Generator.from_seed(seed)
    a = tf.cast(generator.normal((512, 512)), compute_dtype)
    b = tf.cast(generator.normal((512, 512)), compute_dtype)
    images = tf.cast(generator.normal((16, 32, 32, 32)), compute_dtype)
    kernel = tf.cast(generator.normal((3, 3, 32, 32)) * 0.1, compute_dtype)

    def step() -> float:
        with tf.GradientTape() as tape:
            tape.watch([b, kernel])
            product = tf.matmul(a, b)
            feature_map = tf.nn.conv2d(images, kernel, 1, "SAME")
        gradients = tape.gradient([product, feature_map], [b, kernel])
        # Reading one value waits for the device (GPU work is asynchronous).
        return float(gradients[0][0, 0]) + float(gradients[1][0, 0, 0, 0])

    return step


def default_device() -> str:
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def gpus() -> list[tuple[str, tuple[int, ...] | None]]:
    found = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(device)
        except (ValueError, RuntimeError):
            details = {}
        cc = details.get("compute_capability")
        found.append((details.get("device_name", device.name), tuple(cc) if cc else None))
    return found


def build_info() -> dict[str, Any]:
    return dict(tf.sysconfig.get_build_info())
