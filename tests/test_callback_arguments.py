"""Every callback argument: the exact refusal, and the edges of what is accepted."""

from __future__ import annotations

import numpy as np
import pytest

import mp_callbacks as mp

REFUSALS = [
    (
        lambda: mp.LossScaleMonitor(every_n_steps=0),
        ValueError,
        "LossScaleMonitor: `every_n_steps` must be None or an integer >= 1; received every_n_steps=0.",
    ),
    (
        lambda: mp.LossScaleMonitor(every_n_steps=2.0),
        TypeError,
        "LossScaleMonitor: `every_n_steps` must be None or an integer >= 1; received every_n_steps=2.0.",
    ),
    (
        lambda: mp.LossScaleMonitor(collapse_threshold=0.0),
        ValueError,
        "LossScaleMonitor: `collapse_threshold` must be None or a finite number > 0; "
        "received collapse_threshold=0.0.",
    ),
    (
        lambda: mp.LossScaleMonitor(collapse_threshold=float("inf")),
        ValueError,
        "LossScaleMonitor: `collapse_threshold` must be None or a finite number > 0; "
        "received collapse_threshold=inf.",
    ),
    (
        lambda: mp.LossScaleMonitor(max_skipped_fraction=1.5),
        ValueError,
        "LossScaleMonitor: `max_skipped_fraction` must be a number in [0, 1]; "
        "received max_skipped_fraction=1.5.",
    ),
    (
        lambda: mp.LossScaleMonitor(max_skipped_fraction=-0.1),
        ValueError,
        "LossScaleMonitor: `max_skipped_fraction` must be a number in [0, 1]; "
        "received max_skipped_fraction=-0.1.",
    ),
    (
        lambda: mp.NaNGradientMonitor(patience=0),
        ValueError,
        "NaNGradientMonitor: `patience` must be an integer >= 1 that fits in int64; received patience=0.",
    ),
    (
        lambda: mp.NaNGradientMonitor(action="halt"),
        ValueError,
        "NaNGradientMonitor: `action` must be one of 'stop', 'raise', 'warn'; received action='halt'.",
    ),
    (
        lambda: mp.NaNGradientMonitor(check_every=-1),
        ValueError,
        "NaNGradientMonitor: `check_every` must be an integer >= 1 that fits in int64; "
        "received check_every=-1.",
    ),
    (
        lambda: mp.EpochTimer(time_validation="no"),
        TypeError,
        "EpochTimer: `time_validation` must be True or False; received time_validation='no'.",
    ),
    (
        lambda: mp.EpochTimer(batch_size=0),
        ValueError,
        "EpochTimer: `batch_size` must be None or an integer >= 1; received batch_size=0.",
    ),
    (
        lambda: mp.HeadroomMonitor(probe=np.ones((2, 2)), warn_above=0.0),
        ValueError,
        "HeadroomMonitor: `warn_above` must be a number in (0, 1]; received warn_above=0.0.",
    ),
    (
        lambda: mp.HeadroomMonitor(probe=np.ones((2, 2)), every_n_steps=0),
        ValueError,
        "HeadroomMonitor: `every_n_steps` must be an integer >= 1 that fits in int64; "
        "received every_n_steps=0.",
    ),
]


@pytest.mark.parametrize("make, error, message", REFUSALS)
def test_refusal_names_the_argument_and_value_exactly(make, error, message):
    with pytest.raises(error) as caught:
        make()
    assert str(caught.value) == message


def test_edges_that_are_accepted():
    monitor = mp.LossScaleMonitor(every_n_steps=np.int64(1), collapse_threshold=0.5, max_skipped_fraction=0)
    assert (monitor.every_n_steps, monitor.collapse_threshold, monitor.max_skipped_fraction) == (1, 0.5, 0.0)
    assert mp.LossScaleMonitor(max_skipped_fraction=1).max_skipped_fraction == 1.0
    assert mp.LossScaleMonitor(collapse_threshold=1e-30).collapse_threshold == 1e-30
    nan_monitor = mp.NaNGradientMonitor(patience=np.int32(3), action="warn", check_every=1)
    assert (nan_monitor.patience, nan_monitor.action, nan_monitor.check_every) == (3, "warn", 1)
    timer = mp.EpochTimer(time_validation=np.bool_(True), batch_size=np.int64(32))
    assert timer.time_validation is True and timer.batch_size == 32
    headroom = mp.HeadroomMonitor(probe=np.ones((2, 2)), warn_above=1.0, every_n_steps=5)
    assert (headroom.warn_above, headroom.every_n_steps) == (1.0, 5)
    for callback in (monitor, nan_monitor, timer):
        assert type(callback).from_config(callback.get_config()).get_config() == callback.get_config()
