"""One worker of the MultiWorkerMirroredStrategy test (run as a script).

TF_CONFIG comes from the parent test; the result goes to the .npz path in
argv[1]. Not collected by pytest (no test_ prefix).

It trains with fit() and the three callbacks, validates and evaluates:
stock Keras 3.15 cannot run fit() under MultiWorkerMirroredStrategy at
all; MixedPrecisionModel works around its trainer there.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import mp_callbacks as mp


def main(out_path: str) -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = x[:, :3].argmax(axis=1)
    x[37] = np.nan  # one sample: one worker's shard of one step goes non-finite
    x_val = rng.normal(size=(32, 6)).astype("float32")
    y_val = x_val[:, :3].argmax(axis=1)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        outputs = keras.layers.Dense(3, activation="softmax")(hidden)
        model = mp.MixedPrecisionModel(
            inputs, outputs, loss_scale=mp.LossScaler(initial_scale=256.0, growth_interval=3)
        )
        model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    # One poisoned batch is not a divergence. Whether its loss is NaN too
    # depends on the CPU (oneDNN's relu of NaN is NaN on some, 0 on others):
    # patience=2 makes the run the same on both.
    callbacks = [
        mp.LossScaleMonitor(max_skipped_fraction=1.0),
        mp.NaNGradientMonitor(patience=2),
        mp.EpochTimer(),
    ]
    history = model.fit(
        x,
        y,
        epochs=2,
        batch_size=16,
        shuffle=False,
        verbose=0,
        validation_data=(x_val, y_val),
        callbacks=callbacks,
    ).history
    evaluation = model.evaluate(x_val, y_val, batch_size=16, verbose=0, return_dict=True)
    state = model.scaler.diagnostics()
    np.savez(
        out_path,
        *model.get_weights(),
        scale=state["scale"],
        skipped=state["skipped_steps"],
        skipped_per_epoch=np.array(history["skipped_steps"]),
        loss_scale_log=np.array(history["loss_scale"]),
        val_loss=np.array(history["val_loss"]),
        epoch_time_logged=np.array([len(history["epoch_time"])]),
        evaluate_loss=evaluation["loss"],
        iterations=int(model.optimizer.iterations.numpy()),
    )


if __name__ == "__main__":
    main(sys.argv[1])
