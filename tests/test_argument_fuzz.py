"""Every public constructor argument, fuzzed: wrong types, NaN, +-inf, 0,
negatives, huge values, NumPy scalars. A refused value raises ValueError or
TypeError at construction, naming the argument; an accepted one is kept as
the number it is, survives its config, and gives a scale that stays a
positive finite number through an applied and a skipped step (no fit: the
callbacks' and the model's behaviour is tested where they train)."""

from __future__ import annotations

import math
import numbers

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mp_callbacks as mp

odd_values = st.one_of(
    st.booleans(),
    st.none(),
    st.sampled_from(["", "auto", "no", "8", "stop"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [0, 0.0, -1, -0.5, 1, 2, 0.5, 1e-50, 2.0**-130, 1e39, 2.0**128, 2**63, 2**63 - 1, -(2**63)]
    ),
    st.integers(-(2**70), 2**70),
    st.builds(np.float32, st.floats(width=32, allow_nan=True, allow_infinity=True)),
    st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
    st.builds(np.bool_, st.booleans()),
    st.just([]),
    st.just({}),
)

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def _refused_well(error: Exception, argument: str) -> None:
    assert isinstance(error, (ValueError, TypeError)), repr(error)
    assert argument in str(error), str(error)


def _construct(factory, argument, value):
    try:
        return factory(**{argument: value})
    except (ValueError, TypeError) as error:
        _refused_well(error, argument)
        return None


DYNAMIC_ARGS = [
    "initial_scale",
    "growth_interval",
    "growth_factor",
    "backoff_factor",
    "min_scale",
    "max_scale",
    "hysteresis",
]


def _same_number(kept, given) -> bool:
    """Kept as the number given, in the type it is stored as (float scales, int counts)."""
    return (
        isinstance(given, numbers.Real)
        and not isinstance(given, (bool, np.bool_))
        and type(kept) in (int, float)
        and kept == type(kept)(given)
    )


@pytest.mark.parametrize("argument", DYNAMIC_ARGS)
@FUZZ
@given(value=odd_values)
def test_dynamic_loss_scale_arguments(argument, value):
    loss_scale = _construct(mp.LossScaler, argument, value)
    if loss_scale is None:
        return
    assert _same_number(getattr(loss_scale, argument), value)
    again = mp.LossScaler.from_config(loss_scale.get_config())
    assert again.get_config() == loss_scale.get_config()
    loss_scale.build([tf.Variable(1.0)])
    for flags in ([0, 0], [1, 0]):  # an applied step, then a skipped one
        loss_scale._update_state(tf.constant(flags, tf.int64))
        scale = loss_scale.get_scale()
        assert math.isfinite(scale) and scale > 0
    assert loss_scale.diagnostics()["skipped_steps"] == 1


@pytest.mark.parametrize(
    "argument", ["initial_scale", "dynamic_growth_steps", "loss_scale", "dynamic", "hysteresis", "min_scale"]
)
@FUZZ
@given(value=odd_values)
def test_loss_scale_optimizer_arguments(argument, value):
    optimizer = _construct(
        lambda **kw: mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), **kw), argument, value
    )
    if optimizer is None:
        return
    variable = tf.Variable([1.0])
    # Keras 3's contract: apply takes the gradients of the scaled loss.
    optimizer.apply([tf.constant([1.0]) * optimizer.get_scale()], [variable])
    assert np.allclose(variable.numpy(), [0.9])
    assert math.isfinite(optimizer.get_scale()) and optimizer.get_scale() > 0


@FUZZ
@given(value=odd_values)
def test_model_loss_scale_argument(value):
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2)(inputs)
    model = _construct(lambda **kw: mp.MixedPrecisionModel(inputs, outputs, **kw), "loss_scale", value)
    if model is None:
        return
    model.compile(keras.optimizers.SGD(0.01), "mse")
    if value is None:
        assert not model.scaler.scaling_active  # no scaling
    elif isinstance(value, str):
        assert value == "auto" and model.get_scale() == 1.0  # float32: auto means none
    elif isinstance(value, numbers.Real):
        assert not model.scaler.is_dynamic and model.get_scale() == pytest.approx(float(value), rel=1e-6)


CALLBACK_ARGS = [
    (mp.LossScaleMonitor, "every_n_steps"),
    (mp.LossScaleMonitor, "collapse_threshold"),
    (mp.LossScaleMonitor, "max_skipped_fraction"),
    (mp.NaNGradientMonitor, "patience"),
    (mp.NaNGradientMonitor, "action"),
    (mp.NaNGradientMonitor, "check_every"),
    (mp.EpochTimer, "time_validation"),
    (mp.EpochTimer, "batch_size"),
]


@pytest.mark.parametrize("cls, argument", CALLBACK_ARGS, ids=lambda p: getattr(p, "__name__", p))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=odd_values)
def test_callback_arguments(cls, argument, value):
    callback = _construct(cls, argument, value)
    if callback is None:
        return
    kept = callback.get_config()[argument]
    assert _same_number(kept, value) or (kept == value and type(kept) in (bool, str, type(None)))
    assert type(callback).from_config(callback.get_config()).get_config() == callback.get_config()


def test_strings_and_bools_are_not_flags_or_numbers():
    with pytest.raises(TypeError, match="time_validation"):
        mp.EpochTimer(time_validation="no")
    with pytest.raises(TypeError, match="collapse_threshold"):
        mp.LossScaleMonitor(collapse_threshold=True)
    with pytest.raises(TypeError, match="max_skipped_fraction"):
        mp.LossScaleMonitor(max_skipped_fraction=False)
    assert mp.LossScaleMonitor(collapse_threshold=np.float32(2.0)).collapse_threshold == 2.0
