"""Every layer class `keras.layers` offers, through the library on JAX: the
TensorFlow sweep's models (`tests/test_layer_sweep.py`), under a mixed
policy. A `MixedPrecisionModel` fit with `HeadroomMonitor` skips a poisoned
batch with every variable left as it was and `diagnose_batch` replays a
clean one; `check_model` has no findings; `float32_copy`,
`PrecisionPlan.apply` and `with_float32_layers` compute in float32 and predict exactly what the same
weights give when built under float32."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from test_layer_sweep import _KERAS_OWN_LIMITS, _NO_FLOAT32_REFERENCE, _SWEEP, _data, _low_precision, _model

import mp_callbacks as mp

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
    ),
]


#: Keras's own layers that need TensorFlow to run, whatever the backend.
NEED_TENSORFLOW = {"Hashing", "IntegerLookup"}
_ON_JAX = [name for name in _SWEEP if name not in NEED_TENSORFLOW]


@pytest.mark.parametrize("name", sorted(NEED_TENSORFLOW))
def test_the_layers_left_out_do_need_tensorflow(name):
    with pytest.raises(ImportError, match="requires TensorFlow"):
        _model(name)


def _first(x, n):
    return [t[:n] for t in x] if isinstance(x, list) else x[:n]


@pytest.mark.parametrize("name", _ON_JAX)
def test_every_layer_skips_a_poisoned_batch_with_every_variable_kept(name):
    keras.mixed_precision.set_global_policy("mixed_float16")
    # Half the layers come in through from_model, as an existing model would.
    if _ON_JAX.index(name) % 2:
        model = mp.MixedPrecisionModel.from_model(_model(name)[0])
    else:
        model, _ = _model(name, mp.MixedPrecisionModel)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    x, y = _data(name, 16), np.zeros((16, 2), "float32")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(
                x, y, batch_size=8, verbose=0, callbacks=[mp.HeadroomMonitor(_first(x, 4), every_n_steps=2)]
            ).history
    except Exception as error:
        # Only where stock Keras on JAX fails the same way: no worse.
        stock, _ = _model(name)
        stock.compile(keras.optimizers.Adam(1e-3), "mse")
        with pytest.raises(type(error)):
            stock.fit(x, y, batch_size=8, verbose=0)
        return
    shares = [value for key, value in history.items() if key.startswith("headroom/")]
    assert all(np.isfinite(v[0]) and v[0] >= 0 for v in shares)
    cannot = [w for w in caught if "probe batch cannot run" in str(w.message)]
    assert len(cannot) <= 1 and (not cannot or name in _NO_FLOAT32_REFERENCE)
    before = [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]
    bad_y = y[:8].copy()
    bad_y[:4] = np.nan  # the labels: every layer's input stays valid
    assert model.fit(_first(x, 8), bad_y, verbose=0).history["skipped_steps"] == [1.0]
    for value, variable in zip(before, model.variables + model.optimizer.variables):
        np.testing.assert_array_equal(value, variable.numpy(), err_msg=variable.path)
    report = mp.diagnose_batch(model, _first(x, 8), y[:8])
    assert report.loss_finite and report.first_nonfinite_layer is None
    assert report.layers and all(r.gradient_finite is not None for r in report.layers)
    for value, variable in zip(before, model.variables + model.optimizer.variables):
        np.testing.assert_array_equal(value, variable.numpy(), err_msg=variable.path)


@pytest.mark.parametrize("name", _ON_JAX)
def test_copies_of_every_layer_compute_in_float32_with_the_same_predictions(name):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model, layer = _model(name, mp.MixedPrecisionModel)
    assert mp.check_model(model) == []
    if name in _KERAS_OWN_LIMITS:
        with pytest.raises(ValueError, match=_KERAS_OWN_LIMITS[name]):
            mp.float32_copy(model)
        return
    copies = [mp.float32_copy(model), mp.PrecisionPlan("float32").apply(model)]
    for copy in copies:
        assert _low_precision(copy) == []
    pinned = mp.with_float32_layers(model, [layer.name])
    assert _low_precision(pinned.get_layer(layer.name)) == []
    if name in _NO_FLOAT32_REFERENCE:
        return
    keras.mixed_precision.set_global_policy("float32")
    reference, _ = _model(name)
    reference.set_weights(model.get_weights())
    x = _data(name)
    expected = reference.predict(x, verbose=0)
    for copy in copies:
        np.testing.assert_array_equal(copy.predict(x, verbose=0), expected)
