"""The one argument validator of mp_callbacks.

Every public constructor checks its arguments here, so that every refusal
reads the same way (``Owner: `argument` must be ...; received
argument=value.``), names the argument, and is raised at construction
rather than at the first training step. Numbers are accepted as any real
or integral number, NumPy scalars included, but never a bool; bounds are
checked in the dtype the value will be stored in (float32 scales, int64
counters), so that no accepted value turns into inf or 0 later.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "INT64_MAX",
    "check_bool",
    "check_choice",
    "check_int",
    "check_real",
]

FLOAT32_MAX = float(np.finfo(np.float32).max)
#: The smallest normal float32. TensorFlow flushes float32 subnormals to
#: zero on CPU, so a scale below this would become 0.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
INT64_MAX = int(np.iinfo(np.int64).max)


def fail(owner: str, argument: str, value: Any, requirement: str, error: type = ValueError) -> NoReturn:
    raise error(f"{owner}: `{argument}` must be {requirement}; received {argument}={value!r}.")


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def check_real(
    owner: str,
    argument: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    float32: bool = False,
    requirement: str | None = None,
) -> float:
    """Returns `value` as a Python float if it is a finite real number
    within the bounds; raises TypeError (not a number) or ValueError.

    With `float32=True` the value must also survive a cast to float32:
    neither overflow to inf nor (when nonzero) underflow below the
    smallest normal float32."""
    if requirement is None:
        parts = ["a finite number"]
        if low is not None:
            parts.append(f"{'>=' if low_inclusive else '>'} {low:g}")
        if high is not None:
            parts.append(f"{'<=' if high_inclusive else '<'} {high:g}")
        requirement = " ".join(parts[:1]) + (" " + " and ".join(parts[1:]) if parts[1:] else "")
    if _is_bool(value) or not isinstance(value, numbers.Real):
        fail(owner, argument, value, requirement, TypeError)
    number = float(value)
    if not math.isfinite(number):
        fail(owner, argument, value, requirement)
    if low is not None and (number < low or (not low_inclusive and number == low)):
        fail(owner, argument, value, requirement)
    if high is not None and (number > high or (not high_inclusive and number == high)):
        fail(owner, argument, value, requirement)
    if float32:
        if abs(number) > FLOAT32_MAX:
            fail(owner, argument, value, f"{requirement}, representable in float32 (<= {FLOAT32_MAX:.4g})")
        if number != 0 and abs(number) < FLOAT32_TINY:
            fail(owner, argument, value, f"{requirement}, representable in float32 (>= {FLOAT32_TINY:.4g})")
    return number


def check_int(
    owner: str,
    argument: str,
    value: Any,
    *,
    low: int | None = None,
    high: int = INT64_MAX,
    requirement: str | None = None,
) -> int:
    """Returns `value` as a Python int if it is an integral number (NumPy
    integers included, bools and floats not) within [low, high]."""
    if requirement is None:
        requirement = "an integer"
        if low is not None:
            requirement += f" >= {low}"
        requirement += f" and <= {high}" if high != INT64_MAX else " that fits in int64"
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        fail(owner, argument, value, requirement, TypeError)
    number = int(value)
    if (low is not None and number < low) or number > high:
        fail(owner, argument, value, requirement)
    return number


def check_bool(owner: str, argument: str, value: Any) -> bool:
    """Returns `value` if it is a bool (NumPy bools included): a string
    such as 'no' is refused rather than taken as true."""
    if not _is_bool(value):
        fail(owner, argument, value, "True or False", TypeError)
    return bool(value)


def check_choice(owner: str, argument: str, value: Any, choices: Iterable[Any]) -> Any:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        fail(owner, argument, value, "one of " + ", ".join(map(repr, choices)))
    return value
