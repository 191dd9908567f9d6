"""What does the skip cost the optimizer's update alone, on ResNet-sized variables?

The update is where a gated skip can cost something (docs/design.md, "What
a healthy step reads and writes"), and its share of a step grows where the
rest of the step gets faster: on a GPU, and with mixed precision. This
script times the update alone, for every trainable variable of
`keras.applications.ResNet50` (23.6 M parameters, 214 variables), with the
same gradients every call:

- `stock`: the optimizer's own `apply` (no loss scaling);
- `keras LossScaleOptimizer`: Keras's `LossScaleOptimizer.apply`
  (unscale, finiteness check, the update in a `tf.cond`);
- `ours`: `mp_callbacks.LossScaleOptimizer.apply` (unscale, the fused
  norm, then the update: compiled by XLA for these three optimizers,
  docs/design.md "The update compiled by XLA"; gated for others).

Each contender has its own copy of the variables and its own optimizer;
each call is one `tf.function`, timed as interleaved single calls (the
order rotating every round), reported as the median of each round's ratio
to stock ("paired").

    python benchmarks/update_only.py --threads 2 --rounds 60
    python benchmarks/update_only.py --optimizers adam --rounds 100
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
from _timing import add_threads_option, apply_threads

import mp_callbacks as mp

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.004),
    "sgd-momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
}
CONTENDERS = {
    "stock": lambda optimizer: optimizer,
    "keras LossScaleOptimizer": keras.optimizers.LossScaleOptimizer,
    "ours": mp.LossScaleOptimizer,
}


def resnet50_shapes() -> list[tuple[int, ...]]:
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    return [tuple(v.shape) for v in model.trainable_variables]


def update_functions(make_optimizer, shapes):
    rng = np.random.default_rng(0)
    values = [rng.normal(size=shape).astype("float32") * 0.01 for shape in shapes]
    # Gradients as a scaled loss gives them (2**15 times the true ones):
    # the two loss-scaling contenders unscale; stock takes them unscaled.
    gradients = [tf.constant(v) for v in values]
    scaled = [tf.constant(v * 2.0**15) for v in values]
    functions = {}
    for name, wrap in CONTENDERS.items():
        variables = [keras.Variable(v.copy()) for v in values]
        optimizer = wrap(make_optimizer())
        optimizer.build(variables)
        functions[name] = _update(optimizer, gradients if name == "stock" else scaled, variables)
    return functions


def _update(optimizer, gradients, variables):
    @tf.function
    def update():
        optimizer.apply(gradients, variables)

    return update


def interleaved(functions, rounds: int) -> dict[str, list[float]]:
    for function in functions.values():  # tracing and warm-up
        function()
        function()
    names = list(functions)
    times = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            functions[name]()
            times[name].append(time.perf_counter() - start)
    return times


def parse_with_rounds(parser, argv, default_rounds: int):
    """Adds --rounds and --threads to `parser`, parses `argv`, applies the
    threads; returns the arguments and ResNet50's variable shapes (the
    setup every update-alone benchmark shares)."""
    parser.add_argument(
        "--rounds", type=int, default=default_rounds, help=f"interleaved rounds (default {default_rounds})"
    )
    add_threads_option(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    apply_threads(args.threads)
    return args, resnet50_shapes()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=sorted(OPTIMIZERS), metavar="NAME"
    )
    args, shapes = parse_with_rounds(parser, argv, default_rounds=60)
    print(
        f"ResNet50's {len(shapes)} variables ({sum(int(np.prod(s)) for s in shapes):,} parameters), "
        f"{args.rounds} interleaved rounds, threads {args.threads or 'default'}; "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    )
    for name in args.optimizers:
        times = interleaved(update_functions(OPTIMIZERS[name], shapes), args.rounds)
        stock = times["stock"]
        print(f"{name}: stock update median {statistics.median(stock) * 1e3:.2f} ms")
        for contender in CONTENDERS:
            if contender == "stock":
                continue
            paired = statistics.median(a / b for a, b in zip(times[contender], stock))
            print(
                f"  {contender:26s} median {statistics.median(times[contender]) * 1e3:8.2f} ms   "
                f"paired ratio to stock {paired:.3f}"
            )


if __name__ == "__main__":
    main()
