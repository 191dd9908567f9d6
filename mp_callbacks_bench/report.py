"""Turning result rows into what the user reads: the table (terminal or
Markdown), the verdict, the JSON document and the plot.

Pure functions of the rows: no training, no TensorFlow. A row is a dict as
`runner.run_policy` returns it (plus what `runner.compare` adds).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MAX_ACCURACY_DROP",
    "MIN_SPEEDUP",
    "format_skipped",
    "format_table",
    "json_document",
    "plot_results",
    "verdict",
]

# The same threshold as the hardware advisor's (mp_callbacks.hardware).
MIN_SPEEDUP = 1.1
# A mixed policy that loses more accuracy than this is not recommended.
MAX_ACCURACY_DROP = 0.01


def _spread(row: dict[str, Any]) -> str | None:
    low, high = row.get("epoch_time_min"), row.get("epoch_time_max")
    if low is None or high is None:
        return None
    return f"{low:.2f}-{high:.2f}"


def _estimate(row: dict[str, Any]) -> float | None:
    estimate = row.get("estimated_step_memory") or {}
    return estimate.get("total")


_COLUMNS = (
    # (title, value of a row, format)
    ("policy", lambda r: r.get("policy"), "{}"),
    ("epoch time (s)", lambda r: r.get("epoch_time"), "{:.2f}"),
    ("range over runs (s)", _spread, "{}"),
    ("samples/s", lambda r: r.get("samples_per_sec"), "{:,.0f}"),
    ("speed-up", lambda r: r.get("speedup"), "{:.2f}x"),
    ("step memory, est. (MB)", _estimate, "{:,.1f}"),
    ("peak memory (MB)", lambda r: r.get("peak_memory_mb"), "{:,.0f}"),
    ("val accuracy", lambda r: r.get("accuracy"), "{:.1%}"),
    ("skipped steps", lambda r: r.get("skipped_steps"), "{:d}"),
)


def format_table(results: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """The comparison table, aligned for a terminal or as Markdown.

    "epoch time" is each policy's best run (median warm epoch); "range over
    runs" the fastest and slowest of its runs; "step memory, est." the
    weights, gradients, optimizer slots and one batch's activations from
    the model's shapes and dtypes; "peak memory" what the device (GPU) or
    the process (CPU) used at most.
    """
    headers = [title for title, _, _ in _COLUMNS]
    rows = []
    for result in results:
        cells = []
        for _, value_of, fmt in _COLUMNS:
            value = value_of(result)
            cells.append("-" if value is None else fmt.format(value))
        rows.append(cells)
    if markdown:
        lines = [
            "| " + " | ".join(headers) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def format_skipped(skipped: Sequence[dict[str, str]]) -> list[str]:
    """One line per policy that was not run, with its reason."""
    return [f"not run: {item['policy']}: {item['reason']}" for item in skipped]


def _paired(baseline: dict[str, Any], result: dict[str, Any]) -> Any:
    """The run-by-run comparison (`mp.SpeedComparison`), when both policies
    ran more than once: alternating runs pair up by their index."""
    ours, theirs = result.get("epoch_times_of_runs") or [], baseline.get("epoch_times_of_runs") or []
    if min(len(ours), len(theirs)) < 2:
        return None
    from mp_callbacks import SpeedComparison  # (imports TensorFlow: only here)

    return SpeedComparison([b / a for a, b in zip(ours, theirs) if a and b], min_speedup=MIN_SPEEDUP)


def verdict(results: Sequence[dict[str, Any]]) -> tuple[str | None, str]:
    """The policy to use on this machine for this model, and why.

    A mixed policy is chosen when it did not diverge, ran at least
    `MIN_SPEEDUP` times float32's speed, and lost at most
    `MAX_ACCURACY_DROP` of accuracy; the fastest such policy wins. With
    several alternating runs per policy, speed is judged run by run, by
    `mp.SpeedComparison`'s rule: a policy whose runs are not all clearly
    faster is a tie, and a tie is float32. Without a float32 row there is
    nothing to compare with: (None, reason).
    """
    by_policy = {r["policy"]: r for r in results}
    baseline = by_policy.get("float32")
    if baseline is None or not baseline.get("epoch_time"):
        return None, "no verdict: float32 was not run, so there is no baseline to compare with."
    good, objections = [], []
    for result in results:
        policy = result["policy"]
        if policy == "float32":
            continue
        speedup = result.get("speedup") or 0.0
        drop = _accuracy_drop(baseline, result)
        paired = _paired(baseline, result)
        if result.get("diverged"):
            objections.append(f"{policy} diverged")
        elif paired is not None and paired.verdict != "faster":
            low, high = paired.quartiles
            objections.append(
                f"{policy} ran at {low:.2f}x to {high:.2f}x float32's speed over {paired.rounds} "
                f"alternating runs: {'slower' if paired.verdict == 'slower' else 'a tie'}"
            )
        elif result.get("stopped_early"):
            objections.append(f"{policy} {result['stopped_early']}")
        elif speedup < MIN_SPEEDUP:
            slower = " (slower)" if speedup < 1.0 else ""
            objections.append(f"{policy} ran at {speedup:.2f}x float32's speed{slower}")
        elif drop is not None and drop > MAX_ACCURACY_DROP:
            objections.append(
                f"{policy} was {speedup:.2f}x as fast but lost {drop:.1%} of validation accuracy"
            )
        else:
            good.append(result)
    if not good:
        why = "; ".join(objections) if objections else "no mixed policy was run"
        return "float32", f"use float32 here: {why}."
    best = max(good, key=lambda r: r["speedup"])
    text = (
        f"use {best['policy']} here: {best['speedup']:.2f}x float32's speed "
        f"({best['epoch_time']:.2f} s vs {baseline['epoch_time']:.2f} s per epoch"
    )
    if best.get("accuracy") is not None and baseline.get("accuracy") is not None:
        text += f"; validation accuracy {best['accuracy']:.1%} vs {baseline['accuracy']:.1%}"
    text += ")."
    if objections:
        text += " Not " + "; not ".join(objections) + "."
    return best["policy"], text


def _accuracy_drop(baseline: dict[str, Any], result: dict[str, Any]) -> float | None:
    if baseline.get("accuracy") is None or result.get("accuracy") is None:
        return None
    return baseline["accuracy"] - result["accuracy"]


def json_document(
    results: Sequence[dict[str, Any]],
    skipped: Sequence[dict[str, str]],
    **context: Any,
) -> str:
    """The `--json` document: the rows, what was not run and why, the
    verdict, and whatever context is given (settings, device, versions)."""
    recommended, why = verdict(results)
    document = {
        "results": list(results),
        "skipped_policies": list(skipped),
        "recommended_policy": recommended,
        "verdict": why,
        **context,
    }
    return json.dumps(document, indent=2)


def _or(value: float | None, default: float) -> float:
    """`value`, or `default` where a run did not report it (0.0 is a value)."""
    return default if value is None else value


def plot_results(results: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Three panels per policy: epoch time (with the range over runs as
    error bars and the speed-up written on top), the estimated step memory
    next to the measured peak, and validation accuracy (with its range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [r["policy"] for r in results]
    positions = range(len(results))
    figure, (time_axis, memory_axis, accuracy_axis) = plt.subplots(1, 3, figsize=(14, 4))

    times = [r.get("epoch_time") or 0.0 for r in results]
    time_errors = [
        [t - _or(r.get("epoch_time_min"), t) for t, r in zip(times, results)],
        [_or(r.get("epoch_time_max"), t) - t for t, r in zip(times, results)],
    ]
    time_axis.bar(positions, times, yerr=time_errors, capsize=6, color="tab:blue")
    time_axis.set_ylabel("epoch time (s): best run; bars: range over runs")
    time_axis.set_title("epoch time (lower is better)")
    for index, result in enumerate(results):
        if result.get("speedup"):
            time_axis.annotate(
                f"{result['speedup']:.2f}x",
                (index, times[index]),
                ha="center",
                va="bottom",
                xytext=(0, 8),
                textcoords="offset points",
            )

    width = 0.4
    estimates = [_estimate(r) or 0.0 for r in results]
    peaks = [r.get("peak_memory_mb") or 0.0 for r in results]
    memory_axis.bar(
        [p - width / 2 for p in positions], estimates, width, label="step, estimated", color="tab:orange"
    )
    memory_axis.bar(
        [p + width / 2 for p in positions], peaks, width, label="peak, measured", color="tab:gray"
    )
    memory_axis.set_ylabel("MB")
    memory_axis.set_title("memory")
    memory_axis.legend()

    accuracies = [100 * (r.get("accuracy") or 0.0) for r in results]
    accuracy_errors = [
        [a - 100 * _or(r.get("accuracy_min"), a / 100) for a, r in zip(accuracies, results)],
        [100 * _or(r.get("accuracy_max"), a / 100) - a for a, r in zip(accuracies, results)],
    ]
    accuracy_axis.bar(positions, accuracies, yerr=accuracy_errors, capsize=6, color="tab:green")
    accuracy_axis.set_ylabel("validation accuracy (%)")
    accuracy_axis.set_title("validation accuracy (higher is better)")
    low = min(accuracies, default=0.0)
    accuracy_axis.set_ylim(max(0.0, low - 10), 100)

    for axis in (time_axis, memory_axis, accuracy_axis):
        axis.set_xticks(list(positions))
        axis.set_xticklabels(policies)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
