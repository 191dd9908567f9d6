"""Shared test set-up: two logical CPUs, quiet TensorFlow, policy hygiene.

The backend comes from KERAS_BACKEND (TensorFlow by default). On
TensorFlow the whole suite runs but the other backends' folders; with
KERAS_BACKEND=jax `tests/on_jax` and `tests/on_jax_and_torch` run, with
KERAS_BACKEND=torch `tests/on_torch` and `tests/on_jax_and_torch`, in an
install that may have no TensorFlow.
"""

import contextlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
BACKEND = os.environ["KERAS_BACKEND"]

if BACKEND == "jax":
    # DataParallel tests need two devices: host devices are set before JAX
    # initialises.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    collect_ignore_glob = ["test_*.py"]
    collect_ignore = ["on_torch"]
elif BACKEND == "torch":
    collect_ignore_glob = ["test_*.py"]
    collect_ignore = ["on_jax"]
else:
    collect_ignore = ["on_jax", "on_torch", "on_jax_and_torch"]

import numpy as np  # noqa: E402
import pytest  # noqa: E402

if BACKEND == "tensorflow":
    import tensorflow as tf

    # MirroredStrategy tests need two devices; logical devices can only be set
    # before TensorFlow initialises its runtime, so do it at collection time.
    _cpus = tf.config.list_physical_devices("CPU")
    with contextlib.suppress(RuntimeError):  # runtime already initialised by a plugin
        tf.config.set_logical_device_configuration(
            _cpus[0],
            [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
        )

import keras  # noqa: E402


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core this process may use, at most four
    (each worker holds its own TensorFlow or XLA runtime)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 4))


@pytest.fixture(autouse=True)
def _restore_dtype_policy():
    """No test leaks its global dtype policy into the next."""
    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)


@pytest.fixture(scope="session")
def two_cpu_strategy():
    # One strategy for the whole session: separate MirroredStrategy objects
    # in one process hand out the same collective instance keys, and a later
    # strategy's all-reduce then meets an earlier one's and fails on shapes.
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    if len(devices) < 2:
        pytest.skip("two logical CPU devices are not available")
    return tf.distribute.MirroredStrategy(devices)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
