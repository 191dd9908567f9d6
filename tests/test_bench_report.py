"""The benchmark's report: table, verdict, JSON and plot, from rows alone
(no training), and the choice of policies from an injected measurement."""

from __future__ import annotations

import json

import pytest

from mp_callbacks._cpu_features import CpuInfo
from mp_callbacks.hardware import MIN_SPEEDUP as HARDWARE_MIN_SPEEDUP
from mp_callbacks.hardware import PATHOLOGICAL_SPEED, inspect_hardware
from mp_callbacks.hardware import POLICIES as HARDWARE_POLICIES
from mp_callbacks_bench.api import choose_policies
from mp_callbacks_bench.report import (
    MIN_SPEEDUP,
    format_skipped,
    format_table,
    json_document,
    plot_results,
    verdict,
)
from mp_callbacks_bench.settings import POLICIES


def _row(policy, epoch_time, accuracy=0.95, speedup=None, **extra):
    row = {
        "policy": policy,
        "epoch_time": epoch_time,
        "samples_per_sec": 8000 / epoch_time,
        "speedup": speedup,
        "peak_memory_mb": 760.0,
        "accuracy": accuracy,
        "skipped_steps": 0,
        "epoch_time_min": epoch_time,
        "epoch_time_max": epoch_time * 1.25,
        "estimated_step_memory": {"total": 12.5},
        "diverged": False,
    }
    row.update(extra)
    return row


FLOAT32 = _row("float32", 1.31, 0.969, 1.0)
BF16_FAST = _row("mixed_bfloat16", 1.02, 0.972, 1.31 / 1.02)


def test_the_app_and_the_library_agree_on_policies_and_threshold():
    assert POLICIES == HARDWARE_POLICIES
    assert MIN_SPEEDUP == HARDWARE_MIN_SPEEDUP


def test_table_shows_each_value_with_its_unit():
    lines = format_table([FLOAT32, BF16_FAST]).splitlines()
    assert lines[0].split("  ")[0] == "policy"
    assert [cell.strip() for cell in lines[2].split("  ") if cell.strip()] == [
        "float32",
        "1.31",
        "1.31-1.64",
        "6,107",
        "1.00x",
        "12.5",
        "760",
        "96.9%",
        "0",
    ]
    assert [cell.strip() for cell in lines[3].split("  ") if cell.strip()][:5] == [
        "mixed_bfloat16",
        "1.02",
        "1.02-1.27",
        "7,843",
        "1.28x",
    ]
    assert len({len(line) for line in lines}) == 1  # aligned


def test_markdown_table_and_missing_values():
    row = _row("mixed_float16", 2.0, None, None, estimated_step_memory=None, epoch_time_min=None)
    text = format_table([FLOAT32, row], markdown=True).splitlines()
    assert text[0].startswith("| policy | epoch time (s) | range over runs (s) |")
    assert text[1] == "|---|" + "---:|" * 8
    assert text[3] == "| mixed_float16 | 2.00 | - | 4,000 | - | - | 760 | - | 0 |"


def test_verdict_picks_the_fastest_policy_that_keeps_accuracy():
    fp16 = _row("mixed_float16", 0.9, 0.90, 1.31 / 0.9)  # fastest, but 6.9 points worse
    policy, text = verdict([FLOAT32, fp16, BF16_FAST])
    assert policy == "mixed_bfloat16"
    assert text == (
        "use mixed_bfloat16 here: 1.28x float32's speed (1.02 s vs 1.31 s per epoch; "
        "validation accuracy 97.2% vs 96.9%). Not mixed_float16 was 1.46x as fast but "
        "lost 6.9% of validation accuracy."
    )


def test_verdict_stays_with_float32_when_nothing_is_faster():
    slow = _row("mixed_bfloat16", 3.7, 0.97, 1.31 / 3.7)
    diverged = _row("mixed_float16", 0.5, 0.1, 2.6, diverged=True)
    policy, text = verdict([FLOAT32, slow, diverged])
    assert policy == "float32"
    assert text == (
        "use float32 here: mixed_bfloat16 ran at 0.35x float32's speed (slower); mixed_float16 diverged."
    )
    assert verdict([FLOAT32]) == ("float32", "use float32 here: no mixed policy was run.")


def test_verdict_needs_a_float32_baseline():
    assert verdict([BF16_FAST])[0] is None


def test_verdict_calls_runs_that_do_not_separate_a_tie():
    # Two quick runs minutes apart: 0.94x and 1.47x. Neither verdict holds.
    noisy = _row("mixed_bfloat16", 1.0, 0.97, 1.2, epoch_times_of_runs=[1.39, 0.89])
    baseline = _row("float32", 1.31, 0.969, 1.0, epoch_times_of_runs=[1.31, 1.31])
    policy, text = verdict([baseline, noisy])
    assert policy == "float32"
    assert "0.94x to 1.47x float32's speed over 2 alternating runs: a tie" in text
    steady = _row("mixed_bfloat16", 1.0, 0.97, 1.31, epoch_times_of_runs=[1.0, 1.01])
    assert verdict([baseline, steady])[0] == "mixed_bfloat16"


def test_verdict_threshold():
    just_below = _row("mixed_bfloat16", 1.0, 0.97, MIN_SPEEDUP - 0.001)
    assert verdict([FLOAT32, just_below])[0] == "float32"
    at = _row("mixed_bfloat16", 1.0, 0.97, MIN_SPEEDUP)
    assert verdict([FLOAT32, at])[0] == "mixed_bfloat16"


def test_json_document_carries_rows_skips_and_verdict():
    skipped = [{"policy": "mixed_float16", "reason": "measured 0.004x"}]
    document = json.loads(json_document([FLOAT32, BF16_FAST], skipped, device="CPU x"))
    assert document["recommended_policy"] == "mixed_bfloat16"
    assert document["verdict"].startswith("use mixed_bfloat16 here")
    assert document["skipped_policies"] == skipped
    assert document["results"][1]["epoch_time_max"] == pytest.approx(1.275)
    assert document["device"] == "CPU x"
    assert format_skipped(skipped) == ["not run: mixed_float16: measured 0.004x"]


def test_plot_has_time_memory_and_accuracy_with_error_bars(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = tmp_path / "plot.png"
    captured = {}
    original = plt.close

    def keep(figure):
        captured["figure"] = figure
        original(figure)

    plt.close = keep
    try:
        plot_results([FLOAT32, BF16_FAST], str(path), title="t")
    finally:
        plt.close = original
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = captured["figure"].axes
    assert [axis.get_title() for axis in axes] == [
        "epoch time (lower is better)",
        "memory",
        "validation accuracy (higher is better)",
    ]
    # The range over runs is drawn: one error bar per policy on the time axis.
    error_bars = [c for c in axes[0].containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(error_bars) == 1
    segments = error_bars[0].lines[2][0].get_segments()
    assert [tuple(s[:, 1].round(3)) for s in segments] == [(1.31, 1.638), (1.02, 1.275)]
    heights = [bar.get_height() for bar in axes[2].patches]
    assert heights == pytest.approx([96.9, 97.2])


# ------------------------------------------------------ choosing policies
_PLAIN_CPU = CpuInfo("x", "x86_64", frozenset(), "/proc/cpuinfo")


def _hardware(speed=None, cpu=_PLAIN_CPU):
    return inspect_hardware(measure=False, cpu=cpu, gpus=[], speed=speed)


def test_all_policies_run_unless_one_is_measured_as_emulated():
    hardware = _hardware({"float32": 1.0, "mixed_float16": 0.56, "mixed_bfloat16": 0.35})
    assert choose_policies(None, hardware) == (list(POLICIES), [])
    emulated = _hardware({"float32": 1.0, "mixed_float16": PATHOLOGICAL_SPEED / 50, "mixed_bfloat16": 2.5})
    to_run, skipped = choose_policies(None, emulated)
    assert to_run == ["float32", "mixed_bfloat16"]
    assert skipped == [
        {
            "policy": "mixed_float16",
            "reason": "measured 0.005x of float32's speed in the probe on given; --force runs it anyway",
        }
    ]
    assert choose_policies(None, emulated, force=True) == (list(POLICIES), [])
    assert choose_policies(["mixed_float16"], emulated)[0] == []
    # bfloat16 is always compared, however slow the probe finds it.
    slow_bfloat16 = _hardware({"float32": 1.0, "mixed_float16": 0.5, "mixed_bfloat16": 0.01})
    assert choose_policies(None, slow_bfloat16) == (list(POLICIES), [])


def test_without_a_probe_float16_on_a_cpu_without_it_is_not_run():
    to_run, skipped = choose_policies(None, _hardware())
    assert to_run == ["float32", "mixed_bfloat16"]
    assert skipped[0]["policy"] == "mixed_float16" and "--no-probe" in skipped[0]["reason"]
    with_fp16 = _hardware(cpu=CpuInfo("x", "aarch64", frozenset({"asimdhp"}), "/proc/cpuinfo"))
    assert choose_policies(None, with_fp16) == (list(POLICIES), [])


# ------------------------------------------------------------- stopping early
def _timed_first_epoch(seconds_per_step, steps=20, trace=3.0, baseline=1.0):
    """EarlyVerdict over one first epoch whose steps take `seconds_per_step`
    after a first step of `trace` seconds (injected clock, no training)."""
    import keras

    from mp_callbacks_bench.runner import EarlyVerdict

    clock = iter([trace + i * seconds_per_step for i in range(steps)])
    early = EarlyVerdict(baseline_epoch_time=baseline, clock=lambda: next(clock))
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    early.set_model(model)
    early.on_epoch_begin(0)
    for step in range(steps):
        early.on_train_batch_end(step)
    early.on_epoch_end(0)
    return early, model


def test_a_policy_that_cannot_tie_float32_stops_after_its_first_epoch():
    # Warm steps at 0.16x float32's speed (bfloat16 on an AMD EPYC without
    # AVX-512): 20 steps of 0.3125 s = 6.25 s an epoch against float32's 1 s.
    early, model = _timed_first_epoch(0.3125)
    assert model.stop_training is True
    assert early.estimate == pytest.approx(6.25)
    assert "0.16x float32's speed" in early.reason and "would not tie" in early.reason


@pytest.mark.parametrize("seconds_per_step", [0.05, 0.07])
def test_a_policy_within_the_margin_or_faster_trains_on(seconds_per_step):
    # 1.4 s an epoch: 1.5x faster it would beat float32's 1 s, so it runs on;
    # the slow traced first step is not counted against it.
    early, model = _timed_first_epoch(seconds_per_step, trace=30.0)
    assert not getattr(model, "stop_training", False) and early.reason is None


def test_quick_compare_runs_a_hopeless_policy_once_and_says_why():
    from mp_callbacks_bench.runner import compare
    from mp_callbacks_bench.settings import QUICK, BenchSettings

    asked = []

    def runner(policy, settings):
        asked.append((policy, settings.baseline_epoch_time))
        if policy == "float32":
            return _row("float32", 1.0, 0.97)
        reason = "stopped after its first epoch: its warm steps ran at 0.16x float32's speed"
        return _row(policy, 6.25, 0.90, stopped_early=reason)

    settings = BenchSettings(
        policies=["float32", "mixed_bfloat16"],
        repeats=QUICK["repeats"],
        max_repeats=QUICK["max_repeats"],
        stop_early=QUICK["stop_early"],
        quiet=True,
    )
    results = compare(settings, runner=runner)
    # float32 twice (its runs are the baseline); bfloat16 once, told float32's time.
    assert asked == [("float32", None), ("mixed_bfloat16", 1.0), ("float32", None)]
    policy, why = verdict(results)
    assert policy == "float32" and "mixed_bfloat16 stopped after its first epoch" in why
