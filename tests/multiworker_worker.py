"""One worker of the MultiWorkerMirroredStrategy test (run as a script).

TF_CONFIG comes from the parent test; the result goes to the .npz path in
argv[1]. Not collected by pytest (no test_ prefix).

Keras 3.15's fit() cannot run under MultiWorkerMirroredStrategy for any
model (its trainer reduces scalar logs with strategy.reduce(..., axis=0)),
so the worker drives MixedPrecisionModel.train_step with strategy.run, as
a custom multi-worker loop does.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import mp_callbacks as mp  # noqa: E402


def main(out_path: str) -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = x[:, :3].argmax(axis=1)
    x[37] = np.nan  # one sample: one worker's shard of one step goes non-finite
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        outputs = keras.layers.Dense(3, activation="softmax")(hidden)
        model = mp.MixedPrecisionModel(
            inputs, outputs, loss_scale=mp.DynamicLossScale(initial_scale=256.0, growth_interval=3)
        )
        model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    distributed = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def train_step(batch):
        return strategy.run(model.train_step, args=(batch,))

    skipped_per_epoch = []
    for _ in range(2):
        model.reset_metrics()
        for batch in distributed:
            logs = train_step(batch)
        skipped = strategy.experimental_local_results(logs["skipped_steps"])[0]
        skipped_per_epoch.append(float(skipped))
    state = model.loss_scale.diagnostics()
    np.savez(
        out_path,
        *model.get_weights(),
        scale=state["scale"],
        skipped=state["skipped_steps"],
        skipped_per_epoch=np.array(skipped_per_epoch),
        iterations=int(model.optimizer.iterations.numpy()),
    )


if __name__ == "__main__":
    main(sys.argv[1])
