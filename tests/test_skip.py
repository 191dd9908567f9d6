"""The skip mechanism: every form against the reference, the tf.cond, bit
for bit, on applied and on skipped steps."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from mp_callbacks.backends.tensorflow.compiled_update import VERIFIED_OPTIMIZERS, VERIFIED_SPARSE_OPTIMIZERS
from mp_callbacks.backends.tensorflow.skip import apply_or_skip, restore_if_skipped

OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "Adam": keras.optimizers.Adam,
    "AdamW": keras.optimizers.AdamW,
    "RMSprop": lambda: keras.optimizers.RMSprop(centered=True),
}


def _model(sparse: bool) -> keras.Model:
    keras.utils.set_random_seed(5)
    if sparse:
        inputs = keras.Input((3,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(10, 4)(inputs))
    else:
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(3)(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


def _step(make_optimizer, sparse: bool, mechanism: str | None, applied: bool, jit_compile: bool = False):
    """Two traced steps (the second with `applied`); the model's, the
    optimizer's and a restored variable's state as bytes, and the mechanism
    used, and the model's and optimizer's state between the two steps."""
    model, optimizer = _model(sparse), make_optimizer()
    extra = tf.Variable([1.0, 2.0])  # state a forward pass changed
    rng = np.random.default_rng(1)
    x = rng.integers(0, 10, (5, 3)).astype("int32") if sparse else rng.normal(size=(5, 4)).astype("float32")
    y = rng.normal(size=(5, 2)).astype("float32")
    used = []

    @tf.function(jit_compile=jit_compile)
    def step(decision):
        before = tf.identity(extra)
        extra.assign_add([0.5, 0.5])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        used.append(
            apply_or_skip(
                optimizer,
                grads,
                model.trainable_variables,
                decision,
                restore_on_skip=[(extra, before)],
                mechanism=mechanism,
            )
        )

    optimizer.build(model.trainable_variables)
    step(tf.constant(True))
    before = [v.numpy().tobytes() for v in model.trainable_variables + optimizer.variables]
    step(tf.constant(applied))
    state = [v.numpy().tobytes() for v in model.trainable_variables + optimizer.variables + [extra]]
    return state, used[-1], before


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("applied", [True, False], ids=["applied", "skipped"])
@pytest.mark.parametrize("mechanism", ["gated", "compiled"])
def test_each_form_is_the_cond_bit_for_bit(name, sparse, applied, mechanism):
    reference, used, _ = _step(OPTIMIZERS[name], sparse, "cond", applied)
    assert used == "cond"
    other, used, _ = _step(OPTIMIZERS[name], sparse, mechanism, applied)
    # An update that cannot be compiled is gated; one that cannot be gated keeps the cond.
    expected = {"compiled": ("compiled", "gated", "cond"), "gated": ("gated", "cond")}[mechanism]
    assert used in expected
    if mechanism == "compiled":
        compiled = name in VERIFIED_OPTIMIZERS and (not sparse or name in VERIFIED_SPARSE_OPTIMIZERS)
        assert (used == "compiled") == compiled
    assert other == reference


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_under_xla_the_update_is_skipped_by_the_cond_and_a_skip_changes_nothing(name, sparse):
    # XLA fuses a cond's update into the step, where the gated writes were
    # slower (docs/design.md, "Under XLA"). Not compared with the graph
    # form bit for bit: XLA contracts multiply-adds that TensorFlow's
    # kernels do not, for stock Keras alike.
    skipped, used, before = _step(OPTIMIZERS[name], sparse, None, applied=False, jit_compile=True)
    assert used == "cond"
    assert skipped[:-1] == before
    assert np.frombuffer(skipped[-1], "float32").tolist() == [1.5, 2.5]  # restored
    applied, _, before = _step(OPTIMIZERS[name], sparse, None, applied=True, jit_compile=True)
    assert applied[0] != before[0]  # the first layer's weights moved
    assert np.frombuffer(applied[-1], "float32").tolist() == [2.0, 3.0]
    # Without XLA a verified update is compiled (exactly), any other gated.
    _, used, _ = _step(OPTIMIZERS[name], sparse, None, applied=True)
    if name in VERIFIED_OPTIMIZERS and (not sparse or name in VERIFIED_SPARSE_OPTIMIZERS):
        assert used == "compiled"
    else:
        assert used == "gated" if not sparse else used in ("gated", "cond")


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "skipped"])
def test_the_cross_replica_form_is_the_conds_update(applied, two_cpu_strategy):
    # To float rounding: the replicas' gradients are summed in another order.
    with two_cpu_strategy.scope():
        model, optimizer = _model(False), keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 4)).astype("float32")
    y = rng.normal(size=(4, 2)).astype("float32")
    used = []

    @tf.function
    def replica_step(x, y, decision):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) / 2.0
        # Each replica's share of the mean loss: Keras sums the gradients.
        grads = tape.gradient(loss, model.trainable_variables)
        used.append(apply_or_skip(optimizer, grads, model.trainable_variables, decision))

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    batch = next(iter(two_cpu_strategy.experimental_distribute_dataset(dataset)))
    two_cpu_strategy.run(replica_step, args=(*batch, tf.constant(applied)))
    state = [v.numpy().tobytes() for v in model.trainable_variables + optimizer.variables]
    assert used[-1] == "cross_replica"

    # The reference: the same step under no strategy, inside a tf.cond.
    reference_model, reference_optimizer = _model(False), keras.optimizers.Adam()
    reference_optimizer.build(reference_model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(reference_model(x) - y))
    grads = tape.gradient(loss, reference_model.trainable_variables)
    apply_or_skip(
        reference_optimizer,
        grads,
        reference_model.trainable_variables,
        tf.constant(applied),
        mechanism="cond",
    )
    expected = [v.numpy() for v in reference_model.trainable_variables + reference_optimizer.variables]
    for ours, theirs in zip(state, expected):
        np.testing.assert_allclose(
            np.frombuffer(ours, theirs.dtype).reshape(theirs.shape), theirs, rtol=1e-6, atol=1e-7
        )


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "skipped"])
def test_restore_if_skipped_puts_the_values_back_on_a_skip_only(applied):
    statistic = tf.Variable([1.0, -0.0, 3.0])
    counter = tf.Variable(7, dtype=tf.int64)

    @tf.function
    def step(applied):
        before = [tf.identity(statistic), tf.identity(counter)]
        statistic.assign([np.nan, 2.0, 2.0])  # as a forward pass writes it
        counter.assign_add(1)
        restore_if_skipped(applied, [(statistic, before[0]), (counter, before[1])])

    step(tf.constant(applied))
    expected = ([np.nan, 2.0, 2.0], 8) if applied else ([1.0, -0.0, 3.0], 7)
    np.testing.assert_array_equal(statistic.numpy(), expected[0])
    assert int(counter.numpy()) == expected[1]
    if not applied:
        assert np.signbit(statistic.numpy()[1]), "the old value comes back bit for bit"


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "skipped"])
def test_restore_if_skipped_under_a_strategy_restores_every_replica(applied, two_cpu_strategy):
    with two_cpu_strategy.scope():
        statistic = tf.Variable(
            [1.0, 2.0],
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.MEAN,
        )

    @tf.function
    def replica_step(applied):
        before = tf.identity(statistic.read_value())
        statistic.assign([5.0, 6.0])
        restore_if_skipped(applied, [(statistic, before)])

    two_cpu_strategy.run(replica_step, args=(tf.constant(applied),))
    values = [v.numpy().tolist() for v in two_cpu_strategy.experimental_local_results(statistic)]
    assert values == ([[5.0, 6.0]] * 2 if applied else [[1.0, 2.0]] * 2)
