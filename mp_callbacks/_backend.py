"""Import-time checks: which Keras backend runs, and that it is one
mp_callbacks supports (TensorFlow, JAX or PyTorch).

Everything else in the package imports Keras (and, on TensorFlow, TF)
through this module, so a missing package or an unsupported backend fails
once, early, with a message that says what to install or set. On JAX and
torch, TensorFlow is never imported: `tf` is None there.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from typing import Any

_MIN_KERAS = (3, 10)
_MIN_TF = (2, 19)
#: The backends mp_callbacks runs on, in the order the docs list them.
SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


_BACKEND_HINT = (
    "Set the environment variable KERAS_BACKEND=tensorflow, KERAS_BACKEND=jax or "
    "KERAS_BACKEND=torch "
    'before importing Keras (or set "backend" in ~/.keras/keras.json).'
)


def _backend_error(backend: str) -> ImportError:
    return ImportError(
        "mp_callbacks runs on Keras's TensorFlow, JAX and PyTorch backends, but Keras is set to "
        f"the {backend!r} backend. {_BACKEND_HINT}"
    )


# Checked before importing Keras: Keras itself may fail to import on a
# backend whose packages are missing, which would hide the real cause.
def _configured_backend() -> str:
    """The backend Keras will pick: KERAS_BACKEND, else keras.json's, else
    TensorFlow (Keras's default)."""
    requested = os.environ.get("KERAS_BACKEND")
    if requested:
        return requested
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as file:
            return str(json.load(file).get("backend") or "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


_requested = _configured_backend()
if _requested and _requested not in SUPPORTED_BACKENDS:
    raise _backend_error(_requested)

tf: Any = None
if _requested == "tensorflow":
    try:
        tf = importlib.import_module("tensorflow")
    except ImportError as error:  # pragma: no cover - exercised in a bare venv only
        raise ImportError(
            "mp_callbacks needs TensorFlow (>= 2.19) as the Keras backend, and it "
            "could not be imported. Install a TensorFlow build with one of the "
            'extras: `pip install "mp_callbacks[cpu]"` (tensorflow-cpu) or '
            '`pip install "mp_callbacks[gpu]"` (tensorflow[and-cuda]); or run on '
            'JAX: `pip install "mp_callbacks[jax]"` and set KERAS_BACKEND=jax. '
            f"Original error: {error}"
        ) from error

import keras  # noqa: E402

if _version_tuple(keras.__version__) < _MIN_KERAS:  # pragma: no cover
    raise ImportError(
        f"mp_callbacks needs Keras >= 3.10; found keras {keras.__version__}. "
        "Upgrade with `pip install -U keras`."
    )

#: Keras before 3.11 ends each run of `steps_per_execution` steps with the
#: index of its first batch; 3.11 and later with that of its last.
BATCH_END_NAMES_FIRST_STEP: bool = _version_tuple(keras.__version__) < (3, 11)

#: The Keras backend in use: "tensorflow", "jax" or "torch".
BACKEND: str = keras.backend.backend()
if BACKEND not in SUPPORTED_BACKENDS:
    raise _backend_error(BACKEND)

if BACKEND == "tensorflow":
    if tf is None:  # keras.json chose TensorFlow where the environment did not
        tf = importlib.import_module("tensorflow")
    if _version_tuple(tf.__version__) < _MIN_TF:  # pragma: no cover
        raise ImportError(f"mp_callbacks needs TensorFlow >= 2.19; found {tf.__version__}.")


def counter_dtype() -> str:
    """int64 for step counters, except on JAX without x64 mode, which has
    no int64 (Keras truncates it to int32 there, with a warning)."""
    if BACKEND == "jax":
        import jax

        return "int64" if jax.config.jax_enable_x64 else "int32"
    return "int64"


def package_version() -> str:
    try:
        return importlib.metadata.version("mp_callbacks")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout
        return "0+unknown"
