"""The few `keras.ops` functions the state machine uses
(`_scale_state.transition`, `backends/common/step.finished_state`), over
torch tensors directly.

The state machine is some fifty scalar operations per step. Through
`keras.ops` each one pays Keras's dispatch (symbolic checks, conversions),
about a millisecond a step in all, a share of a small eager step that
stock Keras does not pay; torch's own functions take a few microseconds
each. Same semantics for what the state machine passes them: tensors,
Python numbers, dtype names; tests run the state machine both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "cast",
    "concatenate",
    "convert_to_tensor",
    "equal",
    "expand_dims",
    "full",
    "isfinite",
    "logical_and",
    "logical_not",
    "logical_or",
    "maximum",
    "minimum",
    "not_equal",
    "ones",
    "where",
    "zeros",
]


def _dtype(dtype: Any) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


def _tensor(value: Any, like: Any = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    dtype = like.dtype if isinstance(like, torch.Tensor) else None
    device = like.device if isinstance(like, torch.Tensor) else None
    return torch.as_tensor(value, dtype=dtype, device=device)


def convert_to_tensor(value: Any, dtype: Any = None) -> torch.Tensor:
    return torch.as_tensor(value, dtype=None if dtype is None else _dtype(dtype))


def cast(value: Any, dtype: Any) -> torch.Tensor:
    return _tensor(value).to(_dtype(dtype))


def zeros(shape: Any, dtype: Any = "float32") -> torch.Tensor:
    return torch.zeros(shape, dtype=_dtype(dtype))


def ones(shape: Any, dtype: Any = "float32") -> torch.Tensor:
    return torch.ones(shape, dtype=_dtype(dtype))


def full(shape: Any, value: Any, dtype: Any = "float32") -> torch.Tensor:
    return torch.full(shape, value, dtype=_dtype(dtype))


def isfinite(value: Any) -> torch.Tensor:
    return torch.isfinite(_tensor(value))


def equal(a: Any, b: Any) -> torch.Tensor:
    return torch.eq(_tensor(a), b)


def not_equal(a: Any, b: Any) -> torch.Tensor:
    return torch.ne(_tensor(a), b)


def logical_and(a: Any, b: Any) -> torch.Tensor:
    return torch.logical_and(_tensor(a), _tensor(b))


def logical_or(a: Any, b: Any) -> torch.Tensor:
    return torch.logical_or(_tensor(a), _tensor(b))


def logical_not(a: Any) -> torch.Tensor:
    return torch.logical_not(_tensor(a))


def maximum(a: Any, b: Any) -> torch.Tensor:
    a = _tensor(a, b)
    return torch.maximum(a, _tensor(b, a))


def minimum(a: Any, b: Any) -> torch.Tensor:
    a = _tensor(a, b)
    return torch.minimum(a, _tensor(b, a))


def where(condition: Any, a: Any, b: Any) -> torch.Tensor:
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        a = torch.as_tensor(a, dtype=torch.float32)
    return torch.where(_tensor(condition), a, b)


def concatenate(values: Sequence[Any], axis: int = 0) -> torch.Tensor:
    return torch.cat([_tensor(v) for v in values], dim=axis)


def expand_dims(value: Any, axis: int) -> torch.Tensor:
    return torch.unsqueeze(_tensor(value), axis)
