"""How deep is one healthy step? Library files and functions it enters.

Counts, with `sys.setprofile`, every mp_callbacks function entered (comprehensions
and lambdas included) by the first `train_on_batch` of a built and compiled
MLP under `mixed_float16`: on TensorFlow and JAX that call traces the step,
so this is the Python a reader follows through one step (later calls run
the traced graph; `--traced` counts one of those). Stock Keras's `LossScaleOptimizer` step is one file and 13
functions; PyTorch's `GradScaler` one file and 6 (issue 56's counts).

    KERAS_BACKEND=tensorflow python benchmarks/step_depth.py
    KERAS_BACKEND=jax python benchmarks/step_depth.py --list
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import mp_callbacks as mp

LIBRARY = str(pathlib.Path(mp.__file__).parent)


def entered_functions(run) -> dict[str, set[str]]:
    """{library file: {function names}} entered while `run()` runs."""
    entered: dict[str, set[str]] = collections.defaultdict(set)

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.startswith(LIBRARY):
            name = os.path.relpath(frame.f_code.co_filename, LIBRARY)
            entered[name].add(f"{frame.f_code.co_name}:{frame.f_code.co_firstlineno}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entered


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_float16", choices=mp.POLICIES)
    parser.add_argument("--list", action="store_true", help="print every function entered")
    parser.add_argument("--traced", action="store_true", help="count a call after the first")
    args = parser.parse_args(argv)
    keras.mixed_precision.set_global_policy(args.policy)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = mp.MixedPrecisionModel(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    model.compile(keras.optimizers.Adam(), "mse")
    x, y = np.ones((8, 16), "float32"), np.zeros((8, 1), "float32")
    if args.traced:
        model.train_on_batch(x, y)
    entered = entered_functions(lambda: model.train_on_batch(x, y))
    functions = sum(len(names) for names in entered.values())
    print(
        f"{keras.backend.backend()}, {args.policy}, {'a later' if args.traced else 'the first'} healthy train_on_batch: "
        f"{len(entered)} library files, {functions} library functions"
    )
    for name in sorted(entered):
        print(f"  {name}: {len(entered[name])}")
        if args.list:
            for function in sorted(entered[name]):
                print(f"      {function}")


if __name__ == "__main__":
    main()
