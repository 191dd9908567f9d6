"""Does MixedPrecisionModel keep the speed-up that mixed precision buys?

Stock `keras.Model` and `MixedPrecisionModel` (with the three callbacks, as
`mp-callbacks bench` runs it), each under float32 and a mixed policy, the
same CNN and data. One epoch each per round, order rotating. Prints each
one's speed-up (float32 epoch time / mixed epoch time, medians over
rounds); ours must be at least as large as stock Keras's.

    python benchmarks/policy_speedup.py                      # mixed_bfloat16, cnn
    python benchmarks/policy_speedup.py --model mlp --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from _timing import compare

import mp_callbacks as mp
from mp_callbacks_bench.data import synthetic_digits
from mp_callbacks_bench.reference_models import MODELS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_bfloat16", choices=mp.POLICIES[1:])
    parser.add_argument("--model", default="cnn", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args(argv)
    data = synthetic_digits(n_train=args.samples, n_test=500)

    contenders = {}
    for policy in ("float32", args.policy):
        keras.mixed_precision.set_global_policy(policy)
        for label, model_class, callbacks in (
            ("stock", keras.Model, []),
            (
                "ours",
                mp.MixedPrecisionModel,
                [mp.LossScaleMonitor(), mp.NaNGradientMonitor(), mp.EpochTimer()],
            ),
        ):
            keras.utils.set_random_seed(0)
            model = MODELS[args.model](data.input_shape, model_class=model_class)
            model.compile(keras.optimizers.Adam(), "sparse_categorical_crossentropy", metrics=["accuracy"])
            contenders[f"{label} {policy}"] = (model, callbacks)
    keras.mixed_precision.set_global_policy("float32")

    print(f"{args.model}, {args.samples} samples, batch {args.batch_size}, {args.rounds} rounds")
    times = compare(contenders, data, args.rounds, args.batch_size)
    for name, seconds in times.items():
        print(
            f"  {name:<22} median epoch {statistics.median(seconds):.2f} s  "
            f"({', '.join(f'{s:.2f}' for s in seconds)})"
        )
    for label in ("stock", "ours"):
        float32 = statistics.median(times[f"{label} float32"])
        mixed = statistics.median(times[f"{label} {args.policy}"])
        print(f"{label:>5}: {args.policy} speed-up {float32 / mixed:.2f}x")


if __name__ == "__main__":
    main()
