"""What does a healthy training step cost, step by step?

Epoch ratios (`real_models.py`) move by several points between runs on
these machines. This script interleaves single steps instead: each
contender's `train_step` (in a `tf.function`, as `fit` runs it) takes one
step in turn, the order rotating every step, on the same few batches, for
`--steps` rounds. Slow drifts of the machine then hit every contender
alike, and the median of a thousand steps moves by about a point between
runs. Prints each contender's median step time and its ratios to stock
Keras: the median of each round's own ratio ("paired"), and the ratios of
the medians, of the lower quartiles and of the fastest steps.

It also times stock Keras's optimizer update alone (the same gradients
every time, interleaved with the steps) and prints its share of the stock
step: the skip's cost lies in the update, so a figure from one machine can
be read on another through that share.

Contenders: stock `keras.Model`, `MixedPrecisionModel.from_model` on a copy
of the same layers, (`--peer`) stock `keras.Model` with Keras's own
`LossScaleOptimizer`, which skips non-finite steps with a `tf.cond`, and
(`--revisions`) `MixedPrecisionModel` as it was at other git revisions of
this repository, to measure a change against what it changes.

    python benchmarks/step_overhead.py --threads 2 --steps 1000 --peer
    python benchmarks/step_overhead.py --model resnet50 --optimizer sgd --threads 2 --steps 100
    python benchmarks/step_overhead.py --threads 2 --steps 1000 --revisions HEAD~1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _revisions import package_at
from _timing import OPTIMIZERS, add_real_model_options, add_revisions_option, apply_threads, print_step_ratios
from real_models import data_for, resnet50, transformer

import mp_callbacks as mp

BATCHES = 8


def contenders(
    build, optimizer, peer: bool, revisions=(), jit_compile: bool = False
) -> dict[str, keras.Model]:
    models = {}
    keras.utils.set_random_seed(0)
    models["stock"] = build()
    keras.utils.set_random_seed(0)
    models["MixedPrecisionModel"] = mp.MixedPrecisionModel.from_model(build())
    for revision in revisions:
        package = package_at(revision)
        keras.utils.set_random_seed(0)
        models[f"MixedPrecisionModel@{revision}"] = package.MixedPrecisionModel.from_model(build())
    for model in models.values():
        # The model is told, as fit would tell it: MixedPrecisionModel keeps
        # fixed-shape state under XLA.
        model.compile(optimizer(), "sparse_categorical_crossentropy", jit_compile=jit_compile)
    if peer:
        keras.utils.set_random_seed(0)
        models["keras LossScaleOptimizer"] = build()
        models["keras LossScaleOptimizer"].compile(
            keras.optimizers.LossScaleOptimizer(optimizer()),
            "sparse_categorical_crossentropy",
            auto_scale_loss=False,
            jit_compile=jit_compile,
        )
    return models


UPDATE = "stock update alone"


def stock_update(model, batch, jit_compile: bool = False):
    """Stock's optimizer update alone, as one call: the gradients of `batch`
    (computed once) applied to the model's variables."""
    x, y = batch
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    gradients = tape.gradient(loss, model.trainable_variables)

    @tf.function(jit_compile=jit_compile)
    def update():
        model.optimizer.apply(gradients, model.trainable_variables)

    return update


def interleaved_steps(models, batches, steps: int, jit_compile: bool = False) -> dict[str, list[float]]:
    steps_of = {}
    for name, model in models.items():
        # One short fit builds the optimizer and metrics as fit would.
        x, y = batches[0]
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
        steps_of[name] = tf.function(model.train_step, jit_compile=jit_compile)
        for batch in batches[:3]:  # tracing and warm-up
            steps_of[name](batch)
    update = stock_update(models["stock"], batches[0], jit_compile)
    update()
    steps_of[UPDATE] = lambda batch: update()
    names = list(steps_of)
    times = {name: [] for name in names}
    for i in range(steps):
        batch = batches[i % len(batches)]
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps_of[name](batch)
            times[name].append(time.perf_counter() - start)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_real_model_options(parser, mp.POLICIES, ["resnet50", "transformer"])
    parser.add_argument("--steps", type=int, default=1000, help="interleaved rounds of one step each")
    parser.add_argument(
        "--jit-compile",
        action="store_true",
        help="compile every step with XLA, as Keras's jit_compile='auto' does on a GPU",
    )
    add_revisions_option(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1; got {args.steps}")
    apply_threads(args.threads)
    keras.mixed_precision.set_global_policy(args.policy)
    build = resnet50 if args.model == "resnet50" else transformer
    data = data_for(args.model, BATCHES * args.batch_size)
    batches = [
        (
            tf.constant(data.x_train[i * args.batch_size : (i + 1) * args.batch_size]),
            tf.constant(data.y_train[i * args.batch_size : (i + 1) * args.batch_size]),
        )
        for i in range(BATCHES)
    ]
    try:
        models = contenders(build, OPTIMIZERS[args.optimizer], args.peer, args.revisions, args.jit_compile)
    except ValueError as error:
        parser.error(str(error))
    print(
        f"{args.model}: {args.optimizer}, policy {args.policy}, {args.steps} interleaved steps of "
        f"{args.batch_size}, threads {args.threads or 'default'}"
        f"{', XLA' if args.jit_compile else ''}; "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    )
    times = interleaved_steps(models, batches, args.steps, args.jit_compile)
    update = times.pop(UPDATE)
    share = statistics.median(a / b for a, b in zip(update, times["stock"]))
    print(
        f"  optimizer update: {statistics.median(update) * 1e3:.2f} ms, "
        f"{share:.1%} of the stock step (paired)"
    )
    print_step_ratios(times)


if __name__ == "__main__":
    main()
