"""Built-in data and the .npz loader."""

from __future__ import annotations

import numpy as np
import pytest

from mp_callbacks.data import DatasetError, load_dataset, synthetic_digits


def test_synthetic_digits_are_deterministic_and_mnist_shaped():
    first, second = synthetic_digits(200, 50, seed=3), synthetic_digits(200, 50, seed=3)
    np.testing.assert_array_equal(first.x_train, second.x_train)
    assert first.x_train.shape == (200, 28, 28) and first.x_train.dtype == np.float32
    assert 0.0 <= first.x_train.min() and first.x_train.max() <= 1.0
    assert first.num_classes == 10 and len(np.unique(first.y_train)) == 10
    assert not np.array_equal(synthetic_digits(200, 50, seed=4).x_train, first.x_train)


def test_synthetic_digits_are_learnable_but_not_trivial():
    data = synthetic_digits(2000, 500)
    # Nearest class mean: far above chance, far from perfect.
    means = np.stack([data.x_train[data.y_train == c].mean(0) for c in range(10)])
    distances = ((data.x_test[:, None] - means[None]) ** 2).sum(axis=(2, 3))
    accuracy = (distances.argmin(1) == data.y_test).mean()
    assert 0.3 < accuracy < 0.99


def test_npz_with_uint8_images_is_scaled(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.full((4, 2, 2), 255, np.uint8), y_train=np.arange(4),
             x_test=np.zeros((2, 2, 2), np.uint8), y_test=np.arange(2))
    data = load_dataset(str(path))
    assert data.x_train.max() == 1.0 and data.num_classes == 4
    assert data.take(train=2).x_train.shape == (2, 2, 2)


def test_negative_or_float_labels_are_rejected(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.zeros((2, 3)), y_train=np.array([0.5, 1.0]),
             x_test=np.zeros((1, 3)), y_test=np.array([0]))
    with pytest.raises(DatasetError, match="non-negative integer class labels"):
        load_dataset(str(path))
