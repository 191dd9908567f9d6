"""Import-time checks: mp_callbacks needs Keras 3 on the TensorFlow backend.

Everything else in the package imports TensorFlow and Keras through this
module, so a missing TensorFlow or a foreign Keras backend fails once, early,
with a message that says what to install or set.
"""

from __future__ import annotations

import importlib.metadata
import os

_MIN_KERAS = (3, 10)
_MIN_TF = (2, 19)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


_BACKEND_HINT = (
    "Set the environment variable KERAS_BACKEND=tensorflow before importing "
    'Keras (or set "backend": "tensorflow" in ~/.keras/keras.json).'
)


def _backend_error(backend: str) -> ImportError:
    return ImportError(
        "mp_callbacks needs Keras's TensorFlow backend, but Keras is set to "
        f"the {backend!r} backend. {_BACKEND_HINT}"
    )


# Checked before importing Keras: Keras itself may fail to import on a
# backend whose packages are missing, which would hide the real cause.
_requested = os.environ.get("KERAS_BACKEND")
if _requested and _requested != "tensorflow":
    raise _backend_error(_requested)

try:
    import tensorflow as tf
except ImportError as error:  # pragma: no cover - exercised in a bare venv only
    raise ImportError(
        "mp_callbacks needs TensorFlow (>= 2.19) as the Keras backend, and it "
        "could not be imported. Install a TensorFlow build with one of the "
        'extras: `pip install "mp_callbacks[cpu]"` (tensorflow-cpu) or '
        '`pip install "mp_callbacks[gpu]"` (tensorflow[and-cuda]). '
        f"Original error: {error}"
    ) from error

import keras  # noqa: E402

if _version_tuple(keras.__version__) < _MIN_KERAS:  # pragma: no cover
    raise ImportError(
        f"mp_callbacks needs Keras >= 3.10; found keras {keras.__version__}. "
        "Upgrade with `pip install -U keras`."
    )

if keras.backend.backend() != "tensorflow":
    raise _backend_error(keras.backend.backend())

if _version_tuple(tf.__version__) < _MIN_TF:  # pragma: no cover
    raise ImportError(f"mp_callbacks needs TensorFlow >= 2.19; found {tf.__version__}.")


def package_version() -> str:
    try:
        return importlib.metadata.version("mp_callbacks")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout
        return "0+unknown"
