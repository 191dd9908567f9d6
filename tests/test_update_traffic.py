"""What a healthy step reads and writes of a large variable, counted on the
traced graph: stock Keras's update, Keras's `LossScaleOptimizer`, ours.

Ours compiles a verified optimizer's update with XLA: that part is counted
on XLA's optimized HLO (its healthy branch), where each top-level
instruction (a fusion, a copy) reads each full-size operand once and writes
each full-size output once; parameters, tuples and their elements forward.

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
from mp_callbacks.backends.tensorflow.compiled_update import compilable, compiled_update_function

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
CALLS = {"PartitionedCall", "StatefulPartitionedCall"}
OPTIMIZERS = {
    "Adam": keras.optimizers.Adam,
    "AdamW": keras.optimizers.AdamW,
    "SGD with momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "SGD": lambda: keras.optimizers.SGD(0.1),
    # Not compiled (XLA would round its divide by a square root otherwise): gated.
    "RMSprop": keras.optimizers.RMSprop,
}
HLO_FULL = "f32[" + ",".join(str(d) for d in SHAPE) + "]"
HLO_FORWARDING = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast"}


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


def _closing(text: str) -> int:
    """Index of the parenthesis that closes one opened just before `text`."""
    depth = 1
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return index
    raise ValueError(f"no closing parenthesis in {text!r}")


def _hlo_instructions(hlo: str) -> dict[str, list[tuple[str, str, str, list[str], str]]]:
    """Per computation of an HLO module's text: (name, shape, opcode,
    operand names, attributes) of each instruction."""
    computations: dict[str, list] = {}
    current = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) \(.*\{$", line)
        if header:
            current = computations.setdefault("ENTRY" if line.startswith("ENTRY") else header[1], [])
            continue
        body = re.match(r"^\s+(?:ROOT )?%(\S+) = (.*)$", line)
        if current is None or not body:
            continue
        rest = body[2]
        # A tuple shape has spaces in it: it ends at its closing parenthesis.
        end = _closing(rest[1:]) + 2 if rest.startswith("(") else rest.index(" ")
        shape, rest = rest[:end], rest[end + 1 :]
        opcode, rest = rest[: rest.index("(")], rest[rest.index("(") + 1 :]
        end = _closing(rest)
        operands = re.findall(r"%([\w.\-]+)", rest[:end])
        current.append((body[1], shape, opcode, operands, rest[end + 1 :]))
    return computations


def _hlo_traffic(hlo: str) -> tuple[Fraction, Fraction]:
    """(reads, writes) of full-size float32 tensors by the healthy path of
    the compiled module: the entry, and each conditional's true branch."""
    computations = _hlo_instructions(hlo)

    def count(name: str) -> tuple[Fraction, Fraction]:
        reads = writes = Fraction(0)
        shapes = {instruction[0]: instruction[1] for instruction in computations[name]}
        for _, shape, opcode, operands, attributes in computations[name]:
            if opcode in HLO_FORWARDING:
                continue
            if opcode == "conditional":
                taken = re.search(r"(?:true_computation=|branch_computations=\{)%([\w.\-]+)", attributes)
                branch = count(taken[1])
                reads, writes = reads + branch[0], writes + branch[1]
                continue
            reads += sum(shapes.get(operand, "").startswith(HLO_FULL) for operand in operands)
            writes += shape.count(HLO_FULL)
        return reads, writes

    return count("ENTRY")


def _xla_calls(graph, ops) -> list:
    return [op for op in ops if op.type in CALLS and _must_compile(op)]


def _must_compile(op) -> bool:
    try:
        return bool(op.get_attr("_XlaMustCompile"))
    except ValueError:
        return False


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
    gradient = tf.fill(SHAPE, 1e-3)
    predicates = step(gradient)
    taken = {name: bool(value) for name, value in zip(traced["conds"], predicates)}
    reads, writes = _traffic(traced["graph"], traced["ops"], taken)
    calls = _xla_calls(traced["graph"], traced["ops"])
    if calls:
        # The update compiled by XLA: counted on what XLA made of it. Its
        # call's own inputs are the variables' handles and the unscaled
        # gradient, which the HLO's parameters stand for.
        assert len(calls) == 1
        inner = optimizer.inner_optimizer
        function = compiled_update_function(inner, [variable])
        hlo = function.experimental_get_compiler_ir(tf.constant(True), [gradient])(stage="optimized_hlo")
        compiled = _hlo_traffic(hlo)
        call_inputs = sum(_full(t) for t in calls[0].inputs)
        reads, writes = reads - call_inputs + compiled[0], writes + compiled[1]
    return reads, writes


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
    variable = keras.Variable(np.ones(SHAPE, "float32"))
    if compilable(OPTIMIZERS[name](), [tf.ones(SHAPE)], [variable]):
        # Beyond the unscale and the norm (as below), XLA's fused update
        # reads and writes less than stock's op-by-op one.
        assert ours[0] - 2 < stock[0] and ours[1] - 1 < stock[1], (stock, ours)
    else:
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
