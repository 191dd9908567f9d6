"""Built-in data and the .npz loader."""

from __future__ import annotations

import numpy as np
import pytest

from mp_callbacks_bench.data import DatasetError, load_dataset, synthetic_digits


def test_synthetic_digits_are_deterministic_and_mnist_shaped():
    first, second = synthetic_digits(200, 50, seed=3), synthetic_digits(200, 50, seed=3)
    np.testing.assert_array_equal(first.x_train, second.x_train)
    assert first.x_train.shape == (200, 28, 28) and first.x_train.dtype == np.float32
    assert first.x_train.min() >= 0.0 and first.x_train.max() <= 1.0
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
    np.savez(
        path,
        x_train=np.full((4, 2, 2), 255, np.uint8),
        y_train=np.arange(4),
        x_test=np.zeros((2, 2, 2), np.uint8),
        y_test=np.arange(2),
    )
    data = load_dataset(str(path))
    assert data.x_train.max() == 1.0 and data.num_classes == 4
    assert data.take(train=2).x_train.shape == (2, 2, 2)


def test_negative_or_float_labels_are_rejected(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(
        path,
        x_train=np.zeros((2, 3)),
        y_train=np.array([0.5, 1.0]),
        x_test=np.zeros((1, 3)),
        y_test=np.array([0]),
    )
    with pytest.raises(DatasetError, match="non-negative integer class labels"):
        load_dataset(str(path))


def test_a_file_that_is_not_an_npz_gets_no_pickle_advice(tmp_path):
    path = tmp_path / "garbage.npz"
    path.write_bytes(b"not a zip at all")
    with pytest.raises(DatasetError) as caught:
        load_dataset(str(path))
    assert str(caught.value) == (
        f"{path}: not an .npz archive (an .npz is a zip file, as written by numpy.savez; "
        "this file does not start like one)."
    )
    assert "pickle" not in str(caught.value)


def test_a_truncated_npz_is_not_readable(tmp_path):
    whole = tmp_path / "whole.npz"
    np.savez(whole, x_train=np.zeros((4, 3)))
    cut = tmp_path / "cut.npz"
    cut.write_bytes(whole.read_bytes()[:60])
    with pytest.raises(DatasetError, match=r"cut.npz: not a readable .npz file \("):
        load_dataset(str(cut))


def test_missing_arrays_are_listed_with_those_the_file_has(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, images=np.zeros((4, 3)), x_train=np.zeros((4, 3)))
    with pytest.raises(DatasetError) as caught:
        load_dataset(str(path))
    assert str(caught.value) == (
        f"{path}: the .npz file lacks y_train, x_test, y_test; it needs the arrays x_train, "
        "y_train, x_test, y_test (named inputs as x_train.<name> and x_test.<name>), and has images, x_train."
    )


def test_object_arrays_are_refused_without_loading_them(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(
        path,
        x_train=np.array([{}, 1], dtype=object),
        y_train=np.zeros(2, int),
        x_test=np.zeros((2, 2)),
        y_test=np.zeros(2, int),
    )
    with pytest.raises(DatasetError, match="holds Python objects, which are not loaded"):
        load_dataset(str(path))


def test_description_gives_the_sample_counts_once():
    data = synthetic_digits(200, 50).take(train=100)
    assert data.description == (
        "built-in synthetic digits (28x28, 10 classes, generated offline, "
        "seed 0); 100 train / 50 test samples"
    )
