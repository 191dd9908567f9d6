"""LossScaleMonitor on MixedPrecisionModel, stock Keras with
LossScaleOptimizer, and models without loss scaling."""

from __future__ import annotations

import logging
import warnings

import keras
import numpy as np
import pytest
from helpers import classification_data, overflowing_classifier, poisoned_model, tiny_classifier

import mp_callbacks as mp


def test_stock_model_with_keras_loss_scale_optimizer():
    x, _ = classification_data(n=32)
    targets = np.full((32, 3), 100.0, "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(1e-4), initial_scale=2.0**127)
    model.compile(optimizer, "mse")
    monitor = mp.LossScaleMonitor(max_skipped_fraction=1.0)
    history = model.fit(x, targets, epochs=2, batch_size=4, callbacks=[monitor], verbose=0).history
    scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    assert history["loss_scale"][-1] == scale < 2.0**127
    applied = int(optimizer.iterations.numpy())
    assert sum(history["skipped_steps"]) == 16 - applied > 0


def test_reports_one_and_says_so_once_without_loss_scaling(caplog):
    x, y = classification_data(n=16)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    with caplog.at_level(logging.INFO, logger="mp_callbacks"):
        history = model.fit(
            x, y, epochs=2, batch_size=8, callbacks=[mp.LossScaleMonitor()], verbose=0
        ).history
    assert history["loss_scale"] == [1.0, 1.0]
    messages = [r.getMessage() for r in caplog.records if "no loss scaling is active" in r.getMessage()]
    assert len(messages) == 1


def test_warns_when_the_scale_collapses_and_steps_are_skipped():
    x, y = classification_data(n=32)
    model = poisoned_model(mp.LossScaler(initial_scale=4.0, min_scale=1.0))
    with pytest.warns(mp.MixedPrecisionWarning) as caught:
        model.fit(x, y, epochs=2, batch_size=8, verbose=0, callbacks=[mp.LossScaleMonitor()])
    messages = [str(w.message) for w in caught]
    collapse = [m for m in messages if "collapsed" in m]
    skipped = [m for m in messages if "were skipped" in m]
    assert len(collapse) == 1  # once, when it happens, not every epoch
    assert "its minimum 1" in collapse[0] and "Try:" in collapse[0]
    assert len(skipped) == 2 and "4 of 4 steps (100%)" in skipped[0]
    assert "hysteresis" in skipped[0]


def test_collapse_threshold_warns_above_the_minimum():
    x, y = classification_data(n=16)
    model = poisoned_model(mp.LossScaler(initial_scale=64.0, min_scale=1.0))
    monitor = mp.LossScaleMonitor(collapse_threshold=32.0, max_skipped_fraction=1.0)
    with pytest.warns(mp.MixedPrecisionWarning, match=r"collapsed to 16 \(below 32\)"):
        model.fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[monitor])


def test_healthy_training_raises_no_warning(recwarn):
    x, y = classification_data(n=32)
    model = tiny_classifier(loss_scale=mp.LossScaler(initial_scale=256.0))
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(
        x, y, epochs=2, batch_size=8, verbose=0, callbacks=[mp.LossScaleMonitor(max_skipped_fraction=0.0)]
    )
    assert not [w for w in recwarn if issubclass(w.category, mp.MixedPrecisionWarning)]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"collapse_threshold": -1.0}, "collapse_threshold"),
        ({"max_skipped_fraction": 1.5}, "max_skipped_fraction"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`.*{name}="):
        mp.LossScaleMonitor(**kwargs)


def _scale_model(**scale_kwargs):
    # NaN input rows overflow the gradients with a finite loss, on every CPU.
    model = overflowing_classifier(loss_scale=mp.LossScaler(**scale_kwargs))
    model.compile("sgd", "sparse_categorical_crossentropy")
    return model


def test_every_n_steps_records_exact_steps_and_epochs_across_fits():
    x, y = classification_data(n=32)
    model = _scale_model(initial_scale=8.0, growth_interval=3)
    monitor = mp.LossScaleMonitor(every_n_steps=3)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])  # 4 steps an epoch
    # Growth after steps 3 and 6 (8 -> 16 -> 32); records every 3 steps and at epoch ends.
    assert [(r["epoch"], r["step"], r["loss_scale"]) for r in monitor.history] == [
        (0, 3, 16.0),
        (0, 4, 16.0),
        (1, 6, 32.0),
        (1, 8, 32.0),
    ]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[monitor])
    # good_steps carries over (2 at the end of the first fit): growth at this
    # fit's steps 1 and 4. Steps count from 1 again, as epochs do.
    assert [(r["epoch"], r["step"], r["loss_scale"]) for r in monitor.history] == [
        (0, 3, 64.0),
        (0, 4, 128.0),
    ]
    monitor.on_epoch_end(0)  # Keras always passes logs; a direct call must not fail


def test_collapse_seen_at_an_inner_read_is_reported_at_epoch_end():
    # Steps 1-2 overflow (4 -> 2 -> 1, the floor), step 3 grows to 2 and is
    # read (every 3 steps); the scale then grows on: only the inner read saw 1.
    x, y = classification_data(n=64)
    x[:16] = np.nan
    model = _scale_model(initial_scale=4.0, growth_interval=1, min_scale=1.0)
    monitor = mp.LossScaleMonitor(every_n_steps=3, max_skipped_fraction=1.0)
    with pytest.warns(mp.MixedPrecisionWarning, match=r"collapsed to 1 \(its minimum 1\) during epoch 1"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    assert monitor.history[0] == {"epoch": 0, "step": 3, "loss_scale": 2.0}


def test_collapse_threshold_is_strict():
    x, y = classification_data(n=16)
    x[:8] = np.nan
    model = _scale_model(initial_scale=4.0, min_scale=1.0)
    monitor = mp.LossScaleMonitor(collapse_threshold=2.0, max_skipped_fraction=1.0)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor])
    assert model.get_scale() == 2.0  # one backoff: at the threshold, not below it
    assert not [w for w in caught if "collapsed" in str(w.message)]
    monitor_below = mp.LossScaleMonitor(collapse_threshold=2.5, max_skipped_fraction=1.0)
    model2 = _scale_model(initial_scale=4.0, min_scale=1.0)
    with pytest.warns(mp.MixedPrecisionWarning, match=r"collapsed to 2 \(below 2.5\)"):
        model2.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor_below])


def test_skipped_fraction_warning_is_strictly_above_the_limit():
    x, y = classification_data(n=32)
    x[8:16] = np.nan  # 1 of 4 steps skipped, after an applied one: 25 %
    import warnings

    for limit, warns in ((0.25, False), (0.24, True)):
        model = _scale_model(initial_scale=4.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(
                x,
                y,
                batch_size=8,
                epochs=1,
                verbose=0,
                shuffle=False,
                callbacks=[mp.LossScaleMonitor(max_skipped_fraction=limit)],
            )
        messages = [str(w.message) for w in caught if "were skipped" in str(w.message)]
        assert bool(messages) == warns
        if warns:
            assert messages[0].startswith("1 of 4 steps (25%) were skipped in epoch 1")


def test_keras_loss_scale_optimizer_skips_are_counted_per_epoch():
    x, _ = classification_data(n=16)
    x = np.concatenate([x, x])
    x[[3, 11, 19, 27]] = np.nan  # one bad sample in each 8-sample batch of epoch... per epoch: 2 of 4
    targets = np.zeros((32, 3), "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=2.0**10)
    model.compile(optimizer, "mse")
    # 12 halvings from 1024: below 1 by epoch 3, which the monitor reports.
    with pytest.warns(
        mp.MixedPrecisionWarning, match=r"collapsed to 0.25 \(at or below 1\) by the end of epoch 3"
    ):
        history = model.fit(
            x,
            targets,
            epochs=3,
            batch_size=8,
            shuffle=False,
            verbose=0,
            callbacks=[mp.LossScaleMonitor(max_skipped_fraction=1.0)],
        ).history
    assert history["skipped_steps"] == [4.0, 4.0, 4.0]
    assert int(optimizer.iterations.numpy()) == 0


def test_unscaled_stock_model_gets_no_skipped_steps_entry():
    x, y = classification_data(n=16)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[mp.LossScaleMonitor()]).history
    assert "skipped_steps" not in history and history["loss_scale"] == [1.0]


def test_a_collapse_before_this_fit_is_not_reported_and_one_at_epoch_end_names_the_epoch():
    import warnings

    x, y = classification_data(n=32)
    bad = x.copy()
    bad[:] = np.nan
    model = _scale_model(initial_scale=4.0, growth_interval=1, min_scale=1.0)
    model.fit(bad[:16], y[:16], batch_size=8, verbose=0)  # 4 -> 2 -> 1, no monitor attached
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[mp.LossScaleMonitor()])
    assert model.get_scale() == 16.0
    assert not [w for w in caught if "collapsed" in str(w.message)]
    data = np.concatenate([x, bad]), np.concatenate([y, y])
    model2 = _scale_model(initial_scale=4.0, growth_interval=100, min_scale=1.0)  # 4 -> 2 -> 1
    with pytest.warns(
        mp.MixedPrecisionWarning, match=r"collapsed to 1 \(its minimum 1\) by the end of epoch 2"
    ):
        model2.fit(
            *data,
            batch_size=32,
            epochs=2,
            verbose=0,
            shuffle=False,
            callbacks=[mp.LossScaleMonitor(max_skipped_fraction=1.0)],
        )


# ------------------------------- every hook, on a driven loss-scale state
def _driven_monitor(**monitor_args):
    import types

    loss_scale = mp.LossScaler(initial_scale=1024.0, min_scale=1.0)
    model = types.SimpleNamespace(name="driven", loss_scale=loss_scale)
    monitor = mp.LossScaleMonitor(**monitor_args)
    monitor.set_model(model)
    return monitor, loss_scale


def test_every_step_is_recorded_with_every_n_steps_one_and_an_empty_epoch_adds_no_step():
    monitor, loss_scale = _driven_monitor(every_n_steps=1)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    for batch, scale in enumerate((1024.0, 512.0)):
        loss_scale.set_state({"scale": scale})
        monitor.on_train_batch_end(batch)
    monitor.on_epoch_end(0, {})
    monitor.on_epoch_begin(1)
    monitor.on_epoch_end(1, {})  # no step in this epoch
    monitor.on_epoch_begin(2)
    loss_scale.set_state({"scale": 256.0})
    monitor.on_train_batch_end(0)
    logs = {}
    monitor.on_epoch_end(2, logs)
    assert monitor.history == [
        {"epoch": 0, "step": 1, "loss_scale": 1024.0},
        {"epoch": 0, "step": 2, "loss_scale": 512.0},
        {"epoch": 1, "step": 2, "loss_scale": 512.0},
        {"epoch": 2, "step": 3, "loss_scale": 256.0},
    ]
    assert logs == {"loss_scale": 256.0, "skipped_steps": 0.0}  # from the scale's counters


def test_keras_optimizer_skips_are_counted_per_epoch_when_some_steps_apply():
    x, _ = classification_data(n=16)
    x = np.concatenate([x, x])
    x[[19, 27]] = np.nan  # epoch data: 4 batches of 8; batches 2 and 3 hold a NaN
    targets = np.zeros((32, 3), "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=2.0**10)
    model.compile(optimizer, "mse")
    history = model.fit(
        x,
        targets,
        epochs=3,
        batch_size=8,
        shuffle=False,
        verbose=0,
        callbacks=[mp.LossScaleMonitor(max_skipped_fraction=1.0)],
    ).history
    # 2 of 4 steps skipped in every epoch: each epoch counts its own.
    assert history["skipped_steps"] == [2.0, 2.0, 2.0]
    assert int(optimizer.iterations.numpy()) == 6


def test_a_skipped_steps_entry_already_in_the_logs_is_kept():
    import types

    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0)
    model = types.SimpleNamespace(
        name="custom", optimizer=optimizer, dtype_policy=keras.DTypePolicy("float32")
    )
    monitor = mp.LossScaleMonitor(max_skipped_fraction=1.0)
    monitor.set_model(model)
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    monitor.on_train_batch_end(0)
    # The optimizer applied no step, so the monitor would count 1 skipped;
    # the model's own count says 0 and is kept.
    logs = {"skipped_steps": 0.0}
    monitor.on_epoch_end(0, logs)
    assert logs == {"skipped_steps": 0.0, "loss_scale": 8.0}


def test_calibrating_down_from_initial_scale_is_not_warned_about_but_recorded(caplog):
    x, _ = classification_data(n=32)
    targets = np.full((32, 1), 1e4, "float32")
    # Gradients of about 1e4 times 2**120 overflow float32 on the first
    # step; at 2**20 it trains.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    model = mp.MixedPrecisionModel(
        inputs,
        keras.layers.Dense(1)(inputs),
        loss_scale=mp.LossScaler(initial_scale=2.0**120, backoff_factor=2.0**-100, max_scale=2.0**120),
    )
    model.compile(keras.optimizers.SGD(1e-6), "mse")
    monitor = mp.LossScaleMonitor(every_n_steps=1)
    import warnings

    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, "mp_callbacks"):
        warnings.simplefilter("always")
        history = model.fit(
            x, targets, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[monitor]
        ).history
    assert history["skipped_steps"] == [1.0]  # still in the logs
    assert not [w for w in caught if "were skipped" in str(w.message)]
    assert [r["loss_scale"] for r in monitor.history][:2] == [2.0**20, 2.0**20]
    assert model.scaler.diagnostics()["calibration_steps"] == 1
    assert any("came down from its initial_scale" in r.getMessage() for r in caplog.records)
    # A bad batch is not calibration, even first: its loss is not finite.
    model = _scale_model(initial_scale=4.0)
    x_bad = x.copy()
    x_bad[:8] = np.inf
    _, y = classification_data(n=32)
    with pytest.warns(mp.MixedPrecisionWarning, match="1 of 4 steps"):
        model.fit(
            x_bad, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[mp.LossScaleMonitor()]
        )
    assert model.scaler.diagnostics()["calibration_steps"] == 0


def test_keras_own_optimizer_skips_are_advised_as_keras_scale_not_as_no_scale():
    x, _ = classification_data(n=32)
    targets = np.full((32, 3), 100.0, "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(1e-4), initial_scale=2.0**127)
    model.compile(optimizer, "mse")
    with pytest.warns(mp.MixedPrecisionWarning) as caught:
        model.fit(x, targets, epochs=1, batch_size=4, callbacks=[mp.LossScaleMonitor()], verbose=0)
    skipped = [str(w.message) for w in caught if "were skipped" in str(w.message)]
    assert len(skipped) == 1
    assert "Keras's LossScaleOptimizer halves its scale" in skipped[0]
    assert "No loss scale is in use" not in skipped[0]


@pytest.mark.parametrize(
    "wrapped", [False, True], ids=["keras-loss-scale-optimizer", "mixed-precision-model"]
)
def test_steps_per_execution_that_does_not_divide_the_epoch_counts_each_step_once(wrapped):
    # 8 batches in executions of 3: Keras ends the last, two-step execution
    # at batch index 8, as if it had run three.
    keras.config.set_dtype_policy("mixed_float16")  # conftest restores the policy
    x, y = classification_data(n=256)
    model = tiny_classifier(cls=None if wrapped else keras.Model)
    model.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=3)
    monitor, timer = mp.LossScaleMonitor(), mp.EpochTimer(batch_size=32)
    nan_monitor = mp.NaNGradientMonitor()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mp.MixedPrecisionWarning)
        history = model.fit(
            x, y, epochs=2, batch_size=32, verbose=0, callbacks=[monitor, timer, nan_monitor]
        ).history
    assert history["skipped_steps"] == [0.0, 0.0]
    assert [r["steps"] for r in timer.records] == [8, 8]
    assert [r["samples"] for r in timer.records] == [256.0, 256.0]
    assert [r["step"] for r in monitor.history] == [8, 16]
    assert nan_monitor._steps_before_epoch == 16
