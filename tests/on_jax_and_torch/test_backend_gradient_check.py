"""The gradient check on JAX and torch (`_gradient_check.check_gradients`'s
contract, as tests/test_gradient_check.py holds TensorFlow's): exact
per-gradient flags, the global norm, the decision; on JAX from one variadic
reduction per gradient, with no conditional, also under `jax.jit`."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_callbacks._gradient_check import check_gradients

INF, NAN = float("inf"), float("nan")
ops = keras.ops


def _grads(*values, dtype="float32"):
    return [None if v is None else ops.convert_to_tensor(np.array(v, dtype)) for v in values]


def _flags(checked) -> list[int]:
    return [int(f) for f in ops.convert_to_numpy(checked.flags)]


def test_no_gradients():
    checked = check_gradients([])
    assert _flags(checked) == []
    assert float(checked.global_norm) == 0.0 and bool(checked.all_finite)


def test_healthy_gradients_and_missing_ones():
    checked = check_gradients(_grads([3.0], None, [[4.0, 0.0]]) + _grads([0.0], dtype="float16"))
    assert _flags(checked) == [0, 0, 0, 0]
    assert float(checked.global_norm) == pytest.approx(5.0)
    assert bool(checked.all_finite)


def test_only_missing_gradients():
    checked = check_gradients([None, None])
    assert _flags(checked) == [0, 0]
    assert float(checked.global_norm) == 0.0 and bool(checked.all_finite)


@pytest.mark.parametrize("poison", [INF, -INF, NAN])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_names_exactly_the_nonfinite_gradients(poison, dtype):
    grads = _grads([1.0, poison], [2.0], None, [[poison, 0.0]], [[0.5]], dtype=dtype)
    checked = check_gradients(grads)
    assert _flags(checked) == [1, 0, 0, 1, 0]
    assert not bool(checked.all_finite)
    assert not math.isfinite(float(checked.global_norm))


def test_finite_values_whose_squares_overflow_are_finite():
    # Each value is finite, the sum of squares past float32's range: the
    # step applies (the flags are exact), the norm says inf.
    checked = check_gradients(_grads([3e38, 3e38], [1.0]))
    assert _flags(checked) == [0, 0]
    assert bool(checked.all_finite)
    assert float(checked.global_norm) == INF


def test_float16_squares_are_taken_in_float32():
    checked = check_gradients(_grads([300.0, 400.0], dtype="float16"))  # 300**2 overflows float16
    assert float(checked.global_norm) == pytest.approx(500.0)
    assert bool(checked.all_finite)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=5),
        min_size=1,
        max_size=4,
    ),
    st.data(),
)
def test_the_norm_is_the_global_l2_norm_and_one_poisoned_gradient_is_named(values, data):
    grads = _grads(*values)
    expected = math.sqrt(sum(float(x) ** 2 for v in values for x in v))
    checked = check_gradients(grads)
    assert float(checked.global_norm) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert _flags(checked) == [0] * len(values) and bool(checked.all_finite)
    poisoned = data.draw(st.integers(0, len(values) - 1))
    bad = [list(v) for v in values]
    bad[poisoned][data.draw(st.integers(0, len(bad[poisoned]) - 1))] = data.draw(
        st.sampled_from([INF, -INF, NAN])
    )
    checked = check_gradients(_grads(*bad))
    assert _flags(checked) == [int(i == poisoned) for i in range(len(values))]
    assert not bool(checked.all_finite)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jit")
def test_compiled_matches_eager_and_holds_no_conditional():
    import jax

    grads = _grads([1.0, 2.0], [NAN], [[3e38, 3e38]])

    def flags_norm_decision(grads):
        checked = check_gradients(grads)
        return checked.flags, checked.global_norm, checked.all_finite

    eager = flags_norm_decision(grads)
    compiled = jax.jit(flags_norm_decision)(grads)
    for a, b in zip(eager, compiled):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [int(f) for f in compiled[0]] == [0, 1, 0]
    # No branch that healthy steps skip: XLA counts every byte of it.
    text = jax.jit(flags_norm_decision).lower(grads).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
