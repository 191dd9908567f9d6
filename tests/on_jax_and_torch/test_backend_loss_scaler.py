"""`LossScaler` on Keras's JAX and torch backends, where it differs from
TensorFlow's: its step methods are TensorFlow's alone (the contract both
share is in `on_every_backend/test_loss_scaler_contract.py`)."""

from __future__ import annotations

import keras
import pytest

import mp_callbacks as mp
from mp_callbacks import LossScaler

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)


@pytest.mark.parametrize("method", ["scale", "unscale", "apply_gradients", "update", "check_gradients"])
def test_the_tensorflow_step_methods_name_the_backend_and_the_alternative(method):
    with pytest.raises(
        mp.BackendNotSupportedError,
        match=rf"LossScaler\.{method} .*'{keras.backend.backend()}'.*loss_scaling",
    ):
        getattr(LossScaler(), method)
    with pytest.raises(AttributeError):
        LossScaler().no_such_thing  # noqa: B018
