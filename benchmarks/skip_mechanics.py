"""Where does skipping a step cost time? Stock Keras's step, changed one way at a time.

Trains the small Transformer of `real_models.py` (or ResNet50) with:
  stock       keras.Model, unchanged;
  wait        every gradient checked for finiteness before the update runs
              (a control dependency: the waiting, without a `tf.cond`);
  empty_cond  the same, but waiting on an empty `tf.cond` (the graph gains
              control flow, nothing runs in it);
  cond        the optimizer update inside `tf.cond(all finite)`, which is
              what Keras's own LossScaleOptimizer does;
  ours        MixedPrecisionModel.from_model (no loss scaling in float32).
One epoch each per round, interleaved; prints each one's median ratio to
stock over the rounds and its best-epoch ratio.

    python benchmarks/skip_mechanics.py --rounds 25 --steps 60
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _timing import add_threads_option, apply_threads, compare
from real_models import data_for, resnet50, transformer

import mp_callbacks as mp


def _all_finite(grads):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])


def stock_step_with(kind: str) -> type:
    """A keras.Model whose train_step is stock Keras's, changed by `kind`."""

    class Variant(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self._compute_loss(x=x, y=y, y_pred=y_pred, training=True)
                self._loss_tracker.update_state(loss, sample_weight=tf.shape(x)[0])
            variables = self.trainable_variables
            grads = tape.gradient(loss, variables)
            finite = _all_finite(grads)
            if kind == "cond":
                tf.cond(
                    finite,
                    lambda: self.optimizer.apply(grads, variables) or tf.constant(True),
                    lambda: tf.constant(False),
                )
            else:
                gate = (
                    finite
                    if kind == "wait"
                    else tf.cond(finite, lambda: tf.constant(1.0), lambda: tf.constant(0.0))
                )
                with tf.control_dependencies([gate]):
                    grads = [tf.identity(g) for g in grads]
                self.optimizer.apply(grads, variables)
            return self.compute_metrics(x, y, y_pred)

    return Variant


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["transformer", "resnet50"], default="transformer")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=60, help="steps per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    add_threads_option(parser)
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    build = transformer if args.model == "transformer" else resnet50
    data = data_for(args.model, args.steps * args.batch_size)

    models = {}
    keras.utils.set_random_seed(0)
    models["stock"] = build()
    for kind in ("wait", "empty_cond", "cond"):
        keras.utils.set_random_seed(0)
        base = build()
        models[kind] = stock_step_with(kind)(base.inputs, base.outputs)
    keras.utils.set_random_seed(0)
    models["ours"] = mp.MixedPrecisionModel.from_model(build())
    for model in models.values():
        model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    print(
        f"{args.model}: float32, {args.steps} steps of {args.batch_size} per epoch, "
        f"{args.rounds} interleaved rounds, threads {args.threads or 'default'}; "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    )
    times = compare({name: (model, []) for name, model in models.items()}, data, args.rounds, args.batch_size)
    for name in models:
        ratios = [t / s for t, s in zip(times[name], times["stock"])]
        print(
            f"  {name:11s} median ratio {statistics.median(ratios):.3f}   "
            f"best-epoch ratio {min(times[name]) / min(times['stock']):.3f}"
        )


if __name__ == "__main__":
    main()
