"""What does a healthy training step cost on Keras's JAX backend?

The JAX counterpart of `step_overhead.py`: each contender's `train_step`,
compiled with `jax.jit` and donating its state as `fit` compiles it, takes
one step in turn, the order rotating every step, on the same few batches,
for `--steps` rounds; each step is waited for (`block_until_ready`). Prints
each contender's median step time and its ratios to stock Keras on JAX: the
median of each round's own ratio ("paired"), and the ratios of the medians,
of the lower quartiles and of the fastest steps.

Contenders: stock `keras.Model`, `MixedPrecisionModel.from_model` on a copy
of the same layers and (`--peer`) stock `keras.Model` with Keras's own
`LossScaleOptimizer`, which on JAX keeps the weights and slots on a
non-finite step (but not BatchNormalization's statistics).

    KERAS_BACKEND=jax python benchmarks/jax_step_overhead.py --model transformer --steps 300 --peer
    KERAS_BACKEND=jax python benchmarks/jax_step_overhead.py --model resnet50 --optimizer sgd --steps 40
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras
from _timing import BATCHES, OPTIMIZERS, contenders, print_step_ratios, step_batches, step_benchmark_arguments
from real_models import data_for, resnet50, transformer


def _state(model: keras.Model) -> tuple:
    """The step's state as `fit` passes it, copied (the step donates it)."""
    return tuple(
        [jax.numpy.copy(v.value) for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )


def interleaved_steps(models, batches, steps: int) -> dict[str, list[float]]:
    step_of, state_of = {}, {}
    for name, model in models.items():
        x, y = batches[0]
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # builds as fit does
        step_of[name] = jax.jit(model.train_step, donate_argnums=0)
        state_of[name] = _state(model)
        for batch in batches[:3]:  # tracing and warm-up
            logs, state_of[name] = step_of[name](state_of[name], batch)
        jax.block_until_ready(state_of[name])
    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        batch = batches[i % len(batches)]
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            logs, state_of[name] = step_of[name](state_of[name], batch)
            jax.block_until_ready((logs, state_of[name]))
            times[name].append(time.perf_counter() - start)
    return times


def main(argv=None):
    args = step_benchmark_arguments(__doc__.splitlines()[0], "jax", argv, threads=False)
    keras.mixed_precision.set_global_policy(args.policy)
    build = resnet50 if args.model == "resnet50" else transformer
    data = data_for(args.model, BATCHES * args.batch_size)
    size = args.batch_size
    batches = step_batches(data, size)
    models = contenders(build, OPTIMIZERS[args.optimizer], args.peer, args.revisions)
    print(
        f"{args.model}: {args.optimizer}, policy {args.policy}, {args.steps} interleaved steps of "
        f"{size}; JAX {jax.__version__} on {jax.devices()[0].platform}, Keras {keras.__version__}"
    )
    times = interleaved_steps(models, batches, args.steps)
    print_step_ratios(times)


if __name__ == "__main__":
    main()
