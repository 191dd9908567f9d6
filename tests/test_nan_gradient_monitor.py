"""NaNGradientMonitor: handled overflow vs divergence, culprits, actions."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import classification_data, poisoned_model, tiny_classifier

import mp_callbacks as mp


def test_raise_names_the_poisoned_layer_and_nothing_else():
    x, y = classification_data(n=32)
    model = poisoned_model()
    with pytest.raises(mp.NonFiniteGradientError) as caught:
        model.fit(
            x,
            y,
            epochs=3,
            batch_size=8,
            verbose=0,
            callbacks=[mp.NaNGradientMonitor(patience=2, action="raise", check_every=1)],
        )
    error = caught.value
    assert error.variables == ["poisoned/kernel"]
    assert error.origin == "poisoned"
    assert error.step == 2 and error.scale == 1.0
    message = str(error)
    assert "poisoned/kernel" in message and "'poisoned'" in message
    assert "clean" not in message and "head" not in message
    assert "by step 2" in message and "loss scale 1" in message


def test_stop_ends_training_like_terminate_on_nan():
    x, y = classification_data(n=32)
    model = poisoned_model()
    monitor = mp.NaNGradientMonitor(patience=3, action="stop", check_every=1)
    history = model.fit(x, y, epochs=3, batch_size=8, verbose=0, callbacks=[monitor])
    assert model.stop_training
    assert len(history.history["loss"]) == 1
    assert monitor.error is not None and monitor.error.origin == "poisoned"
    assert monitor.error.step == 3


def test_warn_keeps_training_and_counts():
    x, y = classification_data(n=32)
    model = poisoned_model()
    monitor = mp.NaNGradientMonitor(patience=2, action="warn", check_every=100)
    with pytest.warns(mp.MixedPrecisionWarning, match="poisoned/kernel"):
        history = model.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[monitor])
    assert len(history.history["loss"]) == 2
    assert history.history["skipped_steps"] == [4.0, 4.0]
    assert monitor.skipped_steps == 8


def test_overflow_handled_by_scaling_is_not_divergence():
    x, y = classification_data(n=32)
    # Scale 16 backs off 16 -> 8 -> 4 -> 2 -> 1 in four skipped steps: loss
    # scaling is handling those. At the floor, skips become divergence.
    model = poisoned_model(mp.LossScaler(initial_scale=16.0, min_scale=1.0))
    monitor = mp.NaNGradientMonitor(patience=3, action="stop", check_every=1)
    model.fit(x, y, epochs=3, batch_size=8, verbose=0, callbacks=[monitor])
    assert monitor.handled_steps == 4
    assert monitor.error is not None
    assert monitor.error.step == 4 + 1 + 3 - 1  # 4 handled, then 3 at the floor (the first backs off to 1)
    assert "minimum" in str(monitor.error)


def test_healthy_training_reads_the_device_only_every_check_every_steps():
    x, y = classification_data(n=64)
    model = tiny_classifier()
    model.compile("adam", "sparse_categorical_crossentropy")
    reads = []
    original = model.scaler.diagnostics
    model.scaler.diagnostics = lambda: reads.append(1) or original()
    monitor = mp.NaNGradientMonitor(check_every=5)
    history = model.fit(x, y, epochs=2, batch_size=4, verbose=0, callbacks=[monitor])
    # 32 steps: one read at train begin, at steps 5,10,15 / 21,26,31 and 2 epoch ends.
    assert len(reads) == 1 + 6 + 2
    assert monitor.error is None and monitor.skipped_steps == 0
    assert history.history["skipped_steps"] == [0.0, 0.0]


def test_stock_model_watches_the_loss():
    x, y = classification_data(n=16)
    x[:] = np.nan
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    monitor = mp.NaNGradientMonitor(action="stop", check_every=1)
    model.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[monitor])
    assert monitor.error is not None and monitor.error.origin is None
    assert "loss was non-finite" in str(monitor.error)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"patience": 0}, "patience"), ({"action": "halt"}, "action"), ({"check_every": 0}, "check_every")],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`.*{name}="):
        mp.NaNGradientMonitor(**kwargs)


def test_origin_is_the_culprit_nearest_the_loss_when_several_are_bad():
    from helpers import NaNGradientDense

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = NaNGradientDense(4, name="early")(inputs)
    hidden = keras.layers.Dense(4, name="middle")(hidden)
    hidden = NaNGradientDense(4, name="late")(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=None)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = classification_data(n=16)
    monitor = mp.NaNGradientMonitor(patience=1, action="stop", check_every=1)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert monitor.error.variables == ["early/kernel", "late/kernel"]
    assert monitor.error.origin == "late"


def test_stock_model_loss_only_counts_consecutive_checks():
    # Keras's batch logs carry the epoch's running mean loss: once a NaN
    # batch is in, every later check of that epoch sees a NaN loss.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    x, _ = classification_data(n=32)
    y = np.zeros((32, 2), "float32")
    clean = model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[monitor := mp.NaNGradientMonitor(patience=2, action="stop", check_every=1)],
    )
    assert monitor.error is None and len(clean.history["loss"]) == 1
    y_bad = y.copy()
    y_bad[16:] = np.nan  # the last two of the fit's eight batches
    data = (np.concatenate([x, x]), np.concatenate([y, y_bad]))
    model.fit(*data, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    error = monitor.error
    assert error is not None and error.step == 8  # NaN from step 7; the second check in a row
    assert error.variables == [] and error.origin is None and error.scale is None
    assert "the loss was non-finite for at least 2 consecutive step(s)" in str(error)
    assert "No gradient was non-finite at the checks; the loss itself was." in str(error)


def test_without_a_kept_batch_the_origin_is_the_culprit_nearest_the_loss():
    # Under jit_compile a batch of unknown shape (tf.data's) is not kept:
    # the variable-based diagnosis names the layer of the last culprit in
    # forward order.
    from helpers import NaNGradientDense

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = NaNGradientDense(4, name="early")(inputs)
    hidden = NaNGradientDense(4, name="late")(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=None)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    x, y = classification_data(n=16)
    monitor = mp.NaNGradientMonitor(patience=1, action="stop", check_every=1)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0, callbacks=[monitor])
    assert model.kept_batch() is None
    assert "shapes are not static" in model.kept_batch_note()
    assert monitor.error.report is None
    assert monitor.error.variables == ["early/kernel", "late/kernel"]
    assert monitor.error.origin == "late"
    assert "most likely origin: layer 'late' (nearest the loss)" in str(monitor.error)


def _stock_regression():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    return model


def test_a_step_is_judged_once_even_when_an_epoch_ends_on_it():
    # One NaN step, the epoch's last: patience 2 must not count it twice
    # (once at its batch check, once at the epoch end).
    x, _ = classification_data(n=32)
    y = np.zeros((32, 2), "float32")
    y[24:] = np.nan
    model = _stock_regression()
    lenient = mp.NaNGradientMonitor(patience=2, action="stop", check_every=1)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[lenient])
    assert lenient.error is None
    strict = mp.NaNGradientMonitor(patience=1, action="stop", check_every=1)
    model = _stock_regression()  # a stock model applied the NaN step: start afresh
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[strict])
    assert strict.error is not None and strict.error.step == 4
    strict.on_epoch_end(0)  # Keras always passes logs; a direct call must not fail


def test_a_non_finite_loss_with_finite_layer_outputs_points_at_the_labels():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(2, name="head")(inputs)
    model = mp.MixedPrecisionModel(inputs, outputs, loss_scale=None)
    model.compile("sgd", "mse")
    x, _ = classification_data(n=8)
    y = np.zeros((8, 2), "float32")
    y[3, 1] = np.nan
    monitor = mp.NaNGradientMonitor(patience=1, action="stop", check_every=1)
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert monitor.error.origin == "loss"
    assert (
        "Every layer output of the replayed batch is finite but the loss is not: "
        "check the labels and the loss function."
    ) in str(monitor.error)


def test_layer_of_a_variable_path():
    from mp_callbacks.nan_gradient_monitor import _layer_of

    assert _layer_of("outer/inner/kernel") == "outer/inner"
    assert _layer_of("kernel") == "kernel"


# ---------------------------------- every hook, on a driven loss-scale state
def _driven(paths=("a/kernel", "b/kernel", "c/kernel"), **monitor_args):
    """A monitor on a stand-in model whose LossScaler state the test
    sets step by step (set_state), so each check's arithmetic is exact."""
    import types

    loss_scale = mp.LossScaler(initial_scale=4.0, min_scale=1.0)
    loss_scale.build([types.SimpleNamespace(path=p) for p in paths])
    model = types.SimpleNamespace(name="driven", loss_scale=loss_scale, stop_training=False)
    monitor = mp.NaNGradientMonitor(**monitor_args)
    monitor.set_model(model)
    return monitor, loss_scale, model


def _state(loss_scale, counts=(0, 0, 0), **values):
    # Each new state is at least one more step through the loss scale.
    values.setdefault("step_count", loss_scale.diagnostics()["step_count"] + 1)
    state = {"nonfinite_counts": np.array(counts, np.int64), **values}
    loss_scale.set_state(state)


def test_counts_per_check_and_per_epoch_are_exact():
    monitor, loss_scale, _ = _driven(check_every=2)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    monitor.on_train_batch_end(0)
    _state(loss_scale, (0, 2, 0), skipped_steps=2, step_count=2)
    monitor.on_train_batch_end(1)  # step 2: a check
    assert (monitor.skipped_steps, monitor.handled_steps) == (2, 2)
    logs = {}
    monitor.on_epoch_end(0, logs)
    assert logs == {"skipped_steps": 2.0}
    monitor.on_epoch_begin(1)
    _state(loss_scale, (0, 5, 0), skipped_steps=5, step_count=3)
    monitor.on_train_batch_end(0)
    logs = {}
    monitor.on_epoch_end(1, logs)
    assert logs == {"skipped_steps": 3.0}  # this epoch's, not the total
    assert (monitor.skipped_steps, monitor.handled_steps) == (5, 5)
    monitor.on_epoch_begin(2)
    monitor.on_epoch_end(2, None)  # logs=None is allowed
    assert monitor.error is None


def test_reason_follows_what_diverged_at_each_check():
    monitor, loss_scale, _ = _driven(action="warn", check_every=1)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    _state(
        loss_scale,
        scale=1.0,
        skipped_steps=1,
        nonfinite_loss_steps=1,
        divergent_steps=1,
        divergent_run=1,
        max_divergent_run=1,
    )
    with pytest.warns(mp.MixedPrecisionWarning) as caught:
        monitor.on_train_batch_end(0)
    assert "step 1: the loss was non-finite" in str(caught[0].message)
    # Step 2: the loss is finite again, a gradient is not, at the minimum scale.
    _state(
        loss_scale,
        (0, 0, 1),
        scale=1.0,
        skipped_steps=2,
        nonfinite_loss_steps=1,
        divergent_steps=2,
        divergent_run=2,
        max_divergent_run=2,
    )
    with pytest.warns(mp.MixedPrecisionWarning) as caught:
        monitor.on_train_batch_end(1)
    assert "step 2: gradients were non-finite with the loss scale at its minimum (1)" in str(
        caught[0].message
    )
    assert monitor.error.variables == ["c/kernel"]


def test_a_step_number_counts_an_empty_epoch_as_no_steps():
    monitor, loss_scale, _ = _driven(action="warn", check_every=100)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    monitor.on_epoch_end(0, {})  # an epoch with no step
    monitor.on_epoch_begin(1)
    for batch in range(3):
        monitor.on_train_batch_end(batch)
    _state(
        loss_scale,
        (1, 1, 1),
        scale=1.0,
        skipped_steps=1,
        divergent_steps=1,
        divergent_run=1,
        max_divergent_run=1,
    )
    with pytest.warns(mp.MixedPrecisionWarning, match=r"Training diverged by step 3: "):
        monitor.on_epoch_end(1, {})


def test_without_a_kept_batch_the_origin_is_the_last_of_several_culprits():
    monitor, loss_scale, _ = _driven(action="warn", check_every=1)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    _state(
        loss_scale,
        (1, 1, 1),
        scale=1.0,
        skipped_steps=1,
        divergent_steps=1,
        divergent_run=1,
        max_divergent_run=1,
    )
    with pytest.warns(mp.MixedPrecisionWarning):
        monitor.on_train_batch_end(0)
    assert monitor.error.origin == "c"  # nearest the loss of a, b, c
    assert monitor.error.variables == ["a/kernel", "b/kernel", "c/kernel"]


def test_a_stock_model_is_judged_on_the_epoch_end_loss():
    import types

    model = types.SimpleNamespace(name="stock", stop_training=False)
    monitor = mp.NaNGradientMonitor(check_every=100)
    monitor.set_model(model)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    monitor.on_train_batch_end(0, {"loss": 1.0})
    monitor.on_epoch_end(0, {"loss": float("nan")})
    assert model.stop_training is True
    assert monitor.error.variables == [] and monitor.error.origin is None
    assert str(monitor.error) == (
        "Training diverged by step 1: the loss was non-finite for at least 1 consecutive step(s). "
        "No gradient was non-finite at the checks; the loss itself was."
    )


def test_defaults():
    monitor = mp.NaNGradientMonitor()
    assert monitor.get_config() == {"patience": 1, "action": "stop", "check_every": 200}
    assert monitor.error is None and (monitor.skipped_steps, monitor.handled_steps) == (0, 0)


def test_culprits_are_the_variables_whose_count_grew_since_the_last_check():
    monitor, loss_scale, _ = _driven(action="warn", check_every=1)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    _state(loss_scale, (1, 0, 0), scale=2.0, skipped_steps=1)  # handled overflow in a
    monitor.on_train_batch_end(0)
    assert monitor.error is None and monitor.handled_steps == 1
    _state(
        loss_scale,
        (1, 1, 0),
        scale=1.0,
        skipped_steps=2,
        divergent_steps=1,
        divergent_run=1,
        max_divergent_run=1,
    )
    with pytest.warns(mp.MixedPrecisionWarning):
        monitor.on_train_batch_end(1)
    assert monitor.error.variables == ["b/kernel"] and monitor.error.origin == "b"
    assert (monitor.skipped_steps, monitor.handled_steps) == (2, 1)


def test_divergence_without_loss_scaling_says_so():
    import types

    loss_scale = mp.LossScaler.disabled()
    loss_scale.build([types.SimpleNamespace(path="a/kernel")])
    model = types.SimpleNamespace(name="unscaled", loss_scale=loss_scale, stop_training=False)
    monitor = mp.NaNGradientMonitor(action="stop", check_every=1)
    monitor.set_model(model)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    _state(loss_scale, (1,), skipped_steps=1, divergent_steps=1, divergent_run=1, max_divergent_run=1)
    monitor.on_train_batch_end(0)
    assert model.stop_training is True
    assert str(monitor.error).startswith(
        "Training diverged by step 1: gradients were non-finite and no loss scaling is active "
        "for at least 1 consecutive step(s); loss scale 1. "
    )


def test_a_stock_model_needs_patience_consecutive_non_finite_losses():
    import types

    model = types.SimpleNamespace(name="stock", stop_training=False)
    monitor = mp.NaNGradientMonitor(patience=2, check_every=1)
    monitor.set_model(model)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    monitor.on_train_batch_end(0, {"loss": float("nan")})
    assert monitor.error is None and model.stop_training is False
    monitor.on_train_batch_end(1, {"loss": float("inf")})
    assert model.stop_training is True and "for at least 2 consecutive" in str(monitor.error)
