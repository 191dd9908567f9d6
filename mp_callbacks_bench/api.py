"""`run_bench`: the benchmark as a function, for notebooks and scripts.

It does what `mp-callbacks bench` does and returns the same rows:

    from mp_callbacks_bench import run_bench

    report = run_bench("my_models:build", epochs=2, policies=["float32", "mixed_bfloat16"])
    print(report.table())
    print(report.verdict)
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mp_callbacks_bench.settings import POLICIES, QUICK, BenchError, BenchSettings, Preset

__all__ = ["BenchReport", "choose_policies", "run_bench"]

logger = logging.getLogger("mp_callbacks_bench")


@dataclass
class BenchReport:
    """What a benchmark found: one row per policy that ran (see
    `report.format_table` for the columns), the policies not run and why,
    and the verdict."""

    results: list[dict[str, Any]]
    skipped: list[dict[str, str]]
    recommended_policy: str | None
    verdict: str
    settings: BenchSettings
    data: str
    device: str
    hardware: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def header(self) -> str:
        s = self.settings
        epochs = f"{s.epochs} epoch" + ("" if s.epochs == 1 else "s")
        return (
            f"{s.model} on {self.data}; {epochs}, batch {s.batch_size}, best of "
            f"{s.repeats} run{'' if s.repeats == 1 else 's'} per policy; device: {self.device}"
        )

    def table(self, markdown: bool = False) -> str:
        from mp_callbacks_bench.report import format_table

        return format_table(self.results, markdown=markdown)

    def to_json(self) -> str:
        from mp_callbacks_bench.report import json_document

        return json_document(
            self.results,
            self.skipped,
            device=self.device,
            hardware=self.hardware,
            versions=self.versions,
            model=self.settings.model,
            data=self.data,
            settings=dataclasses.asdict(self.settings),
        )


def choose_policies(
    requested: Sequence[str] | None, hardware, force: bool = False
) -> tuple[list[str], list[dict[str, str]]]:
    """The policies to run, and those not run with the reason.

    All policies by default: float32 and `mixed_bfloat16` always run (the
    point is to compare, and bfloat16 is at worst a few times slower), and
    `mixed_float16` unless the probe measured it as pathologically slow
    (emulated; see `mp_callbacks.hardware.PATHOLOGICAL_SPEED`: on some CPUs
    it is hundreds of times slower), or, without a measurement, on a CPU
    without native float16. `force` runs it anyway.
    """
    policies = list(dict.fromkeys(requested or POLICIES))
    slow = {p: why for p, why in hardware.slow_policies().items() if p == "mixed_float16"}
    if hardware.measured is None and not hardware.gpus and not hardware.cpu.native_float16:
        slow.setdefault(
            "mixed_float16",
            "not measured (--no-probe), and this CPU has no native float16: it would be emulated",
        )
    skipped = []
    if not force:
        skipped = [
            {"policy": p, "reason": slow[p] + "; --force runs it anyway"} for p in policies if p in slow
        ]
        policies = [p for p in policies if p not in slow]
    return policies, skipped


def _check_count(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a positive integer" if low == 1 else "a non-negative integer"
        raise BenchError(f"run_bench: `{name}` must be {kind}; received {name}={value!r}")


def _as_model_spec(model: str | Callable[[], Any]) -> str:
    if isinstance(model, str):
        return model
    module = getattr(model, "__module__", None)
    qualname = getattr(model, "__qualname__", "")
    if not callable(model) or not module or module == "__main__" or "." in qualname:
        raise BenchError(
            f"model={model!r}: each policy trains in a fresh process, which can only import "
            "a function defined at the top of a module or file: pass 'module:function' or "
            "'path/to/file.py:function'"
        )
    return f"{module}:{qualname}"


def _check_inputs(settings: BenchSettings) -> str:
    """Loads the data and builds the model once, here, so that a bad
    dataset or model spec fails in one line before any training. Returns
    the data's description."""
    from mp_callbacks_bench.data import load_dataset
    from mp_callbacks_bench.user_model import build_model, check_model_fits_data, parse_model_spec

    spec = parse_model_spec(settings.model)
    data = load_dataset(settings.dataset, seed=settings.seed, allow_download=True)
    data = data.take(settings.train_samples, settings.test_samples)
    if spec.kind == "built-in" and isinstance(data.input_shape, dict):
        raise BenchError(
            f"--model {spec.text}: a built-in model takes one input array, and {settings.dataset} has "
            f"named inputs {sorted(data.input_shape)}: give --model path/to/file.py:FUNCTION"
        )
    if spec.text == "cnn" and len(data.input_shape) not in (2, 3):
        raise BenchError(
            f"--model cnn needs image samples (H, W) or (H, W, C); {settings.dataset} has "
            f"samples of shape {data.input_shape}: use --model mlp"
        )
    if spec.kind != "built-in":
        import keras

        import mp_callbacks  # noqa: F401  (checks Keras's backend before Keras loads)

        previous = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy("float32")
        try:
            model = build_model(spec, data.input_shape, data.num_classes)
            check_model_fits_data(model, spec, data.x_train, data.num_classes)
        finally:
            # (No clear_session: in a notebook it would reset the user's state.)
            keras.mixed_precision.set_global_policy(previous)
    return data.description


def _versions() -> dict[str, str]:
    """The versions a result depends on: the library, Keras, the backend
    Keras runs (under its own name: "tensorflow", "jax", "torch") and Python."""
    import importlib

    import keras

    import mp_callbacks

    backend = keras.backend.backend()
    return {
        "mp_callbacks": mp_callbacks.__version__,
        backend: importlib.import_module(backend).__version__,
        "keras": keras.__version__,
        "backend": backend,
        "python": platform.python_version(),
    }


def run_bench(
    model: str | Callable[[], Any] | None = None,
    *,
    policies: Sequence[str] | None = None,
    dataset: str = "synthetic",
    epochs: int | None = None,
    batch_size: int = 128,
    seed: int = 0,
    train_samples: int | None = None,
    test_samples: int | None = None,
    repeats: int | None = None,
    quick: bool = False,
    stop_early: bool | None = None,
    force: bool = False,
    probe: bool = True,
    quiet: bool = True,
    in_subprocess: bool = True,
) -> BenchReport:
    """Trains `model` under each policy and compares them.

    Args:
        model: "mlp", "cnn", "module:function", "path/to/file.py:function",
            or a function defined at the top of an importable module;
            `function()` returns a Keras model, compiled or not. Default:
            "mlp" ("cnn" with `quick`).
        policies: the policies to compare (default: all three, less any the
            probe measured as emulated; see `choose_policies`).
        dataset: "synthetic" (built-in), "mnist", or a path to an `.npz`
            with `x_train`, `y_train`, `x_test`, `y_test`.
        epochs, batch_size, seed, train_samples, test_samples: the training.
        repeats: runs per policy, alternating; each policy's best counts.
        quick: the `--quick` preset (cnn, 8,000 samples, 4 epochs, 2 runs,
            `stop_early`) for whatever is not given.
        stop_early: stop a mixed policy after its first epoch when, even
            1.5x faster than its warm steps ran, it would be slower than
            float32 (default: with `quick` only); its row says so.
        force: run policies the probe found pathologically slow.
        probe: measure each policy's speed first (seconds); False judges
            from the hardware's features alone.
        quiet: no progress output.
        in_subprocess: train each policy in a fresh process (as the CLI
            does; then each peak memory is its own).

    Raises:
        BenchError, DatasetError: bad input, or a run that failed.
    """
    from mp_callbacks import inspect_hardware
    from mp_callbacks_bench.report import verdict
    from mp_callbacks_bench.runner import compare
    from mp_callbacks_bench.user_model import parse_model_spec

    for name, value in (
        ("epochs", epochs),
        ("batch_size", batch_size),
        ("repeats", repeats),
        ("train_samples", train_samples),
        ("test_samples", test_samples),
    ):
        if value is not None:
            _check_count(name, value, low=1)
    _check_count("seed", seed, low=0)
    preset: Preset = QUICK if quick else {}
    spec_text = _as_model_spec(model if model is not None else preset.get("model", "mlp"))
    parse_model_spec(spec_text)
    for policy in policies or ():
        if policy not in POLICIES:
            raise BenchError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    hardware = inspect_hardware(measure=probe)
    to_run, skipped = choose_policies(policies, hardware, force=force)
    if not to_run:
        raise BenchError(
            "no policy left to run: " + "; ".join(f"{s['policy']}: {s['reason']}" for s in skipped)
        )
    settings = BenchSettings(
        policies=to_run,
        model=spec_text,
        dataset=dataset,
        epochs=epochs or preset.get("epochs", 5),
        batch_size=batch_size,
        seed=seed,
        train_samples=train_samples or preset.get("train_samples"),
        test_samples=test_samples or preset.get("test_samples"),
        repeats=repeats or preset.get("repeats", 1),
        max_repeats=None if repeats else preset.get("max_repeats"),
        quiet=quiet,
        stop_early=preset.get("stop_early", False) if stop_early is None else stop_early,
    )
    data_description = _check_inputs(settings)
    # Notes come after the inputs are checked: a bad input stays one line.
    measured = hardware.measured or {}
    for policy in to_run:
        if policy != "float32" and measured.get(policy, 1.0) < 1.0:
            logger.warning(
                "note: %s measured %.2fx of float32's speed in the probe; %s",
                policy,
                measured[policy],
                "running it as asked" if policies else "it runs for the comparison",
            )
    logger.info(
        "mp-callbacks bench: model %s, %s, batch %d, policies %s; device: %s",
        settings.model,
        f"{settings.epochs} epoch" + ("" if settings.epochs == 1 else "s"),
        settings.batch_size,
        ", ".join(to_run),
        hardware.device_summary(),
    )
    failed: list[dict[str, str]] = []
    results = compare(settings, in_subprocess=in_subprocess, failed=failed)
    skipped = skipped + failed  # shown as "not run: <policy>: <why>"
    # Runs were added where the first ones did not separate.
    settings.repeats = max(len(r.get("epoch_times_of_runs") or [None]) for r in results)
    recommended, why = verdict(results)
    return BenchReport(
        results=results,
        skipped=skipped,
        recommended_policy=recommended,
        verdict=why,
        settings=settings,
        data=results[0].get("data", data_description),
        device=hardware.device_summary(),
        hardware=hardware.as_dict(),
        versions=_versions(),
    )
