"""`run_tune`: `mp-callbacks tune` as a function: `mp.autotune` on a
benchmark model spec and dataset, with bench's checks before any training.

    from mp_callbacks_bench.tune import run_tune

    plan = run_tune("my_models:build", dataset="data.npz", quick=True)
    print(plan)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mp_callbacks_bench.settings import POLICIES, BenchError, BenchSettings, Preset

__all__ = ["QUICK_TUNE", "plot_plan", "run_tune"]

logger = logging.getLogger("mp_callbacks_bench")

#: `tune --quick`: the CNN on 4,000 built-in images, 60 proof steps.
QUICK_TUNE: Preset = {"model": "cnn", "train_samples": 4000, "test_samples": 1000, "steps": 60}


def run_tune(
    model: str | None = None,
    *,
    policies: Sequence[str] | None = None,
    dataset: str = "synthetic",
    steps: int | None = None,
    time_budget: float | None = None,
    batch_size: int = 128,
    seed: int = 0,
    train_samples: int | None = None,
    test_samples: int | None = None,
    tolerance: float = 0.01,
    quick: bool = False,
    probe: bool = True,
) -> Any:
    """Runs `mp.autotune` on a bench model spec ("mlp", "cnn",
    "module:function", "path/to/file.py:function") and dataset; returns the
    `PrecisionPlan`. A bad spec, dataset or model fails in one line
    (BenchError) before any training."""
    import mp_callbacks as mp
    from mp_callbacks_bench.api import _check_inputs
    from mp_callbacks_bench.data import load_dataset
    from mp_callbacks_bench.user_model import parse_model_spec

    preset: Preset = QUICK_TUNE if quick else {}
    text = model or preset.get("model", "mlp")
    spec = parse_model_spec(text)
    candidates = (*POLICIES, "float8")  # float8: per layer, within a mixed policy
    for policy in policies or ():
        if policy not in candidates:
            raise BenchError(f"unknown policy {policy!r}: choose from {', '.join(candidates)}")
    if policies and "float8" in policies and not any(p.startswith("mixed_") for p in policies):
        raise BenchError(
            "--policies float8 needs a mixed policy beside it: float8 is a per-layer candidate within one"
        )
    settings = BenchSettings(
        policies=[p for p in policies or POLICIES if p != "float8"],
        model=text,
        dataset=dataset,
        batch_size=batch_size,
        seed=seed,
        train_samples=train_samples or preset.get("train_samples"),
        test_samples=test_samples or preset.get("test_samples"),
    )
    _check_inputs(settings)
    data = load_dataset(dataset, seed=seed, allow_download=False)
    data = data.take(settings.train_samples, settings.test_samples)
    if spec.kind == "built-in":
        build, build_args = (
            f"mp_callbacks_bench.reference_models:build_{spec.target}",
            [list(data.input_shape), data.num_classes],
        )
    else:
        build, build_args = spec.text, []
    hardware = mp.inspect_hardware(measure=probe and not policies)
    logger.info(
        "mp-callbacks tune: model %s on %s; device: %s", text, data.description, hardware.device_summary()
    )
    try:
        return mp.autotune(
            build,
            data.x_train,
            data.y_train,
            validation_data=(data.x_test, data.y_test),
            policies=list(policies) if policies else None,
            steps=steps or preset.get("steps"),
            time_budget=time_budget,
            tolerance=tolerance,
            batch_size=batch_size,
            build_args=build_args,
            hardware=hardware,
            seed=seed,
        )
    except (ValueError, TypeError, RuntimeError) as error:
        raise BenchError(str(error).splitlines()[0]) from error


def plot_plan(plan: Any, path: str) -> None:
    """Two panels per candidate: step time (with the speed-up and its
    spread written on top) and the validation metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    candidates = plan.candidates
    names = [c["policy"] for c in candidates]
    positions = range(len(candidates))
    figure, (time_axis, metric_axis) = plt.subplots(1, 2, figsize=(10, 4))
    times = [1000 * (c.get("step_time") or 0.0) for c in candidates]
    colors = ["tab:green" if c.get("verdict") == "chosen" else "tab:blue" for c in candidates]
    time_axis.bar(positions, times, color=colors)
    time_axis.set_ylabel("step time (ms), median of paired rounds")
    time_axis.set_ylim(0, max(times, default=1.0) * 1.3 or 1.0)
    time_axis.set_title("step time (lower is better)")
    for index, candidate in enumerate(candidates):
        if candidate.get("speedup"):
            spread = candidate.get("speedup_range")
            label = f"{candidate['speedup']:.2f}x" + (f"\n{spread[0]:.2f}-{spread[1]:.2f}" if spread else "")
            time_axis.annotate(
                label,
                (index, times[index]),
                ha="center",
                va="bottom",
                xytext=(0, 4),
                textcoords="offset points",
            )
    metrics = [c.get("metric") or 0.0 for c in candidates]
    metric_axis.bar(positions, metrics, color=colors)
    metric_axis.set_title(f"validation {candidates[0].get('metric_name', '')}")
    for axis in (time_axis, metric_axis):
        axis.set_xticks(list(positions))
        axis.set_xticklabels(names)
    figure.suptitle(f"plan: {plan.policy} ({plan.measured_on})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
