"""The contracts users already know: tf.keras's LossScaleOptimizer, Keras 3
optimizers (loss_scale_factor, float8) and PyTorch's GradScaler with
several optimizers."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from backend_helpers import float8_model
from helpers import NaNGradientDense, classification_data

import mp_callbacks as mp
from mp_callbacks import LossScaleOptimizer


def _loop_step(optimizer, variable, loss_fn):
    with tf.GradientTape() as tape:
        loss = loss_fn()
        scaled = optimizer.get_scaled_loss(loss)
    grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, [variable]))
    optimizer.apply_gradients(zip(grads, [variable]))


# ------------------------------------------------------ loss_scale_factor
def test_inner_loss_scale_factor_is_cleared_in_a_custom_loop():
    variable = tf.Variable(1.0)
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(1.0, loss_scale_factor=100.0))
    assert optimizer.inner_optimizer.loss_scale_factor is None
    _loop_step(optimizer, variable, lambda: variable * 1.0)
    assert variable.numpy() == 0.0  # 1 - lr * 1, not 1 - lr * 1 / 100


def test_wrapped_optimizer_with_a_factor_compiles_into_the_model_without_double_unscaling():
    x, y = classification_data(n=8)
    weights = []
    for wrap in (False, True):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(3)(inputs)
        if wrap:
            model = mp.MixedPrecisionModel(inputs, outputs)
            model.compile(
                LossScaleOptimizer(keras.optimizers.SGD(0.5, loss_scale_factor=100.0)),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        else:
            model = keras.Model(inputs, outputs)
            model.compile(
                keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        weights.append(model.get_weights())
    for stock, ours in zip(*weights):
        np.testing.assert_allclose(ours, stock, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ float8


def test_grad_norm_leaves_out_float8_state_variables():
    # Their "gradients" are the new scale and history values, not gradients.
    keras.config.set_dtype_policy("float32")
    model = float8_model(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 8)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    variables = model.trainable_variables
    real = [not getattr(v, "overwrite_with_gradient", False) for v in variables]
    assert 0 < sum(real) < len(variables)

    @tf.function  # float8's custom gradient works in a graph, as in fit
    def gradients_at_start():
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
        return tape.gradient(loss, variables)

    gradients = gradients_at_start()
    expected = float(tf.linalg.global_norm([g for g, r in zip(gradients, real) if r]))
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history
    assert history["grad_norm"][0] == pytest.approx(expected, rel=1e-3)


def test_float8_state_passes_the_optimizer_wrapper_unscaled():
    keras.config.set_dtype_policy("mixed_float16")
    model = float8_model(keras.Model)
    loss_fn = keras.losses.MeanSquaredError()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.01))
    x = tf.constant(np.random.default_rng(1).normal(size=(8, 8)).astype("float32"))
    variables = model.trainable_variables

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(tf.zeros((8, 2)), model(x, training=True))
            scaled = optimizer.get_scaled_loss(loss)
        raw = tape.gradient(scaled, variables)
        optimizer.apply_gradients(zip(optimizer.get_unscaled_gradients(raw), variables))
        return raw

    raw = step()
    for variable, value in zip(variables, raw):
        if getattr(variable, "overwrite_with_gradient", False):
            np.testing.assert_allclose(variable.numpy(), value.numpy(), rtol=1e-6, err_msg=variable.path)


# ---------------------------------------------------------- tf.keras's API
def test_tf_keras_signature_and_attributes():
    fixed = LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False, initial_scale=128)
    assert fixed.dynamic is False and fixed.initial_scale == 128.0
    assert fixed.dynamic_growth_steps is None and fixed.dynamic_counter is None
    assert float(fixed.loss_scale) == 128.0
    dynamic = LossScaleOptimizer(keras.optimizers.SGD(), True, 256, 3)
    assert dynamic.dynamic is True and dynamic.initial_scale == 256.0
    assert dynamic.dynamic_growth_steps == 3 and int(dynamic.dynamic_counter.numpy()) == 0
    variable = tf.Variable(1.0)
    for _ in range(2):
        _loop_step(dynamic, variable, lambda: variable * 1.0)
    assert int(dynamic.dynamic_counter.numpy()) == 2
    _loop_step(dynamic, variable, lambda: variable * 1.0)
    assert float(dynamic.loss_scale) == 512.0 and dynamic.get_scale() == 512.0
    default = LossScaleOptimizer(keras.optimizers.SGD())
    assert default.initial_scale == 2.0**15 and default.dynamic_growth_steps == 2000


def _identity_seeing_its_gradient(seen):
    """The identity, recording the gradient that reaches it (the scale)."""

    @tf.custom_gradient
    def identity(x):
        def grad(upstream):
            seen.append(float(tf.reduce_sum(upstream)))
            return upstream

        return tf.identity(x), grad

    return identity


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "tf-function"])
def test_tf_keras_minimize_scales_the_loss_unscales_once_and_moves_the_scale(in_function):
    # tf.keras's own test: the loss is the identity of the variable, so the
    # gradient reaching it is the scale and the update is the learning rate.
    seen = []
    # Read eagerly only: under tf.function the gradient is symbolic.
    identity = tf.identity if in_function else _identity_seeing_its_gradient(seen)
    variable = tf.Variable([5.0])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(2.0), initial_scale=2, dynamic_growth_steps=1)
    minimize = lambda: optimizer.minimize(lambda: identity(variable), var_list=[variable])  # noqa: E731
    if in_function:
        minimize = tf.function(minimize)
    minimize()
    np.testing.assert_array_equal(variable.numpy(), [3.0])
    assert optimizer.get_scale() == 4.0
    minimize()
    np.testing.assert_array_equal(variable.numpy(), [1.0])
    assert seen == ([] if in_function else [2.0, 4.0])
    infinite = tf.Variable([np.inf])
    optimizer.minimize(lambda: variable * infinite, var_list=lambda: [variable])
    np.testing.assert_array_equal(variable.numpy(), [1.0])
    assert optimizer.get_scale() == 4.0 and int(optimizer.iterations.numpy()) == 2


def test_tf_keras_compute_gradients_takes_a_tape_and_keras_variables():
    variable = keras.Variable([[1.0, 2.0]])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), dynamic=False, initial_scale=8.0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.convert_to_tensor(variable) * 3.0)
    ((grad, of),) = optimizer.compute_gradients(loss, [variable], tape=tape)
    assert of is variable
    np.testing.assert_array_equal(grad.numpy(), [[3.0, 3.0]])
    optimizer.minimize(lambda: tf.reduce_sum(tf.convert_to_tensor(variable) * 3.0), [variable])
    np.testing.assert_array_equal(variable.numpy(), [[-0.5, 0.5]])
    with pytest.raises(ValueError, match=r"`loss` must be a callable .*received loss="):
        optimizer.compute_gradients(loss, [variable])


def test_tf_keras_errors():
    with pytest.raises(TypeError, match="cannot wrap another LossScaleOptimizer"):
        LossScaleOptimizer(LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(TypeError, match=r'"dynamic" argument to LossScaleOptimizer.__init__ must be a bool'):
        LossScaleOptimizer(keras.optimizers.SGD(), "dynamic")
    with pytest.raises(ValueError, match="dynamic_growth_steps"):
        LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False, initial_scale=2.0, dynamic_growth_steps=2)
    with pytest.raises(ValueError, match="initial_scale"):
        LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False)
    inner = keras.optimizers.SGD()
    LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match=r"loss_scale.*initial_scale"):
        LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=-5.0, loss_scale=mp.LossScaler())
    for bad, error in ((5, None), ("auto", ValueError), (0, ValueError), ([], TypeError), ({}, ValueError)):
        if error is None:
            assert LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=bad).get_scale() == 5.0
        else:
            with pytest.raises(error, match="loss_scale"):
                LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=bad)


def test_callable_loss_is_scaled_lazily():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0)
    scaled = optimizer.get_scaled_loss(lambda: tf.constant(3.0))
    assert callable(scaled) and float(scaled()) == 24.0


def test_learning_rate_and_ema_pass_through_the_wrapper_and_nothing_else():
    # tf.keras's LossScaleOptimizerV3: learning_rate, use_ema and
    # ema_momentum are the inner optimizer's; other attributes are not.
    inner = keras.optimizers.SGD(0.1, momentum=0.5)
    optimizer = LossScaleOptimizer(inner)
    assert float(optimizer.learning_rate) == pytest.approx(0.1)
    optimizer.learning_rate = 0.25
    assert float(inner.learning_rate) == 0.25
    assert optimizer.use_ema is False
    optimizer.use_ema = True
    optimizer.ema_momentum = 0.88
    assert inner.use_ema is True and inner.ema_momentum == 0.88
    with pytest.raises(AttributeError, match="nesterov"):
        _ = optimizer.nesterov
    optimizer.nesterov = True
    assert optimizer.nesterov is True and inner.nesterov is False


def test_an_overridden_apply_gradients_is_honoured():
    class CountingSGD(keras.optimizers.SGD):
        calls = 0

        def apply_gradients(self, grads_and_vars):
            CountingSGD.calls += 1
            return super().apply_gradients(grads_and_vars)

    variable = tf.Variable(1.0)
    optimizer = LossScaleOptimizer(CountingSGD(0.5))
    _loop_step(optimizer, variable, lambda: variable * 1.0)
    assert CountingSGD.calls == 1 and variable.numpy() == 0.5


def test_forgotten_scaling_warns_like_tf_keras():
    variable = tf.Variable(1.0)
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.warns(
        mp.MixedPrecisionWarning, match=r"You forgot to call LossScaleOptimizer.get_scaled_loss\(\) and"
    ):
        optimizer.apply_gradients([(tf.constant(1.0), variable)])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.get_scaled_loss(tf.constant(1.0))
    with pytest.warns(
        mp.MixedPrecisionWarning,
        match=r"You forgot to call LossScaleOptimizer.get_unscaled_gradients\(\) before",
    ):
        optimizer.apply_gradients([(tf.constant(1.0), variable)])


# -------------------------------------------------------------- checkpoints
def _trained_optimizer(wrap: bool):
    variable = tf.Variable([1.0, 2.0])
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    optimizer = LossScaleOptimizer(inner, initial_scale=4.0) if wrap else inner
    for _ in range(3):
        if wrap:
            _loop_step(optimizer, variable, lambda: tf.reduce_sum(variable))
        else:
            optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])
    return optimizer, variable


@pytest.mark.parametrize("saved_wrapped", [False, True])
def test_checkpoints_move_between_plain_and_wrapped_optimizers(tmp_path, saved_wrapped):
    source, variable = _trained_optimizer(saved_wrapped)
    path = tf.train.Checkpoint(optimizer=source, v=variable).save(str(tmp_path / "ckpt"))
    target_variable = tf.Variable([0.0, 0.0])
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    target = inner if saved_wrapped else LossScaleOptimizer(inner)
    target.build([target_variable])
    tf.train.Checkpoint(optimizer=target, v=target_variable).restore(path).expect_partial()
    assert int(target.iterations.numpy()) == 3
    source_slots = [v.numpy() for v in getattr(source, "inner_optimizer", source).variables]
    target_slots = [v.numpy() for v in getattr(target, "inner_optimizer", target).variables]
    for a, b in zip(source_slots, target_slots):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(target_variable.numpy(), variable.numpy())


def test_wrapped_checkpoint_round_trip_keeps_the_scale(tmp_path):
    source, variable = _trained_optimizer(True)
    path = tf.train.Checkpoint(optimizer=source, v=variable).save(str(tmp_path / "ckpt"))
    target = LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=1024.0)
    target.build([tf.Variable([0.0, 0.0])])
    tf.train.Checkpoint(optimizer=target, v=tf.Variable([0.0, 0.0])).restore(path)
    assert target.get_scale() == source.get_scale() == 4.0
    assert int(target.iterations.numpy()) == 3


# ------------------------------------------------ several optimizers, one scale
class TwoOptimizerGAN(keras.Model):
    """Keras's GAN example shape: a train_step stepping two optimizers."""

    def __init__(self, generator, discriminator, loss_scale):
        super().__init__()
        self.generator = generator
        self.discriminator = discriminator
        self.shared_scale = loss_scale

    def compile(self, g_optimizer, d_optimizer):
        super().compile()
        self.g_optimizer = g_optimizer
        self.d_optimizer = d_optimizer

    def train_step(self, real):
        noise = tf.random.normal((tf.shape(real)[0], 3))
        bce = keras.losses.BinaryCrossentropy(from_logits=True)
        scale = self.shared_scale
        with tf.GradientTape(persistent=True) as tape:
            fake = self.generator(noise, training=True)
            real_logits = self.discriminator(real, training=True)
            fake_logits = self.discriminator(fake, training=True)
            d_loss = bce(tf.ones_like(real_logits), real_logits) + bce(
                tf.zeros_like(fake_logits), fake_logits
            )
            g_loss = bce(tf.ones_like(fake_logits), fake_logits)
            d_scaled, g_scaled = scale.scale(d_loss), scale.scale(g_loss)
        d_vars = self.discriminator.trainable_variables
        g_vars = self.generator.trainable_variables
        d_grads = scale.unscale(tape.gradient(d_scaled, d_vars))
        g_grads = scale.unscale(tape.gradient(g_scaled, g_vars))
        scale.apply_gradients(self.d_optimizer, d_grads, d_vars, loss=d_loss, update=False)
        scale.apply_gradients(self.g_optimizer, g_grads, g_vars, loss=g_loss, update=False)
        scale.update()
        return {"d_loss": d_loss, "g_loss": g_loss}


def _gan(poison_generator: bool, loss_scale):
    keras.utils.set_random_seed(0)
    hidden = (
        NaNGradientDense(4, name="g_poisoned") if poison_generator else keras.layers.Dense(4, name="g_hidden")
    )
    generator = keras.Sequential([keras.Input((3,)), hidden, keras.layers.Dense(2, name="g_out")])
    discriminator = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    )
    gan = TwoOptimizerGAN(generator, discriminator, loss_scale)
    gan.compile(keras.optimizers.SGD(0.01), keras.optimizers.SGD(0.01))
    return gan


def test_two_optimizers_move_one_scale_once_per_step():
    loss_scale = mp.LossScaler(initial_scale=2.0, growth_interval=2, max_scale=2.0**20)
    gan = _gan(False, loss_scale)
    data = np.random.default_rng(0).normal(size=(32, 2)).astype("float32")
    gan.fit(data, batch_size=4, epochs=1, verbose=0)  # 8 steps
    state = loss_scale.diagnostics()
    assert state["step_count"] == 8 and state["skipped_steps"] == 0
    assert state["scale"] == 2.0 * 2**4  # one growth per 2 steps, not per 2 optimizer calls
    assert int(gan.g_optimizer.iterations.numpy()) == 8
    assert int(gan.d_optimizer.iterations.numpy()) == 8


def test_an_overflow_in_one_optimizer_skips_that_optimizer_only():
    loss_scale = mp.LossScaler(initial_scale=2.0**10, min_scale=1.0)
    gan = _gan(True, loss_scale)
    data = np.random.default_rng(0).normal(size=(16, 2)).astype("float32")
    g_before = [w.copy() for w in gan.generator.get_weights()]
    d_before = [w.copy() for w in gan.discriminator.get_weights()]
    gan.fit(data, batch_size=4, epochs=1, verbose=0)  # 4 steps
    for a, b in zip(g_before, gan.generator.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert all(not np.array_equal(a, b) for a, b in zip(d_before, gan.discriminator.get_weights()))
    state = loss_scale.diagnostics()
    assert state["step_count"] == 4 and state["skipped_steps"] == 4
    assert state["scale"] == 2.0**10 / 2**4  # backed off once per step
    assert int(gan.g_optimizer.iterations.numpy()) == 0
    assert int(gan.d_optimizer.iterations.numpy()) == 4
    counts = loss_scale.nonfinite_gradient_counts()
    assert [count for path, count in counts.items() if "g_poisoned" in path] == [4]
    assert sum(counts.values()) == 4, counts


def test_update_without_a_pending_step_is_an_error():
    with pytest.raises(RuntimeError, match="update=False"):
        mp.LossScaler().update()


def test_no_forgotten_scaling_warning_when_keras_fit_drives_the_wrapper():
    import warnings

    x, y = classification_data(n=16)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, verbose=0)
    assert not [w for w in caught if "You forgot to call" in str(w.message)]
    assert int(model.optimizer.iterations.numpy()) == 2


# ---------------------------------------------- Keras 3's LossScaleOptimizer
def test_keras_3_contract_apply_takes_gradients_of_the_scaled_loss():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5))
    variables = [tf.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(variables)
    optimizer.apply([tf.constant([1.0, 6.0, 7.0, 2.0]) * optimizer.initial_scale])  # the built variables
    np.testing.assert_allclose(variables[0].numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-6)
    assert float(optimizer.scale_loss(1.0)) == 2.0**15
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def test_keras_3_contract_float8_state_is_overwritten_not_unscaled():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5))
    variable = keras.Variable([1.0, 2.0, 3.0, 4.0])
    variable.overwrite_with_gradient = True
    optimizer.apply([tf.constant([1.0, 6.0, 7.0, 2.0])], [variable])
    np.testing.assert_allclose(variable.numpy(), [1.0, 6.0, 7.0, 2.0])


def test_keras_3_config_layout_and_integral_growth_steps():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=3.0, dynamic_growth_steps=2.0, name="test_opt"
    )
    config = optimizer.get_config()
    assert sorted(config) == ["dynamic_growth_steps", "initial_scale", "inner_optimizer", "name"]
    assert config["dynamic_growth_steps"] == 2 and config["initial_scale"] == 3.0
    revived = LossScaleOptimizer.from_config(config)
    assert revived.scaler.get_config() == optimizer.scaler.get_config()
    fixed = LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False, initial_scale=8.0)
    assert LossScaleOptimizer.from_config(fixed.get_config()).get_scale() == 8.0
    hysteresis = LossScaleOptimizer(keras.optimizers.SGD(), hysteresis=2, min_scale=4.0)
    assert (
        LossScaleOptimizer.from_config(hysteresis.get_config()).scaler.get_config()
        == hysteresis.scaler.get_config()
    )


_TF23_SGD = {
    "class_name": "SGD",
    "config": {"learning_rate": 2.0, "momentum": 0.5, "decay": 0.0, "nesterov": False, "name": "SGD"},
}


@pytest.mark.parametrize(
    "loss_scale, expected",
    [
        ({"class_name": "FixedLossScale", "config": {"loss_scale_value": 2.0}}, (False, 2.0, None, 2.0)),
        (
            {
                "class_name": "DynamicLossScale",
                "config": {"initial_loss_scale": 2.0, "increment_period": 3, "multiplier": 2.0},
            },
            (True, 2.0, 3, 2.0),
        ),
        (
            {
                "class_name": "DynamicLossScale",
                "config": {"initial_loss_scale": 8.0, "increment_period": 5, "multiplier": 4.0},
            },
            (True, 8.0, 5, 4.0),
        ),
    ],
    ids=["fixed", "dynamic", "dynamic-multiplier-4"],
)
def test_tensorflow_2_3_config_layout_loads_and_trains(loss_scale, expected):
    # tf.keras's own test: TF 2.3 saved the inner optimizer as `optimizer`
    # and the scale as a serialized LossScale object. A multiplier other
    # than 2 (which tf.keras refused) is this library's growth_factor.
    with pytest.warns(UserWarning):  # Keras 3 ignores the legacy `decay`
        optimizer = LossScaleOptimizer.from_config({"optimizer": _TF23_SGD, "loss_scale": loss_scale})
    dynamic, initial, steps, growth = expected
    assert (optimizer.dynamic, optimizer.initial_scale, optimizer.dynamic_growth_steps) == (
        dynamic,
        initial,
        steps,
    )
    assert optimizer.scaler.growth_factor == growth or not dynamic
    assert float(optimizer.learning_rate) == 2.0 and optimizer.inner_optimizer.momentum == 0.5
    variable = tf.Variable([5.0])
    optimizer.minimize(lambda: tf.identity(variable), [variable])
    np.testing.assert_array_equal(variable.numpy(), [3.0])


def test_a_config_of_neither_layout_is_refused_by_name():
    with pytest.raises(ValueError, match=r"from_config: `config` must be a LossScaleOptimizer config"):
        LossScaleOptimizer.from_config({"optimizer": _TF23_SGD})
    with pytest.raises(ValueError, match=r"`config\['loss_scale'\]` must be a serialized FixedLossScale"):
        LossScaleOptimizer.from_config({"optimizer": _TF23_SGD, "loss_scale": {"class_name": "Other"}})


def test_unknown_arguments_are_refused_as_both_peers_refuse_them():
    with pytest.raises(mp.UnsupportedArgumentError, match="arguments: `foo`, `bar`") as caught:
        LossScaleOptimizer(keras.optimizers.SGD(), foo=True, bar=3)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        LossScaleOptimizer(keras.optimizers.SGD(), clipnorm=0.5)
    # Keras 3 has no dynamic=False; tf.keras needs an initial scale: both said.
    with pytest.raises(ValueError, match="set `loss_scale_factor`"):
        LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False)


def test_dynamic_loss_scale_clears_an_optimizers_own_loss_scale_factor():
    variable = tf.Variable(1.0)
    optimizer = keras.optimizers.SGD(1.0, loss_scale_factor=100.0)
    loss_scale = mp.LossScaler(initial_scale=4.0)
    with pytest.warns(mp.MixedPrecisionWarning, match="loss_scale_factor=100.0 is cleared"):
        loss_scale.apply_gradients(optimizer, [tf.constant(1.0)], [variable])
    assert optimizer.loss_scale_factor is None
    assert variable.numpy() == 0.0  # 1 - lr * 1, not 1 - lr * 1 / 100


# ------------------------------------- tf.keras's mixed-precision model tests
class _Multiply(keras.layers.Layer):
    """tf.keras's MultiplyLayer: y = x * v, v a scalar weight starting at 1."""

    def build(self, input_shape):
        self.v = self.add_weight(shape=(), initializer="ones", name="v")

    def call(self, x):
        return x * tf.cast(self.v, x.dtype)


class _SeeGradient(keras.layers.Layer):
    """Identity whose backward pass records the gradient it receives, and
    turns it into NaN while `poison` is set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = tf.Variable(0.0, trainable=False)
        self.poison = tf.Variable(False, trainable=False)

    def call(self, x):
        @tf.custom_gradient
        def identity(x):
            def grad(upstream):
                with tf.control_dependencies(
                    [self.seen.assign(tf.cast(tf.reduce_max(upstream), tf.float32))]
                ):
                    nan = tf.fill(tf.shape(upstream), tf.constant(np.nan, upstream.dtype))
                    return tf.where(self.poison, nan, tf.identity(upstream))

            return tf.identity(x), grad

        return identity(x)


def _tf_keras_model(optimizer):
    x = keras.Input((1,), batch_size=4)
    multiply, see = _Multiply(), _SeeGradient()
    model = mp.MixedPrecisionModel(x, see(multiply(x)))
    model.compile(optimizer, loss=lambda y_true, y_pred: tf.reduce_mean(y_pred))
    return model, multiply, see


def test_tf_keras_fixed_loss_scaling_model():
    model, multiply, see = _tf_keras_model(
        LossScaleOptimizer(keras.optimizers.SGD(1.0), dynamic=False, initial_scale=8.0)
    )
    data = tf.data.Dataset.from_tensor_slices((np.ones((4, 1)), np.ones((4, 1)))).batch(4)
    model.fit(data, verbose=0)
    assert float(see.seen.numpy()) == 8.0 / 4  # the scale reached the gradients
    assert float(multiply.v.numpy()) == 0.0  # and was taken off before the update


def test_tf_keras_dynamic_loss_scaling_model():
    keras.config.set_dtype_policy("mixed_float16")
    model, multiply, see = _tf_keras_model(
        LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=2.0, dynamic_growth_steps=2)
    )
    data = tf.data.Dataset.from_tensor_slices((np.ones((4, 1)), np.ones((4, 1)))).batch(4)
    # Scale 2 -> 4 after two finite steps -> 2 after the NaN step, which
    # leaves v alone; the gradient at the output is scale / batch size.
    for poisoned, v, gradient in (
        (False, 0.0, 0.5),
        (False, -1.0, 0.5),
        (False, -2.0, 1.0),
        (True, -2.0, None),
        (False, -3.0, 0.5),
    ):
        see.poison.assign(poisoned)
        model.fit(data, verbose=0)
        assert float(multiply.v.numpy()) == v
        if gradient is not None:
            assert float(see.seen.numpy()) == gradient
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert model.optimizer.dynamic_growth_steps == 2
