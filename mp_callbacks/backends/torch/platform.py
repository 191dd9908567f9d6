"""What the hardware advisor asks of the backend, on torch: the probe's
unit of work, the default device, the GPUs and the build.
`backends/tensorflow/platform.py` and `backends/jax/platform.py` hold the
other backends' answers; the advice itself (`hardware.py`) is the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["build_info", "default_device", "gpus", "probe_step", "version"]


def version() -> str:
    return str(torch.__version__)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def probe_step(compute_dtype: str, seed: int = 0) -> Callable[[], float]:
    """TensorFlow's probe, in torch: a 512x512 matrix multiply and a 3x3
    convolution (16x32x32x32), forward and backward with random upstream
    gradients, on the device Keras's torch backend uses."""
    dtype = getattr(torch, compute_dtype)
    device = _device()
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.1).to(device=device, dtype=dtype)

    a, b, up_product = normal(512, 512), normal(512, 512), normal(512, 512)
    images, kernel, up_map = normal(16, 32, 32, 32), normal(32, 32, 3, 3), normal(16, 32, 32, 32)
    b.requires_grad_(True)
    kernel.requires_grad_(True)

    def step() -> float:
        product = a @ b
        feature_map = torch.nn.functional.conv2d(images, kernel, padding=1)
        grad_b, grad_kernel = torch.autograd.grad((product, feature_map), (b, kernel), (up_product, up_map))
        return float(grad_b[0, 0]) + float(grad_kernel[0, 0, 0, 0])  # a read waits for the device

    return step


def default_device() -> str:
    device = _device()
    return f"{device.type.upper()}:{device.index or 0}"


def gpus() -> list[tuple[str, tuple[int, ...] | None]]:
    """(name, compute capability) of each GPU torch sees."""
    if not torch.cuda.is_available():
        return []
    return [
        (torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
        for i in range(torch.cuda.device_count())
    ]


def build_info() -> dict[str, Any]:
    """Whether this torch build runs on CUDA, and which."""
    cuda = torch.version.cuda
    cudnn = torch.backends.cudnn.version() if cuda else None
    return {"is_cuda_build": cuda is not None, "cuda_version": cuda, "cudnn_version": cudnn}
