"""What do MixedPrecisionModel and the callbacks cost?

1. The same CNN, same data, same policy, trained with `keras.Model` and with
   `mp_callbacks.MixedPrecisionModel`.
2. MixedPrecisionModel with all three callbacks against none.
3. HeadroomMonitor (its probe at the default cadence, so once an epoch
   here: the float16 ranges, the bfloat16 replay in float32) against none:
   the probe's cost, paid only at its cadence.

One epoch each in alternation (the order flips every round, so drift on a
noisy machine hits both alike). Prints the ratio of epoch times per round,
their median and the ratio of best epochs (goal: <= 1.02 for both), and how
many times the callbacks read a value from the device per 1,000 steps.

    python benchmarks/overhead.py                       # mixed_bfloat16, 5 rounds
    python benchmarks/overhead.py --policy float32 --rounds 7
    python benchmarks/overhead.py --optimizer sgd --float8 --skip-model
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from _timing import add_threads_option, apply_threads, compare, report

import mp_callbacks as mp
from mp_callbacks_bench.data import synthetic_digits
from mp_callbacks_bench.reference_models import build_cnn


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_bfloat16", choices=mp.POLICIES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=128)
    add_threads_option(parser)
    parser.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    parser.add_argument(
        "--float8",
        action="store_true",
        help="the Dense layers quantized to float8 (the monitor's float8 figures)",
    )
    parser.add_argument("--skip-callbacks", action="store_true", help="only the model comparison")
    parser.add_argument("--skip-model", action="store_true", help="only the callbacks' comparisons")
    args = parser.parse_args(argv)
    apply_threads(args.threads)

    keras.mixed_precision.set_global_policy(args.policy)
    data = synthetic_digits(n_train=args.samples, n_test=500)
    print(
        f"policy {args.policy}, CNN, {args.samples} samples, batch {args.batch_size}, "
        f"{args.rounds} interleaved rounds, {args.optimizer}{', float8 Dense' if args.float8 else ''}, "
        f"threads {args.threads or 'default'}; "
        f"data: {data.description}"
    )

    def compiled(model):
        if args.float8:
            model.quantize("float8")
        optimizer = keras.optimizers.Adam() if args.optimizer == "adam" else keras.optimizers.SGD(0.01)
        model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    keras.utils.set_random_seed(0)
    ours = compiled(build_cnn(data.input_shape))
    if not args.skip_model:
        keras.utils.set_random_seed(0)
        stock = compiled(build_cnn(data.input_shape, model_class=keras.Model))
        times = compare(
            {"stock": (stock, []), "MixedPrecisionModel": (ours, [])}, data, args.rounds, args.batch_size
        )
        report("MixedPrecisionModel vs keras.Model (epoch time ratio)", times, "stock", "MixedPrecisionModel")

    if args.skip_callbacks:
        return
    callbacks = [mp.LossScaleMonitor(), mp.NaNGradientMonitor(), mp.EpochTimer()]
    # Counted where the callbacks read through TensorFlow's LossScaler.
    reads = count_device_reads() if keras.backend.backend() == "tensorflow" else None
    times = compare(
        {"no callbacks": (ours, []), "three callbacks": (ours, callbacks)}, data, args.rounds, args.batch_size
    )
    report(
        "MixedPrecisionModel: three callbacks vs none (epoch time ratio)",
        times,
        "no callbacks",
        "three callbacks",
    )
    steps = (args.rounds + 1) * -(-args.samples // args.batch_size)
    if reads is not None:
        print(
            f"  device reads by the callbacks: {reads['count']} in {steps} steps "
            f"= {1000 * reads['count'] / steps:.1f} per 1,000 steps "
            "(log tensors converted by the callbacks: 0; Keras itself converts the "
            "step logs once per step on the TensorFlow backend)"
        )
    headroom = [mp.HeadroomMonitor(probe=data.x_test[:32])]
    times = compare(
        {"no callbacks": (ours, []), "HeadroomMonitor": (ours, headroom)}, data, args.rounds, args.batch_size
    )
    report(
        "MixedPrecisionModel: HeadroomMonitor vs none (epoch time ratio)",
        times,
        "no callbacks",
        "HeadroomMonitor",
    )


def count_device_reads():
    """Counts every device-to-host read the callbacks make, by wrapping the
    methods they read through."""
    from mp_callbacks import epoch_timer, loss_scale

    reads = {"count": 0}

    def counted(function):
        def wrapper(*args, **kwargs):
            reads["count"] += 1
            return function(*args, **kwargs)

        return wrapper

    cls = loss_scale.LossScaler
    for name in ("diagnostics", "get_scale", "nonfinite_gradient_counts"):
        setattr(cls, name, counted(getattr(cls, name)))
    timer = epoch_timer.EpochTimer
    timer._count_samples = counted(timer._count_samples)
    return reads


if __name__ == "__main__":
    main()
