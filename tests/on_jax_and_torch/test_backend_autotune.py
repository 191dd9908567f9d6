"""autotune on Keras's JAX backend: the candidates train on JAX, the layer
that overflows is found and pinned, and the plan trains there."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from test_autotune import _data, healthy_model, overflowing_model, variance_model

import mp_callbacks as mp

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)


@pytest.mark.parametrize("in_subprocess", [False, True], ids=["here", "subprocess"])
def test_the_layer_that_overflows_and_no_other_is_pinned_and_the_plan_trains(in_subprocess):
    x, y = _data()
    plan = mp.autotune(
        overflowing_model,
        x,
        y,
        policies=["mixed_float16"],
        steps=10,
        batch_size=32,
        in_subprocess=in_subprocess,
    )
    assert plan.policy == "mixed_float16" and plan.float32_layers == ["naive_softmax"]
    candidate = next(c for c in plan.candidates if c["policy"] == "mixed_float16")
    assert "overflows" in candidate["reasons"]["naive_softmax"]
    assert candidate["divergent_steps"] == 0 and candidate["steps"] == 2 + len(candidate["ratios"]) >= 7
    assert plan.initial_scale is not None and plan.initial_scale >= 1
    assert plan.layer_dtypes == {"naive_softmax": "float32", "head": "float32"}
    assert "CPU" in plan.measured_on
    keras.config.set_dtype_policy("float32")
    tuned = plan.apply(mp.MixedPrecisionModel.from_model(overflowing_model()))
    assert tuned.get_layer("scores").compute_dtype == "float16"
    assert tuned.get_layer("naive_softmax").compute_dtype == "float32"
    assert tuned.get_scale() == plan.initial_scale
    history = tuned.fit(x, y, batch_size=32, epochs=1, verbose=0).history
    assert history["skipped_steps"] == [0.0] and np.isfinite(history["loss"][0])


def test_a_healthy_model_gets_no_pinned_layer():
    x, y = _data()
    plan = mp.autotune(
        healthy_model, x, y, policies=["mixed_bfloat16"], steps=10, batch_size=32, in_subprocess=False
    )
    assert plan.policy in ("float32", "mixed_bfloat16") and plan.float32_layers == []
    assert plan.initial_scale is None  # bfloat16 needs no loss scale
    assert [c["policy"] for c in plan.candidates] == ["float32", "mixed_bfloat16"]
    assert plan.candidates[0]["verdict"] == "reference"


def test_bfloat16s_catastrophic_cancellation_is_found():
    from mp_callbacks.layer_selection import select_float32_layers

    x, _ = _data(offset=1000.0, scale=1.0)
    y = x.var(axis=1, keepdims=True).astype("float32")
    keras.config.set_dtype_policy("mixed_bfloat16")
    selection = select_float32_layers(variance_model(), [(x[:32], y[:32])])
    assert selection.layers == ["variance"]
    assert "relative error" in selection.reasons["variance"]
