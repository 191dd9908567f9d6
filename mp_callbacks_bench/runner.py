"""The benchmark runs behind `mp-callbacks bench`: one model, several policies.

Each policy is trained in its own fresh Python process (`run_in_subprocess`)
so that its peak memory is its own and no dtype policy, graph or allocator
state leaks from one policy into the next. The worker (`run_policy`) trains
a `MixedPrecisionModel` with the three callbacks attached and returns one
result row; `compare` runs all policies and adds the speed-up against
float32.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import keras

import mp_callbacks  # noqa: F401  (checks Keras's backend before Keras loads)
from mp_callbacks_bench._native_stderr import is_startup_noise
from mp_callbacks_bench.settings import BenchError, BenchSettings

__all__ = ["HOPELESS_MARGIN", "EarlyVerdict", "compare", "run_in_subprocess", "run_policy"]

logger = logging.getLogger("mp_callbacks_bench")


def _on_gpu() -> bool:
    """Whether the backend Keras runs trains on a GPU."""
    if keras.backend.backend() == "jax":
        import jax

        return any(device.platform == "gpu" for device in jax.devices())
    if keras.backend.backend() == "torch":
        import torch

        return bool(torch.cuda.is_available())
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def _gpu_peak_bytes() -> float | None:
    if keras.backend.backend() == "jax":
        import jax

        stats = jax.devices("gpu")[0].memory_stats() or {}
        return stats.get("peak_bytes_in_use")
    if keras.backend.backend() == "torch":
        import torch

        return float(torch.cuda.max_memory_allocated())
    import tensorflow as tf

    return tf.config.experimental.get_memory_info("GPU:0")["peak"]


def _peak_memory_mb() -> float | None:
    """Peak device memory on GPU, else the process's peak resident memory
    (None where it cannot be read: Windows, a GPU that does not say)."""
    if _on_gpu():
        peak = _gpu_peak_bytes()
        return None if peak is None else peak / 2**20
    try:
        import resource

        # ru_maxrss is in kilobytes on Linux, bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)
    except ImportError:  # Windows
        return None


class _ProgressLine(keras.callbacks.Callback):
    """One compact line per epoch, through logging (the worker's log goes
    to stderr; stdout stays free)."""

    def __init__(self, policy: str) -> None:
        super().__init__()
        self.policy = policy

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        nan = float("nan")
        logger.info(
            "  %-15s epoch %d/%s: %.2f s, loss %.4f, accuracy %.3f, loss scale %g",
            self.policy,
            epoch + 1,
            self.params.get("epochs"),
            logs.get("epoch_time", nan),
            logs.get("loss", nan),
            logs.get("accuracy", nan),
            logs.get("loss_scale", nan),
        )


#: A policy stops early only if, even this many times faster than its first
#: epoch's warm steps ran, it would still be slower than float32. Epochs
#: vary by up to 30 % on a shared 2-core machine; 1.5 leaves room for that.
HOPELESS_MARGIN = 1.5


class EarlyVerdict(keras.callbacks.Callback):
    """Stops a mixed policy's training after its first epoch when its
    verdict is already certain: the steps of the epoch's second half (traced
    and warm), even `margin` times faster, would give an epoch slower than
    float32's `baseline_epoch_time`. `estimate` (its epoch time at the rate
    of those steps) and `reason` are set when it stops. Only timestamps are
    taken per batch: no tensor is read."""

    def __init__(
        self,
        baseline_epoch_time: float,
        margin: float = HOPELESS_MARGIN,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__()
        self.baseline_epoch_time = baseline_epoch_time
        self.margin = margin
        self.clock = clock
        self.estimate: float | None = None
        self.reason: str | None = None
        self._batch_ends: list[float] = []
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._batch_ends = []

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == 0:
            self._batch_ends.append(self.clock())

    def on_epoch_end(self, epoch, logs=None):
        ends = self._batch_ends
        if epoch != 0 or len(ends) < 4:
            return  # too few steps to time warm ones apart from the first
        half = len(ends) // 2
        per_step = (ends[-1] - ends[half]) / (len(ends) - 1 - half)
        estimate = per_step * len(ends)
        if estimate / self.margin <= self.baseline_epoch_time:
            return
        self.estimate = estimate
        self.reason = (
            f"stopped after its first epoch: its warm steps ran at {self.baseline_epoch_time / estimate:.2f}x "
            f"float32's speed, and even {self.margin:g}x faster it would not tie"
        )
        self.model.stop_training = True


def run_policy(policy: str, settings: BenchSettings) -> dict[str, Any]:
    """Trains the benchmark model under `policy` in this process and
    returns its result row."""
    import mp_callbacks as mp
    from mp_callbacks_bench.data import load_dataset
    from mp_callbacks_bench.footprint import estimate_step_memory
    from mp_callbacks_bench.user_model import build_model, parse_model_spec

    spec = parse_model_spec(settings.model)
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(settings.seed)
    data = load_dataset(settings.dataset, seed=settings.seed, allow_download=False)
    data = data.take(settings.train_samples, settings.test_samples)
    model = build_model(spec, data.input_shape, data.num_classes)
    timer = mp.EpochTimer()
    scale_monitor = mp.LossScaleMonitor()
    nan_monitor = mp.NaNGradientMonitor(action="stop")
    callbacks: list[keras.callbacks.Callback] = [scale_monitor, nan_monitor, timer]
    early = None
    if settings.stop_early and settings.baseline_epoch_time and policy != "float32":
        early = EarlyVerdict(settings.baseline_epoch_time)
        callbacks.append(early)
    if not settings.quiet:
        callbacks.append(_ProgressLine(policy))
    history = model.fit(
        data.x_train,
        data.y_train,
        batch_size=settings.batch_size,
        epochs=settings.epochs,
        callbacks=callbacks,
        verbose=0,
    )
    evaluation = model.evaluate(
        data.x_test, data.y_test, batch_size=settings.batch_size, verbose=0, return_dict=True
    )
    summary = timer.summary()
    accuracy = evaluation.get("accuracy", evaluation.get("sparse_categorical_accuracy"))
    epoch_time, samples_per_sec = summary["median_epoch_time"], summary["median_samples_per_sec"]
    stopped_early = None if early is None or early.estimate is None else early.reason
    if early is not None and early.estimate is not None:
        # The first epoch includes tracing: its warm steps' rate stands for the policy.
        samples_per_sec = samples_per_sec * epoch_time / early.estimate if samples_per_sec else None
        epoch_time = early.estimate
        logger.warning("[%s] %s", policy, stopped_early)
    return {
        "policy": policy,
        "epoch_time": epoch_time,
        "first_epoch_time": summary["first_epoch_time"],
        "samples_per_sec": samples_per_sec,
        "stopped_early": stopped_early,
        "speedup": None,
        "peak_memory_mb": _peak_memory_mb(),
        "memory_kind": "device peak" if _on_gpu() else "process peak RSS",
        "estimated_step_memory": estimate_step_memory(model, settings.batch_size),
        "accuracy": None if accuracy is None else float(accuracy),
        "loss": float(evaluation["loss"]),
        "optimizer": type(getattr(model.optimizer, "inner_optimizer", model.optimizer)).__name__,
        "skipped_steps": int(sum(history.history.get("skipped_steps", []))),
        "final_loss_scale": _final_loss_scale(model),
        "epochs": len(history.history["loss"]),
        "diverged": nan_monitor.error is not None,
        "data": data.description,
    }


def _final_loss_scale(model) -> float | None:
    getter = getattr(model, "get_scale", None)
    return float(getter()) if getter is not None else None


def run_in_subprocess(policy: str, settings: BenchSettings) -> dict[str, Any]:
    """`run_policy` in a fresh Python process; raises BenchError on failure."""
    with tempfile.TemporaryDirectory() as directory:
        result_path = os.path.join(directory, "result.json")
        # The parent's import path goes along, so that a user's model module
        # importable here (a notebook's sys.path included) is importable there.
        request = json.dumps(
            {
                "policy": policy,
                "settings": asdict(settings),
                "out": result_path,
                "sys_path": [p for p in sys.path if p],
            }
        )
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        # The child's stderr is read here line by line: TensorFlow's C++
        # start-up lines are dropped (TF_CPP_MIN_LOG_LEVEL does not silence
        # them all), everything else is shown as it comes, unless quiet.
        process = subprocess.Popen(
            [sys.executable, "-m", "mp_callbacks_bench.runner", request],
            env=env,
            stdout=subprocess.DEVNULL if settings.quiet else None,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        kept: list[str] = []
        assert process.stderr is not None  # stderr=PIPE above
        for line in process.stderr:
            if is_startup_noise(line) or not line.strip():
                continue
            kept.append(line.rstrip("\n"))
            if not settings.quiet:
                sys.stderr.write(line)
        returncode = process.wait()
        if returncode != 0 or not os.path.exists(result_path):
            detail = kept[-1].removeprefix("error: ") if kept else "no output"
            raise BenchError(f"the {policy} run failed (exit code {returncode}): {detail}")
        with open(result_path, encoding="utf-8") as handle:
            return json.load(handle)


def compare(
    settings: BenchSettings,
    in_subprocess: bool = True,
    failed: list[dict[str, str]] | None = None,
    runner: Any = None,
) -> list[dict[str, Any]]:
    """Runs every policy `settings.repeats` times, alternating the order
    (A B, B A, ...), keeps each policy's fastest run, and adds `speedup`
    (float32 epoch time / this one). The spread across runs is kept:
    `epoch_times_of_runs`, `epoch_time_min`/`_max`, `accuracy_min`/`_max`.

    A mixed policy whose run fails is dropped from the comparison, and
    `{"policy", "reason"}` appended to `failed` (a float32 run that fails
    raises: there is nothing to compare with). `runner(policy, settings)`
    runs one policy (default: in a subprocess, or in this one)."""
    if runner is None:
        runner = run_in_subprocess if in_subprocess else run_policy
    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in settings.policies}
    failed = [] if failed is None else failed
    bound = max(settings.repeats, settings.max_repeats or 0)
    for repeat in range(bound):
        if repeat >= settings.repeats and _separated(runs):
            break  # more runs would not change the verdict
        order = settings.policies if repeat % 2 == 0 else settings.policies[::-1]
        for policy in order:
            if policy not in runs or any(r.get("stopped_early") for r in runs[policy]):
                continue  # failed earlier, or its verdict is certain
            if not settings.quiet:
                run = f" (run {repeat + 1}/{settings.repeats})" if settings.repeats > 1 else ""
                if repeat >= settings.repeats:
                    run = f" (run {repeat + 1}: the runs so far do not separate)"
                logger.info("[%s] training %s%s ...", policy, settings.model, run)
            float32_runs = runs.get("float32") or []
            asked = settings
            if (
                settings.stop_early
                and policy != "float32"
                and float32_runs
                and float32_runs[0].get("epoch_time")
            ):
                asked = replace(settings, baseline_epoch_time=float32_runs[0]["epoch_time"])
            try:
                runs[policy].append(runner(policy, asked))
            except Exception as error:
                if policy == "float32":
                    raise
                first = (str(error).strip().splitlines() or [""])[0]
                failed.append(
                    {"policy": policy, "reason": f"its run failed: {type(error).__name__}: {first}"}
                )
                logger.warning("[%s] dropped: %s", policy, failed[-1]["reason"])
                del runs[policy]
    results = []
    for policy in settings.policies:
        if policy not in runs:
            continue
        best = min(runs[policy], key=lambda r: r["epoch_time"] or float("inf"))
        times = [r["epoch_time"] for r in runs[policy] if r["epoch_time"] is not None]
        best["epoch_times_of_runs"] = [r["epoch_time"] for r in runs[policy]]
        best["epoch_time_min"] = min(times, default=None)
        best["epoch_time_max"] = max(times, default=None)
        accuracies = [r["accuracy"] for r in runs[policy] if r.get("accuracy") is not None]
        best["accuracy_min"] = min(accuracies, default=None)
        best["accuracy_max"] = max(accuracies, default=None)
        results.append(best)
    baseline = next((r for r in results if r["policy"] == "float32"), None)
    for result in results:
        if baseline is not None and result["epoch_time"]:
            result["speedup"] = baseline["epoch_time"] / result["epoch_time"]
    return results


def _separated(runs: dict[str, list[dict[str, Any]]]) -> bool:
    """True when every mixed policy's alternating runs clearly separate from
    float32's (`mp.SpeedComparison.decided`)."""
    from mp_callbacks import SpeedComparison

    baseline = [r["epoch_time"] for r in runs.get("float32", [])]
    for policy, policy_runs in runs.items():
        if policy == "float32" or not baseline or any(r.get("stopped_early") for r in policy_runs):
            continue
        ratios = [b / r["epoch_time"] for b, r in zip(baseline, policy_runs) if r["epoch_time"]]
        if not SpeedComparison(ratios).decided:
            return False
    return True


def _worker(argv: list[str]) -> int:
    request = json.loads(argv[0])
    settings = BenchSettings(**request["settings"])
    sys.path.extend(p for p in request.get("sys_path", []) if p not in sys.path)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logger.setLevel(logging.WARNING if settings.quiet else logging.INFO)
    try:
        result = run_policy(request["policy"], settings)
    except BenchError as error:  # the parent shows this last line
        print(f"error: {error}", file=sys.stderr)
        return 3
    with open(request["out"], "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
