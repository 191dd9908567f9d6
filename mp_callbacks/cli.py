"""`mp-callbacks`: the command line (`bench` and `doctor`).

    mp-callbacks bench --quick
    mp-callbacks bench --model cnn --policies float32 mixed_bfloat16 --json out.json
    mp-callbacks doctor
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from typing import Any, Sequence

__all__ = ["main", "build_parser"]

_PROG = "mp-callbacks"


class _OneLineParser(argparse.ArgumentParser):
    """Bad input: one clear line on stderr and exit code 2, no usage dump."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=_PROG,
        description="Mixed precision for Keras, measured on your own hardware.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="{bench,doctor}", parser_class=_OneLineParser)
    commands.required = True

    bench = commands.add_parser(
        "bench",
        help="train one model under each dtype policy and compare time, memory and accuracy",
        description=(
            "Train the same model under each dtype policy, each in its own process, "
            "with MixedPrecisionModel and the three callbacks, and print the comparison "
            "table of the TensorFlow mixed-precision guide (time, memory, accuracy) for this machine."
        ),
    )
    bench.add_argument("--policies", nargs="+", metavar="POLICY",
                       help="policies to compare (space or comma separated); default: float32 "
                            "plus the mixed policies this hardware computes natively")
    bench.add_argument("--model", choices=("mlp", "cnn"), default=None,
                       help="mlp: the classic MNIST 784-512-256-10 MLP; cnn: a small conv net (default: mlp, cnn with --quick)")
    bench.add_argument("--dataset", default="synthetic",
                       help="'synthetic' (built-in, offline; default), 'mnist' (Keras's loader) "
                            "or a path to an .npz with x_train, y_train, x_test, y_test")
    bench.add_argument("--epochs", type=_positive_int, default=None, help="epochs per policy (default 5)")
    bench.add_argument("--batch-size", type=_positive_int, default=128)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--train-samples", type=_positive_int, default=None,
                       help="use only the first N training samples")
    bench.add_argument("--repeats", type=_positive_int, default=None,
                       help="run each policy N times, alternating, and keep its fastest run "
                            "(default 1, 2 with --quick)")
    bench.add_argument("--quick", action="store_true",
                       help="a preset that takes about a minute on 2 CPU cores: cnn, 8,000 images, "
                            "4 epochs, 2 alternating runs per policy")
    bench.add_argument("--force", action="store_true",
                       help="run mixed_float16 even where it is emulated (slow)")
    bench.add_argument("--quiet", action="store_true", help="print only the table")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    bench.add_argument("--plot", metavar="PATH", help="plot epoch time and memory per policy (PNG; needs matplotlib)")
    bench.set_defaults(handler=_bench)

    doctor = commands.add_parser(
        "doctor",
        help="check versions, GPUs and CPU features, and recommend a dtype policy",
        description="Which dtype policy can this machine speed up? Versions, CUDA/cuDNN, GPUs, CPU features.",
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.set_defaults(handler=_doctor)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mp_callbacks")
    except metadata.PackageNotFoundError:  # running from a checkout
        return "0+unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported
    from mp_callbacks import _native_stderr

    with _native_stderr.filtered():
        _show_progress(not getattr(args, "quiet", True))
        from mp_callbacks.bench import BenchError
        from mp_callbacks.data import DatasetError

        try:
            return args.handler(args)
        except (BenchError, DatasetError) as error:
            print(f"{_PROG} {args.command}: error: {error}", file=sys.stderr)
            return 2


def _show_progress(enabled: bool) -> None:
    """The benchmark reports progress through logging; show it on stderr."""
    import logging

    bench_logger = logging.getLogger("mp_callbacks.bench")
    bench_logger.setLevel(logging.INFO if enabled else logging.WARNING)
    if enabled and not bench_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        bench_logger.addHandler(handler)
        bench_logger.propagate = False


# ----------------------------------------------------------------- bench
def _parse_policies(values: list[str] | None) -> list[str] | None:
    from mp_callbacks.bench import BenchError
    from mp_callbacks.hardware import POLICIES

    if values is None:
        return None
    policies = [p for value in values for p in value.split(",") if p]
    for policy in policies:
        if policy not in POLICIES:
            raise BenchError(
                f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}"
            )
    return list(dict.fromkeys(policies))


def _settings(args: argparse.Namespace, policies: list[str]):
    from mp_callbacks.bench import QUICK, BenchSettings

    preset = QUICK if args.quick else {}
    return BenchSettings(
        policies=policies,
        model=args.model or preset.get("model", "mlp"),
        dataset=args.dataset,
        epochs=args.epochs or preset.get("epochs", 5),
        batch_size=args.batch_size,
        seed=args.seed,
        train_samples=args.train_samples or preset.get("train_samples"),
        test_samples=preset.get("test_samples"),
        repeats=args.repeats or preset.get("repeats", 1),
        quiet=args.quiet,
    )


def _validate_data(settings) -> str:
    """Loads the data once in this process to fail early with one line."""
    from mp_callbacks.bench import BenchError
    from mp_callbacks.data import SYNTHETIC, load_dataset

    if settings.dataset == SYNTHETIC:
        return "built-in synthetic digits (generated offline)"
    data = load_dataset(settings.dataset, allow_download=True)
    if settings.model == "cnn" and len(data.input_shape) not in (2, 3):
        raise BenchError(
            f"--model cnn needs image samples (H, W) or (H, W, C); {settings.dataset} has "
            f"samples of shape {data.input_shape}: use --model mlp"
        )
    return data.description


_OUTPUT_SUFFIXES = {
    "json": (".json",),
    "markdown": (".md", ".markdown"),
    "plot": (".png", ".svg", ".pdf"),
}


def check_output_path(flag: str, path: str) -> None:
    """Refuses, before any training, an output path that cannot be written:
    a wrong extension, a folder that does not exist (none is created), a
    folder or file that is not writable, or a folder given as the file."""
    from mp_callbacks.bench import BenchError

    suffixes = _OUTPUT_SUFFIXES[flag]
    if not path.lower().endswith(suffixes):
        raise BenchError(f"--{flag} {path}: the file name must end with {' or '.join(suffixes)}")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise BenchError(f"--{flag} {path}: the folder {directory} does not exist")
    if os.path.isdir(path):
        raise BenchError(f"--{flag} {path}: is a folder, not a file")
    target = path if os.path.exists(path) else directory
    if not os.access(target, os.W_OK):
        raise BenchError(f"--{flag} {path}: {target} is not writable")


def _bench(args: argparse.Namespace) -> int:
    from mp_callbacks.bench import compare
    from mp_callbacks.hardware import CPU_FLOAT16_SLOWDOWN, inspect_hardware

    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag):
            check_output_path(flag, getattr(args, flag))
    if args.plot:
        _require_matplotlib()
    report = inspect_hardware()
    policies = _parse_policies(args.policies) or ["float32", *report.fast_policies]
    skipped = []
    if "mixed_float16" in policies and not report.native_float16 and not report.gpus and not args.force:
        reason = (
            f"this CPU has no native float16 (measured about {CPU_FLOAT16_SLOWDOWN}x slower "
            "than float32); pass --force to run it anyway"
        )
        skipped.append({"policy": "mixed_float16", "reason": reason})
        policies = [p for p in policies if p != "mixed_float16"]
        print(f"skipping mixed_float16: {reason}", file=sys.stderr)
    if not policies:
        from mp_callbacks.bench import BenchError

        raise BenchError("no policy left to run")
    settings = _settings(args, policies)
    data_description = _validate_data(settings)
    if not args.quiet:
        print(
            f"{_PROG} bench: model {settings.model}, {_plural(settings.epochs, 'epoch')}, batch "
            f"{settings.batch_size}, policies {', '.join(policies)}; device: "
            f"{report.device_summary()}",
            file=sys.stderr,
        )
    results = compare(settings)
    data_description = results[0].get("data", data_description)

    header = (
        f"{settings.model} on {data_description}; {_plural(settings.epochs, 'epoch')}, batch "
        f"{settings.batch_size}, best of {settings.repeats} run(s) per policy; "
        f"device: {report.device_summary()}"
    )
    print(header)
    print(format_table(results))
    if skipped:
        for item in skipped:
            print(f"(mixed_float16 not run: {item['reason']})")
    # Everything is computed: a failed write must not lose the other outputs.
    failures: list[str] = []
    if args.json:
        document = {
            "results": results,
            "skipped_policies": skipped,
            "device": report.device_summary(),
            "hardware": report.as_dict(),
            "versions": _versions(),
            "model": settings.model,
            "data": data_description,
            "settings": dataclasses.asdict(settings),
        }
        _write(args.json, json.dumps(document, indent=2), failures)
    if args.markdown:
        _write(args.markdown, header + "\n\n" + format_table(results, markdown=True) + "\n", failures)
    if args.plot:
        try:
            plot_results(results, args.plot, title=f"{settings.model}: {report.device_summary()}")
        except (OSError, ValueError) as error:
            failures.append(f"cannot write {args.plot}: {error}")
    for failure in failures:
        print(f"{_PROG} bench: error: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


_COLUMNS = (
    ("policy", "policy", "{}"),
    ("epoch_time", "epoch time (s)", "{:.2f}"),
    ("samples_per_sec", "samples/s", "{:,.0f}"),
    ("speedup", "speed-up", "{:.2f}x"),
    ("peak_memory_mb", "peak memory (MB)", "{:,.0f}"),
    ("accuracy", "val accuracy", "{:.1%}"),
    ("skipped_steps", "skipped steps", "{:d}"),
)


def format_table(results: list[dict[str, Any]], markdown: bool = False) -> str:
    """The comparison table, aligned for a terminal or as Markdown."""
    headers = [title for _, title, _ in _COLUMNS]
    rows = [
        ["-" if r.get(key) is None else fmt.format(r[key]) for key, _, fmt in _COLUMNS]
        for r in results
    ]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    def line(cells):
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        )
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _require_matplotlib() -> None:
    from mp_callbacks.bench import BenchError

    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise BenchError(
            "--plot needs matplotlib: pip install \"mp_callbacks[plot]\""
        ) from error


def plot_results(results: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Epoch time and peak memory per policy, side by side (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [r["policy"] for r in results]
    figure, (time_axis, memory_axis) = plt.subplots(1, 2, figsize=(10, 4))
    time_axis.bar(policies, [r["epoch_time"] or 0 for r in results], color="tab:blue")
    time_axis.set_ylabel("median warm epoch time (s)")
    time_axis.set_title("epoch time (lower is better)")
    for index, result in enumerate(results):
        if result.get("speedup"):
            time_axis.annotate(f"{result['speedup']:.2f}x", (index, result["epoch_time"]),
                               ha="center", va="bottom")
    memory_axis.bar(policies, [r["peak_memory_mb"] for r in results], color="tab:orange")
    memory_axis.set_ylabel("peak memory (MB)")
    memory_axis.set_title("peak memory")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _versions() -> dict[str, str]:
    import keras
    import tensorflow as tf

    import mp_callbacks

    return {
        "mp_callbacks": mp_callbacks.__version__,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
    }


def _write(path: str, text: str, failures: list[str]) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as error:
        failures.append(f"cannot write {path}: {error.strerror}")


# ---------------------------------------------------------------- doctor
def _doctor(args: argparse.Namespace) -> int:
    from mp_callbacks.hardware import inspect_hardware

    report = inspect_hardware()
    if args.json:
        print(json.dumps({**report.as_dict(), "versions": _versions()}, indent=2))
        return 0
    yes = {True: "yes", False: "no"}
    print(f"TensorFlow {report.tensorflow_version}, Keras {report.keras_version}")
    print(
        f"CUDA build: {yes[report.cuda_build]}"
        + (f" (CUDA {report.cuda_version}, cuDNN {report.cudnn_version})" if report.cuda_build else "")
    )
    if report.gpus:
        for gpu in report.gpus:
            info = gpu.as_dict()
            print(
                f"GPU: {info['name']}, compute capability {info['compute_capability']}: "
                f"float16 Tensor Cores {yes[gpu.float16_tensor_cores]}, "
                f"fast bfloat16 {yes[gpu.fast_bfloat16]}"
            )
    else:
        print("GPU: none")
    flags = ", ".join(f"{name.upper().replace('_', '-')} {yes[present]}"
                      for name, present in report.cpu_flags.items())
    print(f"CPU: {report.cpu_model}; {flags}")
    print(f"Policies this hardware computes natively: {', '.join(report.fast_policies) or 'none'}")
    print(f"Recommended policy: {report.recommended_policy}")
    print(f"  why: {report.reason}")
    for warning in report.warnings:
        print(f"warning: {warning}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
