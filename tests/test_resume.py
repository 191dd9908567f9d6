"""Crash-safe resume: an interrupted run ends exactly like an uninterrupted one,
loss-scale state included."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import classification_data, tiny_classifier

import mp_callbacks as mp

# Its module-scoped fixtures are built once: the whole file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_resume")

EPOCHS = 4
X, LABELS = classification_data(n=64)
# Large targets make early steps overflow at a huge scale; growth every 3
# clean steps then pushes the scale back into overflow now and then, so the
# scale, its counters and the skipped steps all move during the run.
TARGETS = (np.eye(3, dtype="float32")[LABELS] * 40.0).astype("float32")
FIT = {"epochs": EPOCHS, "batch_size": 8, "shuffle": False, "verbose": 0}


def _model():
    model = tiny_classifier(
        seed=11, loss_scale=mp.LossScaler(initial_scale=2.0**126, max_scale=2.0**127, growth_interval=3)
    )
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


class Crash(keras.callbacks.Callback):
    """Raises in the middle of an epoch, as a killed job would stop."""

    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.epoch, self.batch, self.current = epoch, batch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == self.batch:
            raise RuntimeError("simulated crash")


@pytest.fixture(scope="module")
def uninterrupted():
    model = _model()
    history = model.fit(X, TARGETS, **FIT).history
    assert sum(history["skipped_steps"]) > 0  # the state really moves
    return model


def _assert_same_run(model, reference):
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    assert model.scaler.diagnostics() == reference.scaler.diagnostics()
    assert model.nonfinite_gradient_counts() == reference.nonfinite_gradient_counts()
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


def test_backup_and_restore_resumes_with_the_same_loss_scale(tmp_path, uninterrupted):
    model = _model()
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(
            X, TARGETS, callbacks=[keras.callbacks.BackupAndRestore(backup), Crash(epoch=2, batch=3)], **FIT
        )
    # The crashed model object holds a half-finished epoch 2; resuming must
    # overwrite all of it, loss-scale state included, from the epoch-1 backup.
    assert model.scaler.diagnostics() != uninterrupted.scaler.diagnostics()
    history = model.fit(X, TARGETS, callbacks=[keras.callbacks.BackupAndRestore(backup)], **FIT).history
    assert len(history["loss"]) == 2  # epochs 3 and 4 (indices 2, 3) run again from the epoch-2 backup
    _assert_same_run(model, uninterrupted)


def test_resume_in_a_new_process_like_model(tmp_path, uninterrupted):
    backup = str(tmp_path / "backup")
    crashed = _model()
    with pytest.raises(RuntimeError):
        crashed.fit(
            X, TARGETS, callbacks=[keras.callbacks.BackupAndRestore(backup), Crash(epoch=1, batch=0)], **FIT
        )
    fresh = _model()  # built from scratch, as after a restart
    fresh.fit(X, TARGETS, callbacks=[keras.callbacks.BackupAndRestore(backup)], **FIT)
    _assert_same_run(fresh, uninterrupted)


def test_model_checkpoint_weights_and_initial_epoch(tmp_path, uninterrupted):
    path = str(tmp_path / "ckpt.weights.h5")
    first = _model()
    first.fit(
        X,
        TARGETS,
        callbacks=[keras.callbacks.ModelCheckpoint(path, save_weights_only=True)],
        **{**FIT, "epochs": 2},
    )
    second = _model()
    second.load_weights(path)
    assert second.get_scale() == first.get_scale()
    second.fit(X, TARGETS, initial_epoch=2, **FIT)
    _assert_same_run(second, uninterrupted)


def test_weights_files_keep_a_plain_optimizers_layout_when_the_model_wraps_it(tmp_path):
    # A model that scales trains through a LossScaleOptimizer; its weights
    # files still load into the same model without one, slots included.
    x, y = classification_data(n=32)
    scaled = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=8.0))
    scaled.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    assert isinstance(scaled.optimizer, mp.LossScaleOptimizer)
    scaled.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / "scaled.weights.h5")
    scaled.save_weights(path)
    plain = tiny_classifier(loss_scale=None)
    plain.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    assert not isinstance(plain.optimizer, keras.optimizers.LossScaleOptimizer)
    plain.load_weights(path)
    assert int(plain.optimizer.iterations.numpy()) == 4
    for ours, theirs in zip(plain.optimizer.variables, scaled.optimizer.variables):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    again = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=2.0))
    again.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    again.load_weights(path)
    assert again.get_scale() == 8.0 and int(again.optimizer.iterations.numpy()) == 4
