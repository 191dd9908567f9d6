"""What does gating an Adam-like update of large variables cost, in isolation?

Three writes per weight (two slots and the weight, as Adam and AdamW make)
to ResNet50-sized variables, each inside one `tf.function`, timed as
interleaved single calls (the order rotating every round) and reported as
the median of each round's ratio to Keras's own in-place `assign_add`:

- `in place`: Keras's write, ungated (the reference);
- `pick new or old`: the new value computed, then it or the old value
  picked with a scalar `Select` and assigned (how `_gated_update` gates an
  increment to a variable of more than 65,536 elements);
- `in place, gated zero`: the increment or a zero picked with a scalar
  `Select`, then added in place (how it gates a smaller one).

    python benchmarks/large_variable_writes.py --threads 2 --rounds 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from _timing import add_threads_option, apply_threads

# Kernel shapes of ResNet50's last stages and its classifier.
SHAPES = [(3, 3, 512, 512)] * 3 + [(1, 1, 1024, 2048)] * 3 + [(3, 3, 256, 256)] * 6 + [(2048, 1000)]


def in_place(variable, increment, predicate):
    variable.assign_add(increment)


def pick_new_or_old(variable, increment, predicate):
    old = variable.read_value()
    variable.assign(tf.raw_ops.Select(condition=predicate, x=old + increment, y=old), read_value=False)


def in_place_gated_zero(variable, increment, predicate):
    zero = tf.fill(increment.shape, tf.constant(-0.0))
    variable.assign_add(tf.raw_ops.Select(condition=predicate, x=increment, y=zero))


def adam_like_update(write, weights, gradients):
    @tf.function
    def update(predicate):
        for (weight, first, second), gradient in zip(weights, gradients):
            write(first, (gradient - first) * 0.1, predicate)
            write(second, (tf.square(gradient) - second) * 0.001, predicate)
            write(weight, -0.001 * first / (tf.sqrt(second) + 1e-7), predicate)

    return update


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_threads_option(parser)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    apply_threads(args.threads)
    weights = [[tf.Variable(tf.random.normal(shape)) for _ in range(3)] for shape in SHAPES]
    gradients = [tf.random.normal(shape) for shape in SHAPES]
    updates = {
        name: adam_like_update(write, weights, gradients)
        for name, write in [
            ("in place", in_place),
            ("pick new or old", pick_new_or_old),
            ("in place, gated zero", in_place_gated_zero),
        ]
    }
    predicate = tf.constant(True)
    for update in updates.values():
        for _ in range(3):  # tracing and warm-up
            update(predicate)
    names = list(updates)
    times = {name: [] for name in names}
    for i in range(args.rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            updates[name](predicate)
            times[name].append(time.perf_counter() - start)
    print(
        f"Adam-like update of {len(SHAPES)} variables ({sum(tf.TensorShape(s).num_elements() for s in SHAPES):,} "
        f"weights), {args.rounds} interleaved rounds, threads {args.threads or 'default'}"
    )
    for name in names:
        paired = statistics.median(a / b for a, b in zip(times[name], times["in place"]))
        print(
            f"  {name:22s} median {statistics.median(times[name]) * 1e3:7.2f} ms   paired ratio {paired:.3f}"
        )


if __name__ == "__main__":
    main()
