"""The gradient check on its own: one pass gives the flags, the norm and the
step's decision (mp_callbacks/_gradient_check.py's contract), eagerly and
traced, for dense, sparse, float16 and missing gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_callbacks._gradient_check import (
    CheckedGradients,
    applied_norm,
    check_gradients,
    decision,
    half_sum_of_squares,
    nonfinite_flag,
)

INF, NAN = float("inf"), float("nan")


def _sparse(values, indices, rows=4):
    values = tf.constant(values, tf.float32)
    return tf.IndexedSlices(
        values, tf.constant(indices, tf.int64), tf.constant([rows, values.shape[1]], tf.int64)
    )


class _Variable:
    def __init__(self, overwrite_with_gradient=False):
        self.overwrite_with_gradient = overwrite_with_gradient


# ------------------------------------------------------- half_sum_of_squares
def test_half_sum_of_squares_of_dense_sparse_and_missing_gradients():
    assert float(half_sum_of_squares(tf.constant([3.0, 4.0]))) == 12.5
    # Only the slices' values count: the rows they do not touch are zero.
    assert float(half_sum_of_squares(_sparse([[1.0, 2.0]], [3]))) == 2.5
    missing = half_sum_of_squares(None)
    assert missing.dtype == tf.float32 and float(missing) == 0.0


def test_half_sum_of_squares_of_float16_is_float32_and_does_not_overflow():
    # 300**2 = 90,000 is past float16's largest finite value (65,504).
    result = half_sum_of_squares(tf.constant([300.0, 400.0], tf.float16))
    assert result.dtype == tf.float32
    assert float(result) == 125_000.0


# ----------------------------------------------------------- nonfinite_flag
@pytest.mark.parametrize(
    ("value", "flag"),
    [([1.0, -2.0], 0), ([1.0, INF], 1), ([-INF, 0.0], 1), ([NAN, 1.0], 1), ([0.0], 0)],
)
def test_nonfinite_flag_of_a_dense_value(value, flag):
    result = nonfinite_flag(tf.constant(value))
    assert result.dtype == tf.int64 and int(result) == flag


def test_nonfinite_flag_reads_a_sparse_gradients_values():
    assert int(nonfinite_flag(_sparse([[1.0, 2.0]], [0]))) == 0
    assert int(nonfinite_flag(_sparse([[1.0, NAN]], [2]))) == 1


def test_nonfinite_flag_of_none_is_zero():
    result = nonfinite_flag(None)
    assert result.dtype == tf.int64 and int(result) == 0


@pytest.mark.parametrize(
    ("losses", "flag"),
    [
        ([[1.0]], 0),
        ([[INF]], 1),
        ([[1.0], [2.0]], 0),
        ([[1.0], [NAN]], 1),
        ([[INF], [1.0], [2.0]], 1),
    ],
)
def test_nonfinite_flag_of_several_losses_is_the_largest(losses, flag):
    for container in (list, tuple):
        result = nonfinite_flag(container(tf.constant(loss) for loss in losses))
        assert result.dtype == tf.int64 and result.shape == () and int(result) == flag


# ---------------------------------------------------------- check_gradients
def test_check_gradients_of_no_gradients():
    checked = check_gradients([])
    assert checked.flags.shape == (0,) and checked.flags.dtype == tf.int64
    assert float(checked.global_norm) == 0.0 and bool(checked.all_finite)


def test_check_gradients_of_healthy_gradients():
    grads = [tf.constant([3.0]), None, _sparse([[4.0, 0.0]], [1]), tf.constant([0.0], tf.float16)]
    checked = check_gradients(grads)
    assert checked.flags.dtype == tf.int64
    assert checked.flags.numpy().tolist() == [0, 0, 0, 0]
    assert float(checked.global_norm) == pytest.approx(5.0)
    assert bool(checked.all_finite)


@pytest.mark.parametrize("poison", [INF, -INF, NAN])
def test_check_gradients_names_exactly_the_nonfinite_gradients(poison):
    grads = [tf.constant([1.0, poison]), tf.constant([2.0]), None, _sparse([[poison, 0.0]], [0])]
    checked = check_gradients(grads)
    assert checked.flags.numpy().tolist() == [1, 0, 0, 1]
    assert not bool(checked.all_finite)
    assert not math.isfinite(float(checked.global_norm))


def test_check_gradients_finite_values_whose_squares_overflow_are_finite():
    # Each value is finite, but the sum of squares is past float32's range:
    # the exact pass decides, and it finds every gradient finite.
    big = tf.constant([3e38, 3e38])
    checked = check_gradients([big, tf.constant([1.0])])
    assert checked.flags.numpy().tolist() == [0, 0]
    assert bool(checked.all_finite)


def test_check_gradients_traced_matches_eager():
    grads = [tf.constant([1.0, 2.0]), tf.constant([NAN])]

    @tf.function
    def traced(a, b):
        return check_gradients([a, b])

    eager, graph = check_gradients(grads), traced(*grads)
    assert eager.flags.numpy().tolist() == graph.flags.numpy().tolist() == [0, 1]
    assert bool(eager.all_finite) is bool(graph.all_finite) is False


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=5), min_size=1, max_size=4))
def test_check_gradients_norm_is_the_global_l2_norm(values):
    grads = [tf.constant(v, tf.float32) for v in values]
    expected = math.sqrt(sum(float(x) ** 2 for v in values for x in v))
    checked = check_gradients(grads)
    assert float(checked.global_norm) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert checked.flags.numpy().tolist() == [0] * len(values) and bool(checked.all_finite)


# ----------------------------------------------------------------- decision
def _flags(*values):
    return tf.constant(values, tf.int64)


@pytest.mark.parametrize(
    ("flags", "applied"),
    [
        ((0, 0, 0), True),
        ((0, 1, 0), False),
        ((2, 0, 0), False),
        # The loss's own flag, last, is not a gradient's: it does not decide.
        ((0, 0, 1), True),
    ],
)
def test_decision_from_the_flags(flags, applied):
    assert bool(decision(None, _flags(*flags))) is applied
    assert bool(decision(None, _flags(*flags), replicas=2)) is applied


def test_decision_with_one_replica_takes_the_checks_own_answer():
    checked_bad = CheckedGradients(_flags(1, 0), tf.constant(NAN), tf.constant(False))
    checked_good = CheckedGradients(_flags(0, 0), tf.constant(1.0), tf.constant(True))
    # The flags below disagree with the check: with one replica the check
    # decides, with several the (all-reduced) flags do.
    assert bool(decision(checked_bad, _flags(0, 0, 0))) is False
    assert bool(decision(checked_good, _flags(1, 0, 0))) is True
    assert bool(decision(checked_bad, _flags(0, 0, 0), replicas=2)) is True
    assert bool(decision(checked_good, _flags(1, 0, 0), replicas=2)) is False


def test_decision_without_the_checks_answer_reads_the_flags():
    checked = CheckedGradients(_flags(0, 0), tf.constant(1.0))
    assert checked.all_finite is None
    assert bool(decision(checked, _flags(0, 1, 0))) is False
    assert bool(decision(checked, _flags(0, 0, 1))) is True


# ------------------------------------------------------------- applied_norm
def test_applied_norm_is_the_checks_norm_without_overwritten_variables():
    grads = [tf.constant([3.0]), tf.constant([4.0])]
    checked = check_gradients(grads)
    norm = applied_norm(checked, grads, [_Variable(), _Variable()])
    assert norm is checked.global_norm


def test_applied_norm_leaves_out_variables_overwritten_with_their_gradient():
    grads = [tf.constant([3.0]), tf.constant([100.0]), tf.constant([4.0]), None]
    checked = check_gradients(grads)
    variables = [_Variable(), _Variable(overwrite_with_gradient=True), _Variable(), _Variable()]
    norm = applied_norm(checked, grads, variables)
    assert norm.dtype == tf.float32 and float(norm) == pytest.approx(5.0)
    assert float(checked.global_norm) == pytest.approx(np.sqrt(9 + 10_000 + 16))


def test_applied_norm_when_every_variable_is_overwritten_is_zero():
    grads = [tf.constant([3.0]), tf.constant([4.0])]
    norm = applied_norm(check_gradients(grads), grads, [_Variable(True), _Variable(True)])
    assert norm.dtype == tf.float32 and float(norm) == 0.0


def test_applied_norm_of_variables_without_the_attribute_counts_them_all():
    # Plain tf.Variables have no `overwrite_with_gradient`: none is left out.
    grads = [tf.constant([3.0]), tf.constant([4.0])]
    variables = [tf.Variable([0.0]), object()]
    checked = check_gradients(grads)
    assert float(applied_norm(checked, grads, variables)) == pytest.approx(5.0)
