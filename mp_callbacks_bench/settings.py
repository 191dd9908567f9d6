"""What a benchmark run is asked to do, and its one error type.

This module imports neither TensorFlow nor Keras, so that the command
line can check its arguments in a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

__all__ = ["BUILT_IN_MODELS", "POLICIES", "QUICK", "BenchError", "BenchSettings", "Preset"]

# The same tuple as mp_callbacks.hardware.POLICIES (a test keeps them equal);
# repeated here because importing that module starts TensorFlow.
POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
BUILT_IN_MODELS = ("mlp", "cnn")


class BenchError(ValueError):
    """Bad benchmark input, or a run that failed; the message is one line
    for the user."""


@dataclass
class BenchSettings:
    """One benchmark: a model trained under each policy.

    `model` is "mlp", "cnn", "MODULE:FUNCTION" or "path/to/file.py:FUNCTION",
    where `FUNCTION()` returns a Keras model, compiled or not.
    """

    policies: list[str]
    model: str = "mlp"
    dataset: str = "synthetic"
    epochs: int = 5
    batch_size: int = 128
    seed: int = 0
    train_samples: int | None = None
    test_samples: int | None = None
    repeats: int = 1
    # More alternating runs, up to this many, while the runs do not separate.
    max_repeats: int | None = None
    quiet: bool = False
    # Stop a mixed policy after its first epoch once it cannot tie float32
    # (`runner.EarlyVerdict`); its row then says so.
    stop_early: bool = False
    # float32's epoch time, for that rule (set by `compare`, not by users).
    baseline_epoch_time: float | None = None


class Preset(TypedDict, total=False):
    """A `--quick` preset: the settings it fills when the user gave none."""

    model: str
    epochs: int
    train_samples: int
    test_samples: int
    repeats: int
    max_repeats: int
    steps: int
    stop_early: bool


# A preset that finishes in about a minute and a half on 2 CPU cores: the
# CNN (where mixed precision pays most), 8,000 images, 4 epochs (3 warm),
# each policy run twice in alternation so that a burst of machine noise
# cannot decide the table alone.
QUICK: Preset = {
    "model": "cnn",
    "epochs": 4,
    "train_samples": 8000,
    "test_samples": 2000,
    "repeats": 2,
    "max_repeats": 4,
    # A policy many times slower than float32 (bfloat16 on a CPU without
    # AVX512-BF16 runs at 0.13-0.16x) would take most of the preset's time
    # to say what its first epoch already shows.
    "stop_early": True,
}
