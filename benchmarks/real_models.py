"""What does MixedPrecisionModel cost on real architectures?

ResNet50 (keras.applications, weights=None, 32x32x3 inputs, 10 classes;
214 trainable variables, 53 BatchNormalization layers) and a small
Transformer encoder (Embedding, MultiHeadAttention, LayerNormalization,
feed-forward), each trained with stock `keras.Model` and with
`MixedPrecisionModel.from_model` on the same layers' copy, one epoch of
`--steps` steps each in alternation (the order flips every round). Prints
per-round ratios, their median and the best-epoch ratio (goal: <= 1.03).

`--peer` adds a third contender: stock `keras.Model` with Keras's own
`keras.optimizers.LossScaleOptimizer`, which also skips non-finite steps
and so also applies no update before every gradient is checked; its ratio
to stock is what skipping costs in Keras itself.

    python benchmarks/real_models.py                      # both, Adam, float32, 5 rounds
    python benchmarks/real_models.py --optimizer adamw
    python benchmarks/real_models.py --model transformer --policy mixed_bfloat16
"""

from __future__ import annotations

import argparse
import os
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from _timing import OPTIMIZERS, add_real_model_options, apply_threads, compare, report

import mp_callbacks as mp

VOCABULARY, SEQUENCE = 1000, 64


def resnet50():
    return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)


def transformer(width: int = 64, heads: int = 4):
    tokens = keras.Input((SEQUENCE,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, width)(tokens)
    for _ in range(2):
        attended = keras.layers.MultiHeadAttention(heads, width // heads)(x, x)
        x = keras.layers.LayerNormalization()(x + attended)
        hidden = keras.layers.Dense(4 * width, activation="relu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(hidden))
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(x)
    return keras.Model(tokens, outputs)


def data_for(name: str, samples: int):
    rng = np.random.default_rng(0)
    if name == "resnet50":
        x = rng.normal(size=(samples, 32, 32, 3)).astype("float32")
    else:
        x = rng.integers(0, VOCABULARY, size=(samples, SEQUENCE)).astype("int32")
    y = rng.integers(0, 10, size=(samples,)).astype("int64")
    return types.SimpleNamespace(x_train=x, y_train=y)


def main(argv=None):
    import tensorflow as tf  # here: the models above are built on JAX too (jax_step_overhead.py)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_real_model_options(parser, mp.POLICIES, ["resnet50", "transformer", "both"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    keras.mixed_precision.set_global_policy(args.policy)
    names = ["resnet50", "transformer"] if args.model == "both" else [args.model]
    for name in names:
        build = resnet50 if name == "resnet50" else transformer
        data = data_for(name, args.steps * args.batch_size)
        keras.utils.set_random_seed(0)
        stock = build()
        keras.utils.set_random_seed(0)
        ours = mp.MixedPrecisionModel.from_model(build())
        for model in (stock, ours):
            model.compile(OPTIMIZERS[args.optimizer](), "sparse_categorical_crossentropy")
        contenders = {"stock": (stock, []), "MixedPrecisionModel": (ours, [])}
        if args.peer:
            keras.utils.set_random_seed(0)
            peer = build()
            # auto_scale_loss=False: compile must not wrap it a second time.
            peer.compile(
                keras.optimizers.LossScaleOptimizer(OPTIMIZERS[args.optimizer]()),
                "sparse_categorical_crossentropy",
                auto_scale_loss=False,
            )
            contenders["keras LossScaleOptimizer"] = (peer, [])
        print(
            f"{name}: {args.optimizer}, policy {args.policy}, {len(stock.trainable_variables)} trainable variables, "
            f"{args.steps} steps of {args.batch_size} per epoch, {args.rounds} interleaved rounds, "
            f"threads {args.threads or 'default'}; "
            f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
        )
        times = compare(contenders, data, args.rounds, args.batch_size)
        report(
            f"{name}: MixedPrecisionModel vs keras.Model (epoch time ratio)",
            times,
            "stock",
            "MixedPrecisionModel",
        )
        if args.peer:
            report(
                f"{name}: keras.Model + Keras's LossScaleOptimizer vs keras.Model",
                times,
                "stock",
                "keras LossScaleOptimizer",
            )


if __name__ == "__main__":
    main()
