"""What does a training step trace? Counted, not timed.

A change that claims to cost a healthy step nothing (a move of code, a
rename) should trace the same graph. This script traces `train_step` of
`MixedPrecisionModel.from_model` as the work tree has it and as it was at
each `--revisions` commit, on the same model, and prints the number of
operations by type (the step's graph and every function in it, `tf.cond`
branches included). The counts are the same on every run and machine, so
one run answers where timings (`step_overhead.py --revisions`) need many.

    python benchmarks/step_graph.py --revisions HEAD~1
    python benchmarks/step_graph.py --model resnet50 --optimizer adam --policy mixed_float16 --revisions 78f7cf4
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _revisions import package_at
from _timing import OPTIMIZERS
from real_models import data_for, resnet50, transformer

import mp_callbacks as mp

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
MODELS = {"transformer": transformer, "resnet50": resnet50}


def traced_ops(model_class, build, optimizer, data, batch_size: int) -> collections.Counter:
    """Operations by type in the traced `train_step` of `model_class.from_model(build())`."""
    keras.utils.set_random_seed(0)
    model = model_class.from_model(build())
    model.compile(optimizer(), "sparse_categorical_crossentropy")
    x, y = data.x_train[:batch_size], data.y_train[:batch_size]
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)  # builds as fit does
    spec = (tf.TensorSpec(x.shape, tf.as_dtype(x.dtype)), tf.TensorSpec(y.shape, tf.as_dtype(y.dtype)))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    ops = collections.Counter(op.type for op in graph.get_operations())
    for function in graph._functions.values():  # the branches and nested functions
        ops.update(node.op for node in function.definition.node_def)
    return ops


def differences(base: collections.Counter, other: collections.Counter) -> dict[str, int]:
    """other - base, per op type, where they differ."""
    return {op: other[op] - base[op] for op in sorted(set(base) | set(other)) if other[op] != base[op]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="transformer")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--policy", choices=POLICIES, default="float32")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--revisions",
        nargs="+",
        required=True,
        metavar="REV",
        help="git revisions to compare the work tree with",
    )
    args = parser.parse_args(argv)
    if keras.backend.backend() != "tensorflow":
        parser.error(f"traces TensorFlow graphs; KERAS_BACKEND is {keras.backend.backend()!r}")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1; got {args.batch_size}")
    keras.mixed_precision.set_global_policy(args.policy)
    data = data_for(args.model, args.batch_size)
    optimizer = OPTIMIZERS[args.optimizer]
    build = MODELS[args.model]
    ours = traced_ops(mp.MixedPrecisionModel, build, optimizer, data, args.batch_size)
    print(
        f"{args.model}, {args.optimizer}, {args.policy}: the work tree traces {sum(ours.values())} operations"
    )
    same = True
    for revision in args.revisions:
        theirs = traced_ops(package_at(revision).MixedPrecisionModel, build, optimizer, data, args.batch_size)
        changed = differences(theirs, ours)
        same = same and not changed
        verdict = "the same operations" if not changed else f"differs (work tree - revision): {changed}"
        print(f"  {revision}: {sum(theirs.values())} operations, {verdict}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
