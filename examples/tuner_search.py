"""A keras-tuner search over layer width *and* dtype policy.

`MixedPrecisionHyperModel` makes the policy a hyperparameter and sets it
only while each trial's model is built, so no trial's policy leaks into the
next or past the search. The three callbacks are passed to `search()`
(keras-tuner deep-copies them per trial), so every trial logs
`epoch_time`.

The objective is validation accuracy alone: the best trial is the most
accurate one. (A keras-tuner list of objectives is scored by adding them
up, accuracy and seconds alike, which ranks trials by a number with no
meaning.) The cost is then read beside it: the fastest trial within half a
point of the best accuracy is printed too, with its policy.

The policies searched are float32 and every mixed policy that the
hardware probe does not measure as emulated (pathologically slow) on this
machine, so the search compares policies even where none is faster: that
is worth knowing. A few minutes on 2 CPU cores, offline (built-in data).

    python examples/tuner_search.py --max-trials 4
"""

from __future__ import annotations

import argparse
import tempfile

import keras
import keras_tuner as kt

import mp_callbacks as mp
from mp_callbacks.tuner import MixedPrecisionHyperModel
from mp_callbacks_bench.data import synthetic_digits


def build_model(hp) -> mp.MixedPrecisionModel:
    inputs = keras.Input((28, 28))
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(hp.Choice("units", [64, 256]), activation="relu")(x)
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(x)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile(
        keras.optimizers.Adam(hp.Choice("learning_rate", [1e-3, 3e-3])),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-samples", type=int, default=4000)
    parser.add_argument(
        "--directory", default=None, help="where keras-tuner keeps trials (default: a temp dir)"
    )
    args = parser.parse_args(argv)

    data = synthetic_digits(n_train=args.train_samples, n_test=1000)
    hardware = mp.inspect_hardware()
    emulated = hardware.slow_policies()
    policies = [p for p in mp.POLICIES if p not in emulated]
    hypermodel = MixedPrecisionHyperModel(build_model, policies=policies)
    with tempfile.TemporaryDirectory() as scratch:
        tuner = kt.RandomSearch(
            hypermodel,
            objective=kt.Objective("val_accuracy", "max"),
            max_trials=args.max_trials,
            directory=args.directory or scratch,
            project_name="mp_callbacks_example",
            overwrite=True,
            seed=0,
        )
        tuner.search(
            data.x_train,
            data.y_train,
            epochs=args.epochs,
            batch_size=128,
            validation_data=(data.x_test, data.y_test),
            verbose=0,
            callbacks=[mp.EpochTimer(), mp.LossScaleMonitor(), mp.NaNGradientMonitor()],
        )
        print(
            f"policies searched: {', '.join(policies)}; global policy after the search: "
            f"{keras.config.dtype_policy().name}"
        )
        for policy, reason in emulated.items():
            print(f"not searched: {policy} ({reason})")
        rows = []
        for trial in tuner.oracle.trials.values():
            if trial.score is None:
                continue
            rows.append(
                {
                    **trial.hyperparameters.values,
                    "val_accuracy": trial.metrics.get_best_value("val_accuracy"),
                    "epoch_time": trial.metrics.get_best_value("epoch_time"),
                }
            )
        rows.sort(key=lambda row: -row["val_accuracy"])
        for row in rows:
            print(
                f"{row['dtype_policy']:<15} units {row['units']:<4} lr {row['learning_rate']:<6} "
                f"val_accuracy {row['val_accuracy']:.3f}  epoch_time {row['epoch_time']:.2f} s"
            )
    best = rows[0]
    near_best = [row for row in rows if row["val_accuracy"] >= best["val_accuracy"] - 0.005]
    fastest = min(near_best, key=lambda row: row["epoch_time"])
    print(
        f"most accurate: {best['dtype_policy']}, units {best['units']}, lr {best['learning_rate']} "
        f"(val_accuracy {best['val_accuracy']:.3f}, {best['epoch_time']:.2f} s/epoch)"
    )
    print(
        f"fastest within 0.5 points of it: {fastest['dtype_policy']}, units {fastest['units']}, "
        f"lr {fastest['learning_rate']} (val_accuracy {fastest['val_accuracy']:.3f}, "
        f"{fastest['epoch_time']:.2f} s/epoch)"
    )
    return {"best": best, "fastest_near_best": fastest, "policies": policies}


if __name__ == "__main__":
    main()
