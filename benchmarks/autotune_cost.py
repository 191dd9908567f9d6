"""What does `mp.autotune` cost, and what does its plan buy against bench's
best whole-model policy?

For each model (the built-in CNN, a small Transformer encoder, and
keras.applications MobileNetV3Small at 32x32), on random or built-in data:

* the wall time of `mp.autotune` (default candidates: float32 and every
  mixed policy the probe does not measure as emulated here);
* the plan's speed-up over float32 (median of paired rounds, and the
  middle half), from the plan's own evidence;
* `run_bench`'s best whole-model policy and its speed-up over float32 on
  the same model (the bench trains whole epochs in separate processes);
* the ratio of the two speed-ups (plan / bench's best).

    python benchmarks/autotune_cost.py                   # all three
    python benchmarks/autotune_cost.py --model cnn --steps 60
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np

import mp_callbacks as mp

SEQUENCE, VOCABULARY = 64, 1000


def transformer():
    import real_models

    model = real_models.transformer()
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def mobilenet():
    import keras

    model = keras.applications.MobileNetV3Small(
        weights=None, input_shape=(32, 32, 3), classes=10, include_preprocessing=False
    )
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _data(name: str, samples: int):
    from mp_callbacks_bench.data import synthetic_digits

    rng = np.random.default_rng(0)
    if name == "cnn":
        data = synthetic_digits(n_train=samples, n_test=samples // 4)
        return data.x_train, data.y_train, data.x_test, data.y_test
    if name == "transformer":
        x = rng.integers(0, VOCABULARY, size=(samples, SEQUENCE)).astype("int32")
        y = (x[:, 0] % 10).astype("int64")  # learnable from the first token
    else:
        x = rng.normal(size=(samples, 32, 32, 3)).astype("float32")
        y = (x[:, :4, :4, 0].mean(axis=(1, 2)) > 0).astype("int64")
    cut = samples * 4 // 5
    return x[:cut], y[:cut], x[cut:], y[cut:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "transformer", "mobilenet", "all"], default="all")
    parser.add_argument("--steps", type=int, default=60, help="proof steps per candidate")
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    from mp_callbacks_bench import run_bench

    names = ["cnn", "transformer", "mobilenet"] if args.model == "all" else [args.model]
    targets = {
        "cnn": "mp_callbacks_bench.reference_models:build_cnn",
        "transformer": "autotune_cost:transformer",
        "mobilenet": "autotune_cost:mobilenet",
    }
    for name in names:
        x, y, x_val, y_val = _data(name, args.samples)
        build_args = [list(x.shape[1:]), 10] if name == "cnn" else []
        began = time.monotonic()
        plan = mp.autotune(
            targets[name],
            x,
            y,
            validation_data=(x_val, y_val),
            steps=args.steps,
            batch_size=args.batch_size,
            build_args=build_args,
        )
        wall = time.monotonic() - began
        chosen = next(c for c in plan.candidates if c["policy"] == plan.policy)
        print(
            f"\n{name}: autotune {wall:.0f} s on {plan.measured_on}; plan {plan.policy}"
            f"{' + ' + ', '.join(plan.float32_layers) if plan.float32_layers else ''}"
        )
        print(plan.table())
        if name == "cnn":
            report = run_bench("cnn", epochs=3, batch_size=args.batch_size, train_samples=len(x), repeats=2)
        else:
            report = None  # bench's --model needs class scores on its datasets: compare on ours
        plan_speedup = chosen.get("speedup") or 1.0
        if report is not None:
            best = next((r for r in report.results if r["policy"] == report.recommended_policy), None)
            bench_speedup = (best or {}).get("speedup") or 1.0
            print(
                f"bench's best whole-model policy: {report.recommended_policy} "
                f"({bench_speedup:.2f}x); plan {plan_speedup:.2f}x; "
                f"plan / bench {plan_speedup / bench_speedup:.3f}"
            )
        else:
            whole = max(
                (c for c in plan.candidates if not c.get("float32_layers")),
                key=lambda c: c.get("speedup") or 0.0,
            )
            print(
                f"best whole-model candidate in the same rounds: {whole['policy']} "
                f"({whole.get('speedup') or 1.0:.2f}x); plan {plan_speedup:.2f}x"
            )


if __name__ == "__main__":
    main()
