"""One rank of the torch.distributed tests (run as a script, not collected).

argv: rank, world size, the mode, the JSON path for the result. The parent
sets MASTER_ADDR and MASTER_PORT. Modes:

* "ddp": keras-io's recipe, a Keras model in `DistributedDataParallel`,
  with `mp.LossScaleOptimizer` over Keras's SGD in a hand-written loop;
* "local": the same loop without DDP, each rank's gradients its own (only
  the flag's reduction keeps the ranks together);
* "fit": `MixedPrecisionModel.fit` in each rank on its own data.

On the second step rank 1's batch holds a NaN.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"

import keras
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import mp_callbacks as mp


def _batches(rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(rank)
    batches = []
    for step in range(3):
        x = rng.normal(size=(8, 4)).astype("float32")
        if step == 1 and rank == 1:
            x[0, 0] = np.nan
        batches.append((x, x.sum(axis=1, keepdims=True)))
    return batches


def _model(cls=keras.Sequential) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    return (keras.Model if cls is keras.Sequential else cls)(inputs, keras.layers.Dense(1)(hidden))


def _hand_written(rank: int, ddp: bool) -> list[dict]:
    model = _model()
    forward = DistributedDataParallel(model) if ddp else model
    optimizer = mp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**8)
    weights = list(model.trainable_weights)
    optimizer.build(weights)
    steps = []
    for x, y in _batches(rank):
        model.zero_grad()
        prediction = forward(torch.as_tensor(x), training=True)
        loss = keras.ops.mean((prediction - torch.as_tensor(y)) ** 2)
        optimizer.scale_loss(loss).backward()
        optimizer.apply([w.value.grad for w in weights], weights)
        steps.append(
            {
                "iterations": int(optimizer.iterations.numpy()),
                "scale": optimizer.get_scale(),
                "weights": [w.numpy().tolist() for w in weights],
            }
        )
    return steps


def _fit(rank: int) -> list[dict]:
    model = _model(mp.MixedPrecisionModel)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    steps = []
    for x, y in _batches(rank):
        logs = model.fit(x, y, batch_size=8, verbose=0).history
        steps.append(
            {
                "iterations": int(model.optimizer.iterations.numpy()),
                "skipped": logs["skipped_steps"][0],
                "scale": model.get_scale(),
                "state": {k: float(v) for k, v in model.loss_scale_state().items()},
            }
        )
    return steps


def main(rank: int, world_size: int, mode: str, out_path: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        steps = _fit(rank) if mode == "fit" else _hand_written(rank, ddp=mode == "ddp")
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as file:
        json.dump(steps, file)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
