"""`LossScaler` arguments it must refuse, and how it says so: one table,
checked on every backend (TensorFlow's and JAX's `LossScaler` share the
checks)."""

from __future__ import annotations

#: Values no float32 or int64 variable can hold, and the argument named.
UNREPRESENTABLE = [
    ({"initial_scale": 1e39, "max_scale": 1e39}, "initial_scale"),
    ({"initial_scale": 2.0**-130, "min_scale": 2.0**-130}, "initial_scale"),
    ({"initial_scale": 1e-50, "min_scale": 1e-50}, "initial_scale"),
    ({"max_scale": 2.0**128}, "max_scale"),
    ({"growth_interval": 2**63}, "growth_interval"),
    ({"hysteresis": 2**63}, "hysteresis"),
    ({"growth_factor": 1e39}, "growth_factor"),
    ({"backoff_factor": 1e-50}, "backoff_factor"),
]

_FLOOR = "a finite number >= 2**-24 (5.96e-08)"

#: Out-of-range arguments and the whole message after "LossScaler: ".
REFUSALS = [
    ({"initial_scale": 0.0}, f"`initial_scale` must be {_FLOOR}; received initial_scale=0.0."),
    ({"min_scale": 1e-9}, f"`min_scale` must be {_FLOOR}; received min_scale=1e-09."),
    ({"max_scale": 1e-9}, f"`max_scale` must be {_FLOOR}; received max_scale=1e-09."),
    (
        {"growth_interval": 0},
        "`growth_interval` must be an integer >= 1 that fits in int64; received growth_interval=0.",
    ),
    (
        {"hysteresis": 0},
        "`hysteresis` must be an integer >= 1 that fits in int64; received hysteresis=0.",
    ),
    ({"growth_factor": 1.0}, "`growth_factor` must be a finite number > 1; received growth_factor=1.0."),
    (
        {"backoff_factor": 1.0},
        "`backoff_factor` must be a number in the open interval (0, 1); received backoff_factor=1.0.",
    ),
]

_ACCEPTED = "'auto', a LossScaler, a number in [2**-24, 2**64] (fixed scale) or None (no scaling)"

#: `loss_scale=` values refused (owner "Owner"), the error and its whole message.
LOSS_SCALE_REFUSALS = [
    ("dynamic", ValueError, f"Owner: `loss_scale` must be {_ACCEPTED}; received loss_scale='dynamic'."),
    ([], TypeError, f"Owner: `loss_scale` must be {_ACCEPTED}; received loss_scale=[]."),
    (
        {"scale": 2.0},
        TypeError,
        f"Owner: `loss_scale` must be {_ACCEPTED}; received loss_scale={{'scale': 2.0}}.",
    ),
    (
        0,
        ValueError,
        "Owner: `loss_scale` must be a number from 2**-24 (5.96e-08) to 2**64 "
        "(1.84e+19) when it is a fixed scale; received loss_scale=0.",
    ),
]
