"""What a healthy step reads and writes of a large variable, counted on the
traced graph: stock Keras's update, Keras's `LossScaleOptimizer`, ours.

The count is per full-size tensor (one variable's worth of bytes): a
kernel reads each full-size input and writes each full-size output; an
in-place `AssignAdd`/`AssignSub` reads the variable and the value and
writes the variable, an `Assign` reads the value and writes the variable;
ops that forward a buffer (a `Select` on a scalar,
`Identity`, `Reshape`, a dim-0 slice from 0, a variable read) cost
nothing. Of a `tf.cond`, only the branch a healthy step takes is counted.
docs/design.md's table quotes these counts; the test holds it to them.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import mp_callbacks as mp

# Its module-scoped fixtures are built once: the whole file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_update_traffic")

SHAPE = (512, 512)  # 262,144 elements: above the folded-zero size
FORWARDING = {
    "Identity",
    "IdentityN",
    "ReadVariableOp",
    "Reshape",
    "StridedSlice",
    "Placeholder",
    "Const",
    "Select",
    "NoOp",
}
IN_PLACE = {"AssignAddVariableOp", "AssignSubVariableOp"}
CONDS = {"If", "StatelessIf"}
OPTIMIZERS = {
    "Adam": keras.optimizers.Adam,
    "AdamW": keras.optimizers.AdamW,
    "SGD with momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "SGD": lambda: keras.optimizers.SGD(0.1),
}


def _full(tensor) -> bool:
    return tensor.dtype != tf.resource and tensor.shape.num_elements() == int(np.prod(SHAPE))


def _traffic(graph, ops, taken=None) -> tuple[Fraction, Fraction]:
    """(reads, writes) of full-size tensors, in float32 variables' worth."""
    reads = writes = Fraction(0)
    taken = taken or {}
    for op in ops:
        if op.type in CONDS:
            # The healthy step's branch when known, else the costlier one.
            branches = ["then_branch", "else_branch"]
            if op.name in taken:
                branches = ["then_branch" if taken[op.name] else "else_branch"]
            counts = []
            for branch in branches:
                body = graph._get_function(op.get_attr(branch).name).graph
                counts.append(_traffic(body, body.get_operations()))
            best = max(counts, key=sum)
            reads, writes = reads + best[0], writes + best[1]
            continue
        if op.type in FORWARDING:
            continue
        size = Fraction(1, 4)  # bytes per element / 4
        if op.type in IN_PLACE:
            if _full(op.inputs[1]):
                reads += 2 * op.inputs[1].dtype.size * size
                writes += op.inputs[1].dtype.size * size
            continue
        if op.type == "AssignVariableOp":
            # Counted as a copy of the value into the variable.
            if _full(op.inputs[1]):
                reads += op.inputs[1].dtype.size * size
                writes += op.inputs[1].dtype.size * size
            continue
        reads += sum(t.dtype.size * size for t in op.inputs if _full(t))
        writes += sum(t.dtype.size * size for t in op.outputs if _full(t))
    return reads, writes


def healthy_step_traffic(make_optimizer, wrap) -> tuple[Fraction, Fraction]:
    keras.utils.set_random_seed(0)
    variable = keras.Variable(np.ones(SHAPE, "float32"))
    optimizer = wrap(make_optimizer())
    optimizer.build([variable])
    traced = {}

    @tf.function(autograph=False)
    def step(gradient):
        graph = tf.compat.v1.get_default_graph()
        start = len(graph.get_operations())
        optimizer.apply([gradient], [variable])
        traced["graph"], traced["ops"] = graph, graph.get_operations()[start:]
        conds = [op for op in traced["ops"] if op.type in CONDS]
        traced["conds"] = [op.name for op in conds]
        return [op.inputs[0] for op in conds]

    # Run once on a healthy gradient to learn which way each cond goes.
    predicates = step(tf.fill(SHAPE, 1e-3))
    taken = {name: bool(value) for name, value in zip(traced["conds"], predicates)}
    return _traffic(traced["graph"], traced["ops"], taken)


CONTENDERS = {
    "stock": lambda optimizer: optimizer,
    "Keras LossScaleOptimizer": keras.optimizers.LossScaleOptimizer,
    "MixedPrecisionModel": mp.LossScaleOptimizer,
}


@pytest.fixture(scope="module")
def counts():
    return {
        (name, contender): healthy_step_traffic(make, wrap)
        for name, make in OPTIMIZERS.items()
        for contender, wrap in CONTENDERS.items()
    }


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_healthy_step_reads_and_writes_no_more_than_kerass_loss_scale_optimizer(counts, name):
    stock = counts[name, "stock"]
    keras_lso = counts[name, "Keras LossScaleOptimizer"]
    ours = counts[name, "MixedPrecisionModel"]
    assert ours[0] <= keras_lso[0] and ours[1] <= keras_lso[1], (stock, keras_lso, ours)
    # Beyond stock's update: the unscale (one read, one write) and the
    # fused norm (one read); the gated update itself adds nothing.
    assert (ours[0] - stock[0], ours[1] - stock[1]) == (2, 1)


def _design_table() -> dict[str, tuple[str, ...]]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    section = text[text.index("## What a healthy step reads and writes") :]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] in OPTIMIZERS:
            rows[cells[0]] = tuple(cells[1:])
    return rows


def _cell(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):g}"


def test_the_design_notes_table_is_what_the_graph_says(counts):
    table = _design_table()
    assert set(table) == set(OPTIMIZERS)
    for name, cells in table.items():
        expected = tuple(_cell(value) for contender in CONTENDERS for value in counts[name, contender])
        assert cells == expected, (name, cells, expected)
    assert re.search(
        r"\| optimizer \|", (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    )
