"""Training data as a user hands it over: one array, or named inputs (a
dict of arrays, as KerasHub's text models take them), or a list or tuple
of arrays. Counted, sliced and stored alike, so that `autotune` takes what
`fit` takes."""

from __future__ import annotations

from typing import Any

import numpy as np

from mp_callbacks._validation import fail

__all__ = ["as_samples", "from_entries", "sample_count", "shapes", "take", "to_entries"]


def as_samples(owner: str, argument: str, value: Any) -> Any:
    """`value` with NumPy arrays for leaves: an array, a dict of arrays, or a
    list or tuple of arrays, all with the same number of samples."""
    if isinstance(value, dict):
        converted: Any = {key: np.asarray(leaf) for key, leaf in value.items()}
        leaves = list(converted.values())
    elif isinstance(value, (list, tuple)) and value and not np.isscalar(value[0]) and np.ndim(value[0]) > 0:
        converted = type(value)(np.asarray(leaf) for leaf in value)
        leaves = list(converted)
    else:
        converted = np.asarray(value)
        leaves = [converted]
    if not leaves or any(leaf.ndim == 0 or leaf.dtype == object for leaf in leaves):
        fail(owner, argument, type(value).__name__, "a NumPy array, or a dict, list or tuple of NumPy arrays")
    counts = {len(leaf) for leaf in leaves}
    if len(counts) != 1:
        fail(
            owner,
            argument,
            f"inputs of {sorted(counts)} samples",
            "the same number of samples in every input",
        )
    return converted


def _leaves(value: Any) -> list[np.ndarray]:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def sample_count(value: Any) -> int:
    """The number of samples in `as_samples`' result."""
    return len(_leaves(value)[0])


def shapes(value: Any) -> Any:
    """The shapes, in `value`'s structure (for messages)."""
    if isinstance(value, dict):
        return {key: leaf.shape for key, leaf in value.items()}
    if isinstance(value, (list, tuple)):
        return [leaf.shape for leaf in value]
    return value.shape


def take(value: Any, index: Any) -> Any:
    """`value[index]` in each input (`index` a slice)."""
    if isinstance(value, dict):
        return {key: leaf[index] for key, leaf in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(leaf[index] for leaf in value)
    return value[index]


def to_entries(name: str, value: Any) -> dict[str, np.ndarray]:
    """`value` as `np.savez` entries: `name`, `name.key` or `name#i`."""
    if isinstance(value, dict):
        return {f"{name}.{key}": leaf for key, leaf in value.items()}
    if isinstance(value, (list, tuple)):
        return {f"{name}#{i}": leaf for i, leaf in enumerate(value)}
    return {name: value}


def from_entries(name: str, entries: dict[str, np.ndarray]) -> Any:
    """`to_entries`' inverse (a tuple stays a list: Keras takes either)."""
    if name in entries:
        return entries[name]
    named = {key[len(name) + 1 :]: leaf for key, leaf in entries.items() if key.startswith(f"{name}.")}
    if named:
        return named
    indexed = sorted(
        (int(key[len(name) + 1 :]), leaf) for key, leaf in entries.items() if key.startswith(f"{name}#")
    )
    return [leaf for _, leaf in indexed]
