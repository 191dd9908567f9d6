"""What does a healthy training step cost on Keras's PyTorch backend?

The torch counterpart of `step_overhead.py`: each contender's train
function (as `fit` makes it) takes one step in turn, the order rotating
every step, on the same few batches, for `--steps` rounds. Torch on the CPU
runs eagerly, so each step is done when it returns. Prints each
contender's median step time and its ratios to stock Keras on torch: the
median of each round's own ratio ("paired"), and the ratios of the medians,
of the lower quartiles and of the fastest steps.

Contenders: stock `keras.Model`, `MixedPrecisionModel.from_model` on a copy
of the same layers (one host read per step, the forward pass's writes
deferred) and (`--peer`) stock `keras.Model` with Keras's own
`LossScaleOptimizer`, which on torch branches on the host as well.

    KERAS_BACKEND=torch python benchmarks/torch_step_overhead.py --model transformer --steps 300 --peer
    KERAS_BACKEND=torch python benchmarks/torch_step_overhead.py --model resnet50 --optimizer sgd --steps 40
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import torch
from _timing import BATCHES, OPTIMIZERS, contenders, print_step_ratios, step_batches, step_benchmark_arguments
from real_models import data_for, resnet50, transformer


def interleaved_steps(models, batches, steps: int) -> dict[str, list[float]]:
    step_of = {}
    for name, model in models.items():
        x, y = batches[0]
        model.fit(x.numpy(), y.numpy(), batch_size=len(x), epochs=1, verbose=0)  # builds as fit does
        model.make_train_function()
        step_of[name] = model.train_function
        for batch in batches[:3]:  # warm-up
            step_of[name]([batch])
    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        batch = batches[i % len(batches)]
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            step_of[name]([batch])
            times[name].append(time.perf_counter() - start)
    return times


def main(argv=None):
    args = step_benchmark_arguments(__doc__.splitlines()[0], "torch", argv, threads=True)
    torch.set_num_threads(args.threads)
    keras.mixed_precision.set_global_policy(args.policy)
    build = resnet50 if args.model == "resnet50" else transformer
    data = data_for(args.model, BATCHES * args.batch_size)
    size = args.batch_size
    batches = step_batches(data, size)
    models = contenders(build, OPTIMIZERS[args.optimizer], args.peer, args.revisions)
    print(
        f"{args.model}: {args.optimizer}, policy {args.policy}, {args.steps} interleaved steps of "
        f"{size}; torch {torch.__version__}, {args.threads} threads, Keras {keras.__version__}"
    )
    times = interleaved_steps(models, batches, args.steps)
    print_step_ratios(times)


if __name__ == "__main__":
    main()
