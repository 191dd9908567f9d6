"""Data for examples, benchmarks and tests, offline by default.

`synthetic_digits` makes a learnable, MNIST-shaped data set in memory: ten
class templates built from random pen strokes, each sample shifted, thickened
and noised. `load_dataset` resolves what a user asks for: the built-in data,
Keras's MNIST (from its cache, or downloaded when asked), or an `.npz` file.
"""

from __future__ import annotations

import logging
import os
import socket
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Dataset", "DatasetError", "first_samples", "load_dataset", "load_mnist", "synthetic_digits"]

logger = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
MNIST = "mnist"
_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


class DatasetError(ValueError):
    """A data set could not be loaded; the message says why and what to do."""


@dataclass
class Dataset:
    """Arrays ready for `fit`: images as float32 in [0, 1], or named inputs
    (a dict of arrays, as KerasHub's text models take them) as stored;
    labels as int."""

    x_train: Any
    y_train: np.ndarray
    x_test: Any
    y_test: np.ndarray
    name: str
    source: str

    @property
    def description(self) -> str:
        """Where the data comes from, and how many samples are used."""
        return f"{self.source}; {len(self.y_train):,} train / {len(self.y_test):,} test samples"

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1

    @property
    def input_shape(self) -> Any:
        """A sample's shape; for named inputs, each input's, by name."""
        if isinstance(self.x_train, dict):
            return {key: tuple(leaf.shape[1:]) for key, leaf in self.x_train.items()}
        return tuple(self.x_train.shape[1:])

    def take(self, train: int | None = None, test: int | None = None) -> Dataset:
        """The first `train` / `test` samples (all when None)."""
        if train is None and test is None:
            return self
        return Dataset(
            first_samples(self.x_train, train),
            self.y_train[:train],
            first_samples(self.x_test, test),
            self.y_test[:test],
            self.name,
            self.source,
        )


def first_samples(x: Any, count: int | None) -> Any:
    """The first `count` samples of `x`, one array or named inputs (all when None)."""
    return {key: leaf[:count] for key, leaf in x.items()} if isinstance(x, dict) else x[:count]


def _strokes(rng: np.random.Generator, size: int, count: int) -> np.ndarray:
    canvas = np.zeros((size, size), np.float32)
    yy, xx = np.mgrid[0:size, 0:size]
    for _ in range(count):
        start = rng.uniform(6, size - 6, 2)
        end = rng.uniform(6, size - 6, 2)
        for t in np.linspace(0.0, 1.0, 24):
            cy, cx = start + t * (end - start)
            canvas = np.maximum(canvas, np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 2.5))
    return canvas


def synthetic_digits(
    n_train: int = 8000, n_test: int = 2000, num_classes: int = 10, seed: int = 0
) -> Dataset:
    """A learnable stand-in for MNIST, generated in memory (no download).

    28x28 grey images in ten classes. An MLP reaches well above chance in one
    epoch and keeps improving for several, so accuracy differences between
    precisions show; it is not a substitute for real data in a paper.
    """
    if n_train < 1 or n_test < 1:
        raise DatasetError(
            f"synthetic_digits needs n_train >= 1 and n_test >= 1; received "
            f"n_train={n_train}, n_test={n_test}."
        )
    size = 28
    rng = np.random.default_rng(seed)
    # Classes share two strokes and differ by one or two more, so that they
    # are confusable under shifts and noise, as handwritten digits are.
    shared = _strokes(rng, size, 2)
    templates = np.stack(
        [np.maximum(shared, _strokes(rng, size, int(rng.integers(1, 3)))) for _ in range(num_classes)]
    )

    def sample(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, num_classes, count)
        images = templates[labels]
        shifts = rng.integers(-2, 3, (count, 2))
        images = np.stack([np.roll(img, tuple(shift), axis=(0, 1)) for img, shift in zip(images, shifts)])
        images = images * rng.uniform(0.6, 1.0, (count, 1, 1))
        images = images + rng.normal(0.0, 0.35, images.shape)
        return np.clip(images, 0.0, 1.0).astype(np.float32), labels.astype(np.int64)

    x_train, y_train = sample(n_train)
    x_test, y_test = sample(n_test)
    return Dataset(
        x_train,
        y_train,
        x_test,
        y_test,
        SYNTHETIC,
        f"built-in synthetic digits (28x28, {num_classes} classes, generated offline, seed {seed})",
    )


def _mnist_cache_path() -> str:
    base = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(base, "datasets", "mnist.npz")


def load_mnist(allow_download: bool = True, timeout: float = 20.0) -> Dataset:
    """Keras's MNIST: from Keras's cache, or downloaded if `allow_download`.

    Raises:
        DatasetError: when MNIST is not cached and cannot be fetched (no
            network, or `allow_download=False`), instead of hanging.
    """
    cached = os.path.exists(_mnist_cache_path())
    if not cached and not allow_download:
        raise DatasetError(
            f"MNIST is not in Keras's cache ({_mnist_cache_path()}) and downloading was not allowed."
        )
    import keras

    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)
    try:
        (x_train, y_train), (x_test, y_test) = keras.datasets.mnist.load_data()
    except Exception as error:  # urllib, socket and file errors alike
        raise DatasetError(
            "could not download MNIST through keras.datasets.mnist "
            f"({type(error).__name__}: {error}). Use the built-in data "
            "(--dataset synthetic) or pass a local .npz file."
        ) from error
    finally:
        socket.setdefaulttimeout(previous_timeout)
    return Dataset(
        x_train.astype(np.float32) / 255.0,
        y_train.astype(np.int64),
        x_test.astype(np.float32) / 255.0,
        y_test.astype(np.int64),
        MNIST,
        "MNIST (keras.datasets.mnist" + (", from cache)" if cached else ", downloaded)"),
    )


def _load_npz(path: str) -> Dataset:
    # np.load guesses the format from the first bytes and, for anything
    # that is neither .npz nor .npy, suggests allow_pickle: unsafe advice for
    # a file that is simply not an .npz. So check the zip signature first.
    with open(path, "rb") as handle:
        signature = handle.read(4)
    if signature != b"PK\x03\x04":
        raise DatasetError(
            f"{path}: not an .npz archive (an .npz is a zip file, as written by "
            "numpy.savez; this file does not start like one)."
        )
    try:
        with np.load(path, allow_pickle=False) as archive:
            entries = {key: np.asarray(archive[key]) for key in archive.files}
    except ValueError as error:
        if "allow_pickle" in str(error):
            raise DatasetError(
                f"{path}: an array in the archive holds Python objects, which are not "
                "loaded (loading them could run code); save plain numeric arrays."
            ) from error
        raise DatasetError(f"{path}: not a readable .npz file ({error}).") from error
    except (OSError, EOFError, zipfile.BadZipFile) as error:
        raise DatasetError(f"{path}: not a readable .npz file ({error}).") from error
    arrays = _npz_arrays(path, entries)

    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        leaves = list(x.values()) if isinstance(x, dict) else [x]
        if (
            y.ndim != 1
            or len(y) == 0
            or any(len(leaf) != len(y) for leaf in leaves)
            or (not isinstance(x, dict) and x.ndim < 2)
        ):
            raise DatasetError(
                f"{path}: x_{split} must have shape (N, ...) (each named input too) and "
                f"y_{split} shape (N,) with the same N > 0; got x_{split} {_shapes(x)} and "
                f"y_{split} {y.shape}."
            )
        if not np.issubdtype(y.dtype, np.integer) or y.min() < 0:
            raise DatasetError(
                f"{path}: y_{split} must hold non-negative integer class labels; got dtype {y.dtype}."
            )
    train_shapes, test_shapes = (_sample_shapes(arrays[f"x_{split}"]) for split in ("train", "test"))
    if train_shapes != test_shapes:
        raise DatasetError(f"{path}: x_train samples {train_shapes} and x_test samples {test_shapes} differ.")
    x_train, x_test = arrays["x_train"], arrays["x_test"]
    if not isinstance(x_train, dict):  # images: float32, integers read as 0-255
        scale = 255.0 if np.issubdtype(x_train.dtype, np.integer) else 1.0
        x_train, x_test = x_train.astype(np.float32) / scale, x_test.astype(np.float32) / scale
    return Dataset(
        x_train,
        arrays["y_train"].astype(np.int64),
        x_test,
        arrays["y_test"].astype(np.int64),
        os.path.basename(path),
        f"{path} (samples of shape {train_shapes})",
    )


def _npz_arrays(path: str, entries: dict[str, np.ndarray]) -> dict[str, Any]:
    """`x_train`, `y_train`, `x_test`, `y_test` from the archive's entries;
    an `x_...` may be named inputs, stored as `x_train.<name>` (as
    `mp.autotune` stores them)."""
    found: dict[str, Any] = {}
    for key in _NPZ_KEYS:
        if key in entries:
            found[key] = entries[key]
        elif key.startswith("x_"):
            named = {k[len(key) + 1 :]: v for k, v in entries.items() if k.startswith(f"{key}.")}
            if named:
                found[key] = named
    missing = [key for key in _NPZ_KEYS if key not in found]
    if missing:
        have = ", ".join(entries) if entries else "no arrays"
        raise DatasetError(
            f"{path}: the .npz file lacks {', '.join(missing)}; it needs the arrays "
            f"{', '.join(_NPZ_KEYS)} (named inputs as x_train.<name> and x_test.<name>), "
            f"and has {have}."
        )
    return found


def _shapes(x: Any) -> Any:
    return {key: leaf.shape for key, leaf in x.items()} if isinstance(x, dict) else x.shape


def _sample_shapes(x: Any) -> Any:
    return {key: leaf.shape[1:] for key, leaf in x.items()} if isinstance(x, dict) else x.shape[1:]


def load_dataset(name: str, seed: int = 0, allow_download: bool = True) -> Dataset:
    """`"synthetic"` (built-in), `"mnist"` (Keras), or a path to an `.npz`
    with `x_train, y_train, x_test, y_test`."""
    if name == SYNTHETIC:
        return synthetic_digits(seed=seed)
    if name == MNIST:
        return load_mnist(allow_download=allow_download)
    if name.endswith(".npz") or os.path.sep in name:
        if not os.path.isfile(name):
            raise DatasetError(f"{name}: no such file.")
        return _load_npz(name)
    raise DatasetError(f"unknown dataset {name!r}: use 'synthetic', 'mnist' or a path to an .npz file.")


def mnist_or_synthetic(seed: int = 0) -> Dataset:
    """Keras's MNIST when it is already cached, else the built-in data.

    Never touches the network, so examples run offline.
    """
    try:
        return load_mnist(allow_download=False)
    except DatasetError:
        logger.info("MNIST is not cached; using the built-in synthetic digits.")
        return synthetic_digits(seed=seed)
