"""The loss scale's documented state machine in plain Python, shared by
every backend's tests (no TensorFlow or JAX here)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st


@dataclass
class ReferenceLossScale:
    """The documented transitions, in plain Python with float32 arithmetic."""

    initial_scale: float
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    min_scale: float
    max_scale: float
    hysteresis: int

    def __post_init__(self):
        self.scale = np.float32(self.initial_scale)
        self.good_steps = 0
        self.hysteresis_left = self.hysteresis
        self.skipped = 0

    def step(self, finite: bool, loss_finite: bool = True) -> None:
        if not loss_finite:
            # Bad data: skipped, and nothing of the scale's changes.
            self.skipped += 1
            return
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale = min(self.scale * np.float32(self.growth_factor), np.float32(self.max_scale))
                self.good_steps = 0
                self.hysteresis_left = self.hysteresis
        else:
            self.skipped += 1
            self.good_steps = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * np.float32(self.backoff_factor), np.float32(self.min_scale))


@st.composite
def configs(draw):
    low = draw(st.integers(0, 10))
    high = draw(st.integers(low, 24))
    start = draw(st.integers(low, high))
    return {
        "initial_scale": 2.0**start,
        "min_scale": 2.0**low,
        "max_scale": 2.0**high,
        "growth_interval": draw(st.integers(1, 5)),
        "growth_factor": draw(st.sampled_from([1.5, 2.0, 3.0, 4.0])),
        "backoff_factor": draw(st.sampled_from([0.25, 0.5, 0.75])),
        "hysteresis": draw(st.integers(1, 4)),
    }
