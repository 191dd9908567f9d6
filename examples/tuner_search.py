"""A keras-tuner search over layer width *and* dtype policy.

`MixedPrecisionHyperModel` makes the policy a hyperparameter and sets it
only while each trial's model is built, so no trial's policy leaks into the
next or past the search. The three callbacks are passed to `search()`
(keras-tuner deep-copies them per trial) and `EpochTimer`'s `epoch_time`
is an objective beside validation accuracy. A few minutes on 2 CPU cores,
offline (built-in data).

    python examples/tuner_search.py --max-trials 4
"""

from __future__ import annotations

import argparse
import tempfile

import keras
import keras_tuner as kt

import mp_callbacks as mp
from mp_callbacks.data import synthetic_digits
from mp_callbacks.tuner import MixedPrecisionHyperModel


def build_model(hp) -> mp.MixedPrecisionModel:
    inputs = keras.Input((28, 28))
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(hp.Choice("units", [64, 256]), activation="relu")(x)
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(x)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile(keras.optimizers.Adam(hp.Choice("learning_rate", [1e-3, 3e-3])),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-samples", type=int, default=4000)
    parser.add_argument("--directory", default=None, help="where keras-tuner keeps trials (default: a temp dir)")
    args = parser.parse_args(argv)

    data = synthetic_digits(n_train=args.train_samples, n_test=1000)
    policies = ["float32", *mp.inspect_hardware().fast_policies]
    hypermodel = MixedPrecisionHyperModel(build_model, policies=policies)
    with tempfile.TemporaryDirectory() as scratch:
        tuner = kt.RandomSearch(
            hypermodel,
            objective=[kt.Objective("val_accuracy", "max"), kt.Objective("epoch_time", "min")],
            max_trials=args.max_trials, directory=args.directory or scratch,
            project_name="mp_callbacks_example", overwrite=True, seed=0,
        )
        tuner.search(data.x_train, data.y_train, epochs=args.epochs, batch_size=128,
                     validation_data=(data.x_test, data.y_test), verbose=0,
                     callbacks=[mp.EpochTimer(), mp.LossScaleMonitor(), mp.NaNGradientMonitor()])
        print(f"policies searched: {', '.join(policies)}; global policy after the search: "
              f"{keras.config.dtype_policy().name}")
        for trial in sorted(tuner.oracle.trials.values(), key=lambda t: t.score or 0):
            hp = trial.hyperparameters.values
            metrics = trial.metrics
            print(f"trial {trial.trial_id}: {hp['dtype_policy']:<15} units {hp['units']:<4} "
                  f"lr {hp['learning_rate']:<6} val_accuracy "
                  f"{metrics.get_best_value('val_accuracy'):.3f}  epoch_time "
                  f"{metrics.get_best_value('epoch_time'):.2f} s  score {trial.score:.3f}")
        best = tuner.get_best_hyperparameters(1)[0].values
    print(f"best: {best}")
    return best


if __name__ == "__main__":
    main()
