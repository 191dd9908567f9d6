"""`LossScaleOptimizer` on Keras's JAX and torch backends: Keras 3's own test suite
for its `LossScaleOptimizer`, run against ours; tf.keras's loop; the one
unscaling rule; the state machine's settings; a skipped step keeping the
weights, every slot and `iterations`."""

from __future__ import annotations

import keras
import keras.src.optimizers.loss_scale_optimizer_test as keras_own_tests
import numpy as np
import pytest

import mp_callbacks as mp

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)
BACKEND = keras.backend.backend()


def _grad(fn, value):
    """The gradient of `fn` at `value`, the backend's way."""
    if BACKEND == "jax":
        import jax

        return jax.grad(fn)(value)
    leaf = value.detach().clone().requires_grad_(True)
    fn(leaf).backward()
    return leaf.grad


class TestKerasOwnLossScaleOptimizerSuite(keras_own_tests.LossScaleOptimizerTest):
    """Keras 3's `loss_scale_optimizer_test.py`, every test, with
    `mp.LossScaleOptimizer` in the place of Keras's; its stateful cases too,
    which Keras skips on JAX (ours has an eager `apply` there)."""

    def _skip_test_for_stateless(self, stateless):
        pass

    def setUp(self):
        super().setUp()
        self._keras_class = keras_own_tests.LossScaleOptimizer
        keras_own_tests.LossScaleOptimizer = mp.LossScaleOptimizer

    def tearDown(self):
        keras_own_tests.LossScaleOptimizer = self._keras_class
        super().tearDown()


def _model(policy="mixed_float16"):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8)(inputs)
    outputs = keras.layers.Dense(1, dtype="float32")(hidden)
    return keras.Model(inputs, outputs)


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _optimizer_state(model):
    return [v.numpy().copy() for v in model.trainable_variables + model.optimizer.inner_optimizer.variables]


def test_fit_skips_an_overflow_keeping_weights_slots_and_iterations_and_spends_hysteresis():
    model = _model()
    # A scale these gradients do not overflow at, on either backend.
    optimizer = mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10, hysteresis=2)
    model.compile(optimizer, "mse")
    x, y = _data()
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[mp.LossScaleMonitor()]).history
    assert history["loss_scale"] == [2.0**10] and history["skipped_steps"] == [0.0]
    assert int(optimizer.iterations.numpy()) == 4
    before = _optimizer_state(model)
    overflowing = np.full((8, 4), 60000.0, "float32")  # float16 overflows in the forward pass
    model.fit(overflowing, y[:8], verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, _optimizer_state(model)))
    state = optimizer.scaler.diagnostics()
    assert state["skipped_steps"] == 1 and state["hysteresis_left"] == 1 and state["scale"] == 2.0**10
    model.fit(overflowing, y[:8], verbose=0)  # the second overflow backs off
    assert optimizer.get_scale() == 2.0**9 and int(optimizer.iterations.numpy()) == 4


def test_float32_training_equals_keras_own_loss_scale_optimizer():
    x, y = _data()
    trained = []
    for make in (keras.optimizers.LossScaleOptimizer, mp.LossScaleOptimizer):
        model = _model("float32")
        model.compile(make(keras.optimizers.Adam(1e-3)), "mse")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        trained.append([w.numpy() for w in model.weights])
    for ours, theirs in zip(*trained):
        np.testing.assert_array_equal(ours, theirs)


def _eager_tf_keras_loop():
    variable = keras.Variable(np.ones(3, "float32"))
    optimizer = mp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8.0)

    def loss_fn(value):
        return keras.ops.sum(value * value)

    grads = _grad(lambda v: optimizer.get_scaled_loss(loss_fn(v)), variable.value)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(grads), np.full(3, 16.0))  # 2 * 1 * 8
    optimizer.apply_gradients(zip(optimizer.get_unscaled_gradients([grads]), [variable]))
    np.testing.assert_array_equal(variable.numpy(), np.zeros(3))  # 1 - 0.5 * 2, not divided twice
    # Keras 3's contract: gradients of the scaled loss, unscaled by the apply.
    optimizer.apply([grads], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.full(3, -1.0))
    return optimizer, variable, loss_fn


def test_tf_keras_loop_unscales_once_and_keras_3s_contract_unscales_in_the_apply():
    optimizer, _, _ = _eager_tf_keras_loop()
    assert optimizer.get_scale() == 8.0 and int(optimizer.iterations.numpy()) == 2


@pytest.mark.skipif(BACKEND != "jax", reason="a jitted stateless step is JAX's")
def test_tf_keras_loop_unscales_once_in_a_jitted_stateless_step():
    import jax

    optimizer, variable, loss_fn = _eager_tf_keras_loop()

    @jax.jit
    def step(optimizer_values, value):
        scaled = jax.grad(lambda v: optimizer.scale_loss(loss_fn(v)))(value)
        grads = optimizer.get_unscaled_gradients([scaled])
        return optimizer.stateless_apply(optimizer_values, grads, [value])

    new_values, _ = step([v.value for v in optimizer.variables], variable.value)
    np.testing.assert_array_equal(new_values[0], np.full(3, 0.0))  # -1 - 0.5 * (-2)


def test_a_fixed_scale_and_the_tf_keras_arguments():
    optimizer = mp.LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False, initial_scale=64.0)
    assert not optimizer.dynamic and optimizer.dynamic_growth_steps is None
    assert optimizer.get_config()["dynamic"] is False
    again = mp.LossScaleOptimizer.from_config(optimizer.get_config())
    assert not again.dynamic and again.get_scale() == 64.0
    with pytest.raises(ValueError, match='"initial_scale" must be specified if "dynamic" is False'):
        mp.LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False)
    with pytest.raises(mp.UnsupportedArgumentError, match="arguments: `foo`"):
        mp.LossScaleOptimizer(keras.optimizers.SGD(), foo=1)
    with pytest.raises(ValueError, match="`hysteresis` must be an integer >= 1"):
        mp.LossScaleOptimizer(keras.optimizers.SGD(), hysteresis=0)
    with pytest.raises(TypeError, match="cannot wrap another LossScaleOptimizer"):
        mp.LossScaleOptimizer(mp.LossScaleOptimizer(keras.optimizers.SGD()))


def test_a_loss_scaler_given_with_a_state_keeps_it_and_reads_the_optimizers():
    scaler = mp.LossScaler(initial_scale=2.0**10)
    scaler.set_state({"scale": np.float32(32.0)})
    optimizer = mp.LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=scaler)
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer.apply([keras.ops.convert_to_tensor([np.inf, 1.0])], [variable])
    assert optimizer.scaler is scaler and scaler.get_scale() == 16.0
    assert scaler.diagnostics()["skipped_steps"] == 1
    np.testing.assert_array_equal(variable.numpy(), np.ones(2))


def test_saved_and_loaded_with_the_model_keeps_the_scale(tmp_path):
    model = _model()
    model.compile(
        mp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**10, hysteresis=3), "mse"
    )
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0)
    model.fit(np.full((8, 4), 60000.0, "float32"), y[:8], verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, mp.LossScaleOptimizer)
    assert loaded.optimizer.scaler.get_config() == model.optimizer.scaler.get_config()
    assert loaded.optimizer.scaler.diagnostics() == model.optimizer.scaler.diagnostics()


def test_a_mixed_precision_model_adopts_every_setting_and_unwraps_it():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1, dtype="float32")(inputs))
    inner = keras.optimizers.SGD(0.01)
    model.compile(mp.LossScaleOptimizer(inner, initial_scale=256.0, hysteresis=3, min_scale=4.0), "mse")
    assert model.optimizer is inner
    assert (
        model.scaler.initial_scale == 256.0 and model.scaler.hysteresis == 3 and model.scaler.min_scale == 4.0
    )
