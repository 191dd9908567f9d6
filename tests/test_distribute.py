"""tf.distribute: one skip decision everywhere, with fit and in custom loops."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import mp_callbacks as mp

WORKER = os.path.join(os.path.dirname(__file__), "multiworker_worker.py")


def _replica_values(variable):
    values = getattr(variable, "values", None)
    if values is None:
        values = getattr(getattr(variable, "value", None), "values", None)
    return [v.numpy() for v in values] if values is not None else [variable.numpy()]


@pytest.mark.slow
def test_dynamic_loss_scale_alone_in_a_custom_loop_under_mirrored(two_cpu_strategy):
    strategy = two_cpu_strategy
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    x[13] = np.nan  # batch 2 of 4, one replica's half only
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
        loss_scale = mp.LossScaler(initial_scale=2.0**8, growth_interval=2)
        loss_scale.build(model.trainable_variables)
        optimizer.build(model.trainable_variables)

    @tf.function
    def distributed_step(batch):
        def replica_step(inputs, targets):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(targets, model(inputs))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=8)
                scaled = loss_scale.scale(loss)
            grads = loss_scale.unscale(tape.gradient(scaled, model.trainable_variables))
            return loss_scale.apply_gradients(optimizer, grads, model.trainable_variables, loss=loss)

        return strategy.run(replica_step, args=batch)

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    decisions = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        applied = strategy.experimental_local_results(distributed_step(batch))
        decisions.append([bool(a) for a in applied])
    assert decisions == [[True, True], [False, False], [True, True], [True, True]]
    assert int(optimizer.iterations.numpy()) == 3
    # The NaN row makes one replica's loss NaN: bad data, skipped on both
    # without backing off; 256 -> 512 after two clean steps, on both replicas.
    assert _replica_values(loss_scale._scale) == [512.0, 512.0]
    assert loss_scale.diagnostics()["skipped_steps"] == 1
    for variable in model.trainable_variables:
        replicas = _replica_values(variable)
        assert all(np.array_equal(replicas[0], r) for r in replicas)
        assert np.all(np.isfinite(replicas[0]))


def test_seed_loop_with_loss_scale_optimizer_under_mirrored(two_cpu_strategy):
    strategy = two_cpu_strategy
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = mp.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=64.0)
        optimizer.build(model.trainable_variables)

    @tf.function
    def train_step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    keras.losses.mean_squared_error(y, model(x, training=True)), global_batch_size=8
                )
                scaled_loss = optimizer.get_scaled_loss(loss)
            scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
            gradients = optimizer.get_unscaled_gradients(scaled_gradients)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss

        return strategy.run(replica_step, args=(x, y))

    dataset = tf.data.Dataset.from_tensor_slices(
        (np.ones((16, 4), "float32"), np.zeros((16, 2), "float32"))
    ).batch(8)
    for x, y in strategy.experimental_distribute_dataset(dataset):
        train_step(x, y)
    assert int(optimizer.iterations.numpy()) == 2
    assert optimizer.get_scale() == 64.0


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_two_processes(tmp_path):
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    workers = []
    for index in range(2):
        env = dict(
            os.environ,
            TF_CPP_MIN_LOG_LEVEL="2",
            KERAS_BACKEND="tensorflow",
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        )
        out = tmp_path / f"worker{index}.npz"
        log = open(tmp_path / f"worker{index}.log", "w")  # noqa: SIM115 - closed in the finally below
        workers.append(
            (
                subprocess.Popen(
                    [sys.executable, WORKER, str(out)], env=env, stdout=log, stderr=subprocess.STDOUT
                ),
                out,
                log,
            )
        )
    deadline = time.monotonic() + 240
    try:
        for process, _, _ in workers:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process, _, log in workers:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    for index, (process, _, _) in enumerate(workers):
        log_text = (tmp_path / f"worker{index}.log").read_text()[-3000:]
        assert process.returncode == 0, f"worker {index} failed:\n{log_text}"

    first, second = (np.load(out) for _, out, _ in workers)
    # The poisoned sample is in one step of each of the two epochs, on one worker.
    assert float(first["skipped"]) == float(second["skipped"]) == 2.0
    assert first["skipped_per_epoch"].tolist() == second["skipped_per_epoch"].tolist() == [1.0, 1.0]
    assert float(first["scale"]) == float(second["scale"])
    assert int(first["iterations"]) == int(second["iterations"]) == 2 * 4 - 2
    np.testing.assert_array_equal(first["loss_scale_log"], second["loss_scale_log"])
    np.testing.assert_allclose(first["val_loss"], second["val_loss"], rtol=1e-6)
    assert np.all(np.isfinite(first["val_loss"])) and float(first["evaluate_loss"]) > 0
    assert int(first["epoch_time_logged"][0]) == 2
    weights = sorted(k for k in first.files if k.startswith("arr_"))
    assert weights
    for key in weights:
        np.testing.assert_array_equal(first[key], second[key])
        assert np.all(np.isfinite(first[key]))


def _three_variable_step(strategy, loss_scale, optimizer, variables, update=True):
    """A replica step whose gradients are all ones, except the last
    variable's, which is NaN on the second replica only."""

    @tf.function
    def step():
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [tf.ones_like(v) for v in variables]
            grads[-1] = grads[-1] * tf.where(replica == 1, np.nan, 1.0)
            applied = loss_scale.apply_gradients(optimizer, grads, variables, update=update)
            if not update:
                loss_scale.update()
            return applied

        return strategy.experimental_local_results(strategy.run(replica_step))

    return step


@pytest.mark.parametrize("update", [True, False], ids=["apply", "apply then update()"])
def test_a_non_finite_last_gradient_on_one_replica_skips_everywhere(two_cpu_strategy, update):
    # Only the last variable, only one replica: the all-reduced decision must
    # see that flag (the loss flag comes after it), whether the step advances
    # the state itself or through update().
    strategy = two_cpu_strategy
    with strategy.scope():
        variables = [
            tf.Variable(tf.fill(shape, 2.0), name=f"v{i}") for i, shape in enumerate([(3,), (2, 2), (2,)])
        ]
        optimizer = keras.optimizers.SGD(0.5)
        loss_scale = mp.LossScaler(initial_scale=8.0)
        loss_scale.build(variables)
        optimizer.build(variables)
    step = _three_variable_step(strategy, loss_scale, optimizer, variables, update=update)
    assert [bool(a) for a in step()] == [False, False]
    for variable in variables:
        assert all(np.array_equal(r, np.full(variable.shape, 2.0)) for r in _replica_values(variable))
    assert _replica_values(loss_scale._scale) == [4.0, 4.0]
    assert loss_scale.diagnostics()["skipped_steps"] == 1
    assert list(loss_scale.nonfinite_gradient_counts().values()) == [0, 0, 1]
    assert int(optimizer.iterations.numpy()) == 0
