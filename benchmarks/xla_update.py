"""Is the optimizer's update compiled by XLA the same as TensorFlow's, and how fast?

A skip that waits for the decision cannot overlap the update with the
backward pass; a cheaper update would pay for the wait. XLA fuses an
update into one pass over each variable and its slots. This script applies
the same gradients to two copies of ResNet50's trainable variables (23.6 M
parameters), one optimizer's `apply` traced as a plain `tf.function`
(stock Keras without XLA), the other compiled by XLA, and reports how many
values differ after a few steps (as bits) and the paired ratio of the two
updates' times (XLA / plain, the median over interleaved rounds).

XLA's CPU backend contracts a multiply and an add into one FMA, which
rounds once, where TensorFlow's kernels round twice: run it again with
`XLA_FLAGS=--xla_cpu_max_isa=AVX` (no FMA instructions) to see that
difference go. The flag holds for the whole process. docs/design.md
("Under XLA") has the figures.

    python benchmarks/xla_update.py --optimizer adam --threads 2
    XLA_FLAGS=--xla_cpu_max_isa=AVX python benchmarks/xla_update.py --optimizer adam
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from update_only import OPTIMIZERS, parse_with_rounds

STEPS = 6


def _copies(make_optimizer, values, jit_compile: bool):
    variables = [keras.Variable(v.copy()) for v in values]
    optimizer = make_optimizer()
    optimizer.build(variables)

    @tf.function(jit_compile=jit_compile)
    def update(gradients):
        optimizer.apply(gradients, variables)

    return variables, optimizer, update


def _bits(tensors) -> list[np.ndarray]:
    return [np.asarray(t.numpy()).reshape(-1).view(np.uint8) for t in tensors]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    args, shapes = parse_with_rounds(parser, argv, default_rounds=30)
    rng = np.random.default_rng(0)
    values = [rng.normal(size=shape).astype("float32") * 0.01 for shape in shapes]
    gradients = [[tf.constant(rng.normal(size=s).astype("float32") * 0.01) for s in shapes] for _ in range(3)]
    plain = _copies(OPTIMIZERS[args.optimizer], values, jit_compile=False)
    xla = _copies(OPTIMIZERS[args.optimizer], values, jit_compile=True)
    for step in range(STEPS):
        plain[2](gradients[step % 3])
        xla[2](gradients[step % 3])
    plain_state = _bits(plain[0] + plain[1].variables)
    xla_state = _bits(xla[0] + xla[1].variables)
    # Compared as 4-byte words: every variable here is float32 or int64.
    differing = sum(
        int((a.view(np.uint32) != b.view(np.uint32)).sum()) for a, b in zip(plain_state, xla_state)
    )
    total = sum(a.size // 4 for a in plain_state)
    ratios = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        plain[2](gradients[0])
        middle = time.perf_counter()
        xla[2](gradients[0])
        ratios.append((time.perf_counter() - middle) / (middle - start))
    print(
        f"{args.optimizer} on ResNet50's variables, TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    print(f"  after {STEPS} steps: {differing} of {total} values differ from TensorFlow's kernels")
    print(
        f"  update time, XLA / plain tf.function: {statistics.median(ratios):.3f} (paired, {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
