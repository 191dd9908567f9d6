"""What does MixedPrecisionModel cost over stock keras.Model?

The same CNN, same data, same policy, trained with `keras.Model` and with
`mp_callbacks.MixedPrecisionModel`, one epoch each in alternation (the order
flips every round, so drift on a noisy machine hits both alike). Prints the
ratio of epoch times (ours / stock) per round, their median and the ratio
of best epochs. Goal: <= 1.02.

    python benchmarks/overhead.py                       # mixed_bfloat16, 5 rounds
    python benchmarks/overhead.py --policy float32 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import mp_callbacks as mp  # noqa: E402
from mp_callbacks.data import synthetic_digits  # noqa: E402
from mp_callbacks.reference_models import build_cnn  # noqa: E402


class _EpochClock(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start


def timed_epoch(model, data, batch_size, callbacks=()) -> float:
    clock = _EpochClock()
    model.fit(data.x_train, data.y_train, batch_size=batch_size, epochs=1,
              verbose=0, callbacks=[*callbacks, clock])
    return clock.seconds


def compare(contenders, data, rounds, batch_size):
    """contenders: {name: (model, callbacks)}; returns {name: [seconds]}."""
    for model, callbacks in contenders.values():  # tracing and warm-up
        timed_epoch(model, data, batch_size, callbacks)
    times = {name: [] for name in contenders}
    names = list(contenders)
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            model, callbacks = contenders[name]
            times[name].append(timed_epoch(model, data, batch_size, callbacks))
    return times


def report(title, times, baseline, contender):
    ratios = [c / b for c, b in zip(times[contender], times[baseline])]
    print(f"\n{title}")
    for i, (b, c, r) in enumerate(zip(times[baseline], times[contender], ratios)):
        print(f"  round {i + 1}: {baseline} {b:6.2f} s   {contender} {c:6.2f} s   ratio {r:5.3f}")
    print(f"  median ratio {statistics.median(ratios):.3f}   "
          f"best-epoch ratio {min(times[contender]) / min(times[baseline]):.3f}")
    return statistics.median(ratios)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_bfloat16", choices=mp.POLICIES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args(argv)

    keras.mixed_precision.set_global_policy(args.policy)
    data = synthetic_digits(n_train=args.samples, n_test=500)
    print(f"policy {args.policy}, CNN, {args.samples} samples, batch {args.batch_size}, "
          f"{args.rounds} interleaved rounds; data: {data.description}")

    def compiled(model):
        model.compile(keras.optimizers.Adam(), "sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    keras.utils.set_random_seed(0)
    stock = compiled(build_cnn(data.input_shape, model_class=keras.Model))
    keras.utils.set_random_seed(0)
    ours = compiled(build_cnn(data.input_shape))
    times = compare({"stock": (stock, []), "MixedPrecisionModel": (ours, [])},
                    data, args.rounds, args.batch_size)
    report("MixedPrecisionModel vs keras.Model (epoch time ratio)", times,
           "stock", "MixedPrecisionModel")


if __name__ == "__main__":
    main()
