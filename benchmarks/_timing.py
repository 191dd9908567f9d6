"""Interleaved epoch timing shared by the benchmarks (not a test)."""

from __future__ import annotations

import statistics
import time

import keras


def add_threads_option(parser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="TensorFlow intra- and inter-op threads (0: TensorFlow's default)",
    )


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.01),
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "adamw": lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.004),
}


BATCHES = 8
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def contenders(build, optimizer, peer: bool, revisions=()) -> dict[str, keras.Model]:
    """Stock Keras, MixedPrecisionModel on a copy of the same layers,
    MixedPrecisionModel as it was at each of `revisions` (git revisions of
    this repository) and (peer) stock Keras with Keras's
    LossScaleOptimizer, compiled alike (the JAX and torch step benchmarks)."""
    import mp_callbacks as mp

    models = {}
    keras.utils.set_random_seed(0)
    models["stock"] = build()
    keras.utils.set_random_seed(0)
    models["MixedPrecisionModel"] = mp.MixedPrecisionModel.from_model(build())
    if revisions:
        from _revisions import package_at

        for revision in revisions:
            keras.utils.set_random_seed(0)
            models[f"MixedPrecisionModel@{revision}"] = package_at(revision).MixedPrecisionModel.from_model(
                build()
            )
    for model in models.values():
        model.compile(optimizer(), "sparse_categorical_crossentropy")
    if peer:
        keras.utils.set_random_seed(0)
        models["keras LossScaleOptimizer"] = build()
        models["keras LossScaleOptimizer"].compile(
            keras.optimizers.LossScaleOptimizer(optimizer()), "sparse_categorical_crossentropy"
        )
    return models


def add_revisions_option(parser) -> None:
    parser.add_argument(
        "--revisions",
        nargs="+",
        default=[],
        metavar="REV",
        help="also time MixedPrecisionModel as it was at these git revisions",
    )


def step_benchmark_arguments(description: str, backend: str, argv=None, threads: bool = False):
    """The options the JAX and torch step benchmarks share, parsed and
    checked (on `backend` only: each times its own backend's step)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", choices=["resnet50", "transformer"], default="transformer")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--policy", default="float32", choices=POLICIES)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300, help="interleaved rounds of one step each")
    if threads:
        parser.add_argument("--threads", type=int, default=2, help="intra-op threads")
    parser.add_argument(
        "--peer", action="store_true", help="also time stock keras.Model with Keras's LossScaleOptimizer"
    )
    add_revisions_option(parser)
    args = parser.parse_args(argv)
    if keras.backend.backend() != backend:
        parser.error(f"runs on Keras's {backend} backend; KERAS_BACKEND is {keras.backend.backend()!r}")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1; got {args.steps}")
    if threads and args.threads < 1:
        parser.error(f"--threads must be at least 1; got {args.threads}")
    return args


def step_batches(data, batch_size: int) -> list[tuple]:
    """`BATCHES` batches of `data`'s training split as the backend's tensors
    (the JAX and torch step benchmarks)."""
    return [
        tuple(
            keras.ops.convert_to_tensor(part[i * batch_size : (i + 1) * batch_size])
            for part in (data.x_train, data.y_train)
        )
        for i in range(BATCHES)
    ]


def add_real_model_options(parser, policies, models) -> None:
    """The options real_models.py and step_overhead.py share."""
    parser.add_argument("--model", choices=models, default=models[-1])
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adam",
        help="the optimizer every contender trains with (a new one each)",
    )
    parser.add_argument("--policy", default="float32", choices=policies)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--peer",
        action="store_true",
        help="also time stock keras.Model with keras.optimizers.LossScaleOptimizer",
    )
    add_threads_option(parser)


def apply_threads(threads: int) -> None:
    """Must run before TensorFlow executes its first op."""
    if threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


class EpochClock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start


def timed_epoch(model, data, batch_size, callbacks=()) -> float:
    clock = EpochClock()
    model.fit(
        data.x_train, data.y_train, batch_size=batch_size, epochs=1, verbose=0, callbacks=[*callbacks, clock]
    )
    return clock.seconds


def compare(contenders, data, rounds, batch_size):
    """contenders: {name: (model, callbacks)}; one epoch each per round, the
    order rotating every round; returns {name: [seconds per round]}."""
    for model, callbacks in contenders.values():  # tracing and warm-up
        timed_epoch(model, data, batch_size, callbacks)
    times = {name: [] for name in contenders}
    names = list(contenders)
    for round_index in range(rounds):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        if round_index % 2:
            order = order[::-1]
        for name in order:
            model, callbacks = contenders[name]
            times[name].append(timed_epoch(model, data, batch_size, callbacks))
    return times


def report(title, times, baseline, contender):
    ratios = [c / b for c, b in zip(times[contender], times[baseline])]
    print(f"\n{title}")
    for i, (b, c, r) in enumerate(zip(times[baseline], times[contender], ratios)):
        print(f"  round {i + 1}: {baseline} {b:6.2f} s   {contender} {c:6.2f} s   ratio {r:5.3f}")
    print(
        f"  median ratio {statistics.median(ratios):.3f}   "
        f"best-epoch ratio {min(times[contender]) / min(times[baseline]):.3f}"
    )
    return statistics.median(ratios)


def print_step_ratios(times: dict[str, list[float]]) -> None:
    """Each contender's median step and its ratios to "stock": paired (the
    median of each round's own ratio, so that a drift of the machine within
    the run cancels out round by round), and of the medians, the lower
    quartiles and the fastest steps."""
    stock = sorted(times["stock"])
    for name, values in times.items():
        paired = statistics.median(a / b for a, b in zip(values, times["stock"]))
        values = sorted(values)
        quartile = len(values) // 4
        print(
            f"  {name:34s} median {statistics.median(values) * 1e3:8.2f} ms   ratio to stock: "
            f"paired {paired:.3f}   "
            f"median {statistics.median(values) / statistics.median(stock):.3f}   "
            f"lower quartile {values[quartile] / stock[quartile]:.3f}   "
            f"fastest {values[0] / stock[0]:.3f}"
        )
