"""The cond-free skip: an optimizer step gated write by write.

Every built-in Keras optimizer is checked bit for bit against stock
`optimizer.apply` on an applied step, and against untouched state on a
skipped one; updates whose writes cannot be gated must be refused without
adding anything to the step.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from mp_callbacks.backends.tensorflow import gated_update as _gated_update
from mp_callbacks.backends.tensorflow.gated_update import gated_apply

OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.1),
    "SGD-nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "Adam": lambda: keras.optimizers.Adam(amsgrad=True),
    "AdamW": keras.optimizers.AdamW,  # weight decay by default
    "RMSprop": lambda: keras.optimizers.RMSprop(momentum=0.5, centered=True),
    "Adagrad": keras.optimizers.Adagrad,
    "Adadelta": keras.optimizers.Adadelta,
    "Adamax": keras.optimizers.Adamax,
    "Nadam": keras.optimizers.Nadam,
    "Ftrl": keras.optimizers.Ftrl,
    "Lion": keras.optimizers.Lion,
    "Lamb": keras.optimizers.Lamb,
    "Adafactor": keras.optimizers.Adafactor,
    "clipnorm": lambda: keras.optimizers.Adam(global_clipnorm=1.0),
}


@pytest.fixture(params=["folded zero", "kept zero"])
def increments(request, monkeypatch):
    """Both zeros a dense increment is gated against, in place: a constant
    Grappler folds (small variables), or a view of the optimizer's kept
    zero buffer (large ones)."""
    if request.param == "kept zero":
        monkeypatch.setattr(_gated_update, "_FOLDED_ZERO_MAX_ELEMENTS", 0)
    return request.param


def _model(sparse: bool, table_dtype: str = "float32") -> keras.Model:
    keras.utils.set_random_seed(3)
    if sparse:
        inputs = keras.Input((3,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(10, 4, dtype=table_dtype)(inputs))
    else:
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(3)(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


def _batch(sparse: bool):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, (5, 3)).astype("int32") if sparse else rng.normal(size=(5, 4)).astype("float32")
    return tf.constant(x), tf.constant(rng.normal(size=(5, 2)).astype("float32"))


def _state(model, optimizer) -> list[bytes]:
    return [v.numpy().tobytes() for v in model.trainable_variables + optimizer.variables]


def _run(
    make_optimizer,
    sparse: bool,
    how: str,
    steps: int = 2,
    forward_done: bool = False,
    table_dtype: str = "float32",
    restore_on_skip: bool = False,
):
    """Trains `steps` steps; how: 'stock', 'gated-apply', 'gated-skip'.
    With `forward_done`, the loss's finiteness is passed to `gated_apply`,
    as `LossScaler.apply_gradients` does: sparse increments are then
    written at once and put back on a skip.
    With `restore_on_skip`, a stand-in for forward-pass state (set to 1 in
    the step, as a BatchNormalization statistic would be) is put back to 0
    on a skip.
    Returns (state bytes, whether the update was gated)."""
    model = _model(sparse, table_dtype)
    statistic = tf.Variable(0.0)
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
    x, y = _batch(sparse)
    gated = []

    # The predicate is the function's argument, as in a real step: a
    # constant one would let Grappler fold the gate away.
    @tf.function
    def step(predicate):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        statistic.assign(1.0)
        if how == "stock":
            optimizer.apply(grads, model.trainable_variables)
            return
        if how == "gated-skip":
            # A skipped step's gradients are typically not finite.
            grads = [
                tf.IndexedSlices(g.values * np.nan, g.indices, g.dense_shape)
                if isinstance(g, tf.IndexedSlices)
                else g * np.nan
                for g in grads
            ]
        gated.append(
            gated_apply(
                optimizer,
                lambda: optimizer.apply(grads, model.trainable_variables),
                predicate,
                forward_done=tf.math.is_finite(loss) if forward_done else None,
                restore_on_skip=[(statistic, tf.constant(0.0))] if restore_on_skip else (),
            )
        )

    before = _state(model, optimizer)
    for _ in range(steps):
        step(tf.constant(how == "gated-apply"))
    state = _state(model, optimizer)
    if restore_on_skip:
        state.append(float(statistic.numpy()))
        before.append(1.0 if how == "gated-apply" else 0.0)
    return before, state, all(gated)


def _assert_gated_exactly(make_optimizer, sparse: bool, forward_done: bool = False, **options):
    """Gated and applied equals `optimizer.apply` bit for bit; gated and
    skipped leaves every variable as it was. Returns (before, stock)."""
    _, stock, _ = _run(
        make_optimizer, sparse=sparse, how="stock", table_dtype=options.get("table_dtype", "float32")
    )
    _, applied, gated = _run(
        make_optimizer, sparse=sparse, how="gated-apply", forward_done=forward_done, **options
    )
    assert gated
    assert applied[: len(stock)] == stock
    if options.get("restore_on_skip"):
        assert applied[len(stock) :] == [1.0], "the forward pass's state is put back on a skip only"
    before, skipped, _ = _run(
        make_optimizer, sparse=sparse, how="gated-skip", forward_done=forward_done, **options
    )
    assert skipped == before
    return before, stock


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_builtin_optimizer_is_gated_bit_for_bit(name, increments):
    make = OPTIMIZERS[name]
    _, stock, _ = _run(make, sparse=False, how="stock")
    _, applied, gated = _run(make, sparse=False, how="gated-apply")
    assert gated, f"{name}'s dense update should be gatable"
    assert applied == stock, "an applied gated step must equal optimizer.apply exactly"
    before, skipped, _ = _run(make, sparse=False, how="gated-skip")
    assert skipped == before, "a skipped step must leave every variable, iterations included, as it was"
    # The iteration counter is among the optimizer's variables: checked above;
    # make sure it really moved on applied steps.
    assert stock != before


@pytest.mark.parametrize("forward_done", [False, True], ids=["after decision", "at once"])
@pytest.mark.parametrize("name", ["SGD", "SGD-nesterov", "Adam", "AdamW", "Nadam", "Lion"])
def test_sparse_embedding_updates_are_gated_bit_for_bit(name, forward_done):
    make = OPTIMIZERS[name]
    _assert_gated_exactly(make, sparse=True, forward_done=forward_done)


class AddingSGD(keras.optimizers.SGD):
    """SGD written with `assign_add` of a negative step, sparse or dense, as
    a user's optimizer may be: exercises the gate on sparse additions."""

    def update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, variable.dtype)
        if isinstance(gradient, tf.IndexedSlices):
            self.assign_add(
                variable, tf.IndexedSlices(-gradient.values * lr, gradient.indices, gradient.dense_shape)
            )
        else:
            self.assign_add(variable, -gradient * lr)


class CountingSGD(keras.optimizers.SGD):
    """Counts its updates per variable in an integer slot, as a user's
    optimizer may: an integer increment has an integer zero."""

    def build(self, variables):
        super().build(variables)
        self.counts = [self.add_variable((), dtype="int64", name="count") for _ in variables]

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        self.assign_add(self.counts[self._get_variable_index(variable)], 3)


def test_integer_increments_are_gated_exactly(increments):
    before, stock = _assert_gated_exactly(lambda: CountingSGD(0.1), sparse=False)
    assert stock != before


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_additions_are_gated_bit_for_bit(sparse, increments):
    make = lambda: AddingSGD(0.1)  # noqa: E731
    _assert_gated_exactly(make, sparse=sparse)


class TwiceSGD(keras.optimizers.SGD):
    """Two sparse increments to the same rows in one step (a subtraction,
    then an addition of half of it back): the rows a skip puts back must be
    those from before the first."""

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        if isinstance(gradient, tf.IndexedSlices):
            lr = tf.cast(learning_rate, variable.dtype)
            self.assign_add(
                variable, tf.IndexedSlices(gradient.values * lr * 0.5, gradient.indices, gradient.dense_shape)
            )


@pytest.mark.parametrize("make", [lambda: AddingSGD(0.1), lambda: TwiceSGD(0.1)], ids=["once", "twice"])
def test_sparse_increments_written_at_once_are_put_back_exactly(make):
    # The batch repeats token ids, so the increments carry duplicate rows.
    x, _ = _batch(sparse=True)
    assert len(np.unique(x.numpy())) < x.numpy().size
    _assert_gated_exactly(make, sparse=True, forward_done=True)


@pytest.mark.parametrize("forward_done", [False, True], ids=["after decision", "at once"])
def test_a_float64_table_and_restore_on_skip_share_the_put_back(forward_done):
    # The table's own dtype for the gated zeros; the forward pass's state is
    # put back in the same branch as the table's rows, and only on a skip.
    _assert_gated_exactly(
        lambda: keras.optimizers.SGD(0.1),
        sparse=True,
        forward_done=forward_done,
        table_dtype="float64",
        restore_on_skip=True,
    )


@pytest.mark.parametrize(
    "forward_done", [None, True, False], ids=["no loss", "finite loss", "nonfinite loss"]
)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: AddingSGD(0.1),
        lambda: keras.optimizers.SGD(0.1),
        lambda: keras.optimizers.SGD(0.1, momentum=0.5),
    ],
    ids=["assign_add", "assign_sub", "momentum"],
)
def test_skipped_updates_keep_negative_zero(make, sparse, forward_done, increments):
    # A skipped increment is + (-0.0) or - (+0.0), a skipped overwrite picks
    # the old value: anything else turns -0.0 into +0.0.
    model = _model(sparse=sparse)
    for variable in model.trainable_variables:
        variable.assign(np.full(variable.shape, -0.0, "float32"))
    optimizer = make()
    optimizer.build(model.trainable_variables)
    x, y = _batch(sparse=sparse)

    @tf.function
    def step(predicate):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices) == sparse
        return gated_apply(
            optimizer,
            lambda: optimizer.apply(grads, model.trainable_variables),
            predicate,
            forward_done=None if forward_done is None else tf.constant(forward_done),
        )

    assert step(tf.constant(False))
    for variable in model.trainable_variables:
        assert np.all(np.signbit(variable.numpy())), variable.path


class DirectWriteSGD(keras.optimizers.SGD):
    """Writes the variable itself instead of through `self.assign_sub`."""

    def update_step(self, gradient, variable, learning_rate):
        variable.assign(variable - gradient * learning_rate)


class SparseOverwriteSGD(keras.optimizers.SGD):
    """Overwrites the rows it updates (an `assign` of IndexedSlices), which
    has no neutral value to gate with."""

    def update_step(self, gradient, variable, learning_rate):
        rows = tf.gather(variable, gradient.indices)
        self.assign(
            variable,
            tf.IndexedSlices(rows - gradient.values * learning_rate, gradient.indices, gradient.dense_shape),
        )


class OffsetAddSGD(AddingSGD):
    """Overrides `assign_add` with a write that is not neutral at zero: the
    gate cannot know that adding a gated zero still changes the variable."""

    def assign_add(self, variable, value):
        super().assign_add(variable, value + 1e-3)


def _graph_size_after(make_optimizer, constraint=None, sparse=False):
    model = _model(sparse)
    if constraint is not None:
        model.layers[-1].kernel.constraint = constraint
    optimizer = make_optimizer()
    optimizer.build(model.trainable_variables)
    x, y = _batch(sparse)
    result = {}

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        result["gated"] = gated_apply(
            optimizer, lambda: optimizer.apply(grads, model.trainable_variables), tf.constant(True)
        )
        # Tracing may capture a variable or a constant into the step; no
        # op that computes or writes may be left behind.
        result["added"] = [
            op.type for op in graph.get_operations()[before:] if op.type not in ("Placeholder", "Const")
        ]

    step.get_concrete_function()
    return result


@pytest.mark.parametrize(
    "case", ["direct write", "overridden write", "constraint", "ema", "sparse divide", "sparse overwrite"]
)
def test_updates_that_cannot_be_gated_are_refused_and_add_nothing(case):
    make, constraint, sparse = {
        "direct write": (lambda: DirectWriteSGD(0.1), None, False),
        "overridden write": (lambda: OffsetAddSGD(0.1), None, False),
        "constraint": (lambda: keras.optimizers.SGD(0.1), keras.constraints.NonNeg(), False),
        "ema": (lambda: keras.optimizers.Adam(use_ema=True), None, False),
        # Keras's sparse division has data-dependent control flow.
        "sparse divide": (keras.optimizers.RMSprop, None, True),
        "sparse overwrite": (lambda: SparseOverwriteSGD(0.1), None, True),
    }[case]
    result = _graph_size_after(make, constraint, sparse)
    assert result == {"gated": False, "added": []}


def test_a_non_keras_optimizer_and_eager_execution_are_refused():
    answers = []

    @tf.function
    def traced():
        answers.append(gated_apply(object(), lambda: None, tf.constant(True)))

    traced.get_concrete_function()
    assert answers == [False]
    assert gated_apply(keras.optimizers.SGD(), lambda: None, tf.constant(True)) is False


def _trace_gated_step(model, optimizer, sparse: bool, inspect, forward_done: bool = False) -> None:
    """Traces one gated step of `optimizer` on `model`; inside the trace,
    calls `inspect(ops, predicate, loss)` with the ops `gated_apply` added
    (given the loss's finiteness if `forward_done`)."""
    optimizer.build(model.trainable_variables)
    x, y = _batch(sparse)

    @tf.function
    def step(predicate):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        assert gated_apply(
            optimizer,
            lambda: optimizer.apply(grads, model.trainable_variables),
            predicate,
            forward_done=tf.math.is_finite(loss) if forward_done else None,
        )
        inspect(graph.get_operations()[before:], predicate, loss)

    step.get_concrete_function(tf.TensorSpec([], tf.bool))


def _write_ops() -> dict[str, int]:
    model = _model(sparse=False)
    writes = {}

    def count(ops, predicate, loss):
        types = [op.type for op in ops]
        writes.update(
            subtract=types.count("AssignSubVariableOp"),
            assign=types.count("AssignVariableOp"),
            fills=types.count("Fill"),
            views=types.count("StridedSlice"),
            variables=len(model.trainable_variables),
        )

    _trace_gated_step(model, keras.optimizers.SGD(0.1), False, count)
    return writes


def test_increments_are_applied_in_place_against_a_folded_or_a_kept_zero(monkeypatch):
    # Small variables: a constant zero Grappler folds. Large ones: a view of
    # the optimizer's zero buffer, captured, so nothing is filled per step.
    folded = _write_ops()
    monkeypatch.setattr(_gated_update, "_FOLDED_ZERO_MAX_ELEMENTS", 0)
    kept = _write_ops()
    count = folded["variables"]
    assert folded["subtract"] == kept["subtract"] == count
    assert folded["assign"] == kept["assign"]  # the iteration counter only
    assert folded["fills"] > 0 and kept["fills"] == 0
    assert folded["views"] == 0 and kept["views"] == count


def test_one_zero_buffer_per_optimizer_dtype_and_sign_as_large_as_its_largest_variable(monkeypatch):
    monkeypatch.setattr(_gated_update, "_FOLDED_ZERO_MAX_ELEMENTS", 0)
    model = _model(sparse=False)
    optimizer = keras.optimizers.Adam()
    _trace_gated_step(model, optimizer, False, lambda *_: None)
    buffers = _gated_update._ZERO_BUFFERS[optimizer]
    largest = max(int(np.prod(v.shape)) for v in model.trainable_variables)
    # Adam adds to its moments (-0.0) and subtracts from the weights (+0.0).
    assert sorted(key[2] for key in buffers) == [False, True]
    for buffer in buffers.values():
        assert buffer.shape == (largest,) and not np.any(buffer.numpy())
    signs = {negative: np.signbit(buffer.numpy()).all() for (_, _, negative), buffer in buffers.items()}
    assert signs == {True: True, False: False}


def _data_ancestry(ops) -> callable:
    """`waits(op, tensor)`: whether `op` depends on `tensor` through its
    inputs (control edges, which Grappler may drop, do not count)."""
    memo = {}

    def waits(op, tensor) -> bool:
        key = (op.name, tensor.name)
        if key not in memo:
            memo[key] = False
            memo[key] = op is tensor.op or any(waits(t.op, tensor) for t in op.inputs)
        return memo[key]

    return waits


@pytest.mark.parametrize("forward_done", [False, True], ids=["decision only", "loss given"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_every_write_takes_the_decision_or_the_loss_as_data(sparse, forward_done, increments):
    # Writing small dense variables at once and putting them back on a skip
    # was tried: under fit, a forward pass then sometimes read the value its
    # own step had written. Grappler had dropped the control edge that
    # ordered the read first (it was implied by a path through a `Shape`,
    # which constant folding then replaced). So every write depends, through
    # its inputs, on the decision, or (sparse increments, when the loss is
    # given) on the loss, which comes after every read of the forward pass;
    # and what does not wait for the decision is put back on a skip.
    model = _model(sparse)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.0 if sparse else 0.5)
    found = {}

    def classify(ops, predicate, loss):
        waits = _data_ancestry(ops)
        # The counter's handle as captured in this graph.
        counter = _gated_update.tf_variable(optimizer.iterations).value().op.inputs[0].name
        writes = [op for op in ops if op.type.startswith(("Assign", "ResourceScatter"))]
        found["counter"] = [waits(op, predicate) for op in writes if op.inputs[0].name == counter]
        found["others"] = [
            (waits(op, predicate), waits(op, loss)) for op in writes if op.inputs[0].name != counter
        ]
        conds = [op for op in ops if op.type in ("If", "StatelessIf")]
        found["put back"] = sorted({t.name for op in conds for t in op.inputs if t.dtype == tf.resource})
        found["early"] = sorted(
            {op.inputs[0].name for op in writes if op.inputs[0].name != counter and not waits(op, predicate)}
        )

    _trace_gated_step(model, optimizer, sparse, classify, forward_done=forward_done)
    momentum = 0 if sparse else len(model.trainable_variables)
    count = len(model.trainable_variables) + momentum
    if sparse and forward_done:
        # The Embedding's table, written at once and put back on a skip.
        assert found["others"].count((False, True)) == 1
        assert [waits_for_decision for waits_for_decision, _ in found["others"]].count(True) == count - 1
        assert len(found["early"]) == 1 and found["put back"] == found["early"]
    else:
        assert [waits_for_decision for waits_for_decision, _ in found["others"]] == [True] * count
        assert found["early"] == [] and found["put back"] == []
    # Keras's own increment of the counter, then the gated put-back.
    assert found["counter"] == [False, True]
