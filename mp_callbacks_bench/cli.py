"""`mp-callbacks`: the command line (`bench`, `tune` and `doctor`).

    mp-callbacks bench --quick
    mp-callbacks bench --model my_models.py:build --dataset data.npz --json out.json
    mp-callbacks tune --quick
    mp-callbacks doctor

Parsing and argument errors import neither TensorFlow nor Keras, so
`--help`, `--version` and mistakes answer at once. The work is done by
`api.run_bench` and `mp_callbacks.hardware`; the text by `report` and
`HardwareReport.format_text`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from mp_callbacks_bench.settings import POLICIES, BenchError

__all__ = ["build_parser", "check_output_path", "main"]

_PROG = "mp-callbacks"


class _OneLineParser(argparse.ArgumentParser):
    """Bad input: one line on stderr, `mp-callbacks <command>: error: ...`,
    and exit code 2, without the usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value


def _policy_list(text: str, allowed: tuple[str, ...] = POLICIES) -> list[str]:
    policies = [p for p in text.split(",") if p]
    for policy in policies:
        if policy not in allowed:
            raise argparse.ArgumentTypeError(f"unknown policy {policy!r}: choose from {', '.join(allowed)}")
    return policies


def _candidate_list(text: str) -> list[str]:
    """tune's candidates: the policies, and float8 (per layer, within a mixed policy)."""
    return _policy_list(text, (*POLICIES, "float8"))


def _model_spec(text: str) -> str:
    from mp_callbacks_bench.user_model import parse_model_spec

    try:
        parse_model_spec(text)
    except BenchError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r}: " + str(error).removeprefix(f"--model {text}: ")
        ) from error
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=_PROG,
        description="Mixed precision for Keras, measured on your own hardware.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {_version()}")
    commands = parser.add_subparsers(
        dest="command", metavar="{bench,tune,doctor}", parser_class=_OneLineParser
    )
    commands.required = True

    bench = commands.add_parser(
        "bench",
        help="train one model under each dtype policy and compare time, memory and accuracy",
        description=(
            "Train the same model under each dtype policy, each in its own process, with "
            "MixedPrecisionModel and the mp_callbacks callbacks, and print a comparison "
            "table (epoch time, speed-up, memory, validation accuracy) for this machine, "
            "with a verdict: the policy to use here."
        ),
    )
    bench.add_argument(
        "--model",
        type=_model_spec,
        default=None,
        metavar="MODEL",
        help="mlp (the classic MNIST 784-512-256-10 MLP), cnn (a small conv net), "
        "MODULE:FUNCTION or path/to/file.py:FUNCTION, where FUNCTION() returns a Keras "
        "model, compiled or not (default: mlp; cnn with --quick)",
    )
    bench.add_argument(
        "--policies",
        nargs="+",
        metavar="POLICY",
        type=_policy_list,
        help="policies to compare (space or comma separated; default: all three, less any "
        "the probe measures as emulated)",
    )
    bench.add_argument(
        "--dataset",
        default="synthetic",
        help="'synthetic' (built-in, offline; default), 'mnist' (Keras's loader) or a path "
        "to an .npz with x_train, y_train, x_test, y_test",
    )
    bench.add_argument("--epochs", type=_positive_int, default=None, help="epochs per policy (default 5)")
    bench.add_argument("--batch-size", type=_positive_int, default=128)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--train-samples", type=_positive_int, default=None, help="use only the first N training samples"
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="run each policy N times, alternating, and keep its fastest run (default 1, 2 with --quick)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a preset of about a minute and a half on 2 CPU cores: cnn, 8,000 "
        "images, 4 epochs, 2 alternating runs per policy, --stop-early",
    )
    bench.add_argument(
        "--stop-early",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stop a mixed policy after its first epoch when, even 1.5x faster than its "
        "warm steps ran, it would be slower than float32 (default: with --quick only)",
    )
    bench.add_argument(
        "--force", action="store_true", help="run policies the probe measures as emulated (very slow)"
    )
    bench.add_argument(
        "--no-probe",
        action="store_true",
        help="do not measure the policies' speed first; judge from CPU/GPU features",
    )
    bench.add_argument("--quiet", action="store_true", help="print only the table and verdict")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    bench.add_argument(
        "--plot",
        metavar="PATH",
        help="plot epoch time, memory and accuracy per policy (.png, .svg or .pdf; needs matplotlib)",
    )
    bench.set_defaults(handler=_bench)

    tune = commands.add_parser(
        "tune",
        help="find the fastest dtype policy for a model and the layers that must stay float32, "
        "and prove it with a measured run",
        description=(
            "For each mixed policy this machine does not emulate (or those given), find on "
            "the data the few layers that must compute in float32 (overflow, a share of "
            "float16's range, or a large error against float32), then train the candidate "
            "plans and float32 side by side, each in its own process, from the same weights "
            "on the same batches, until their step times separate; print the plan, the "
            "evidence, and the code to use it."
        ),
    )
    tune.add_argument(
        "--model",
        type=_model_spec,
        default=None,
        metavar="MODEL",
        help="as for bench: mlp, cnn, MODULE:FUNCTION or path/to/file.py:FUNCTION "
        "(default: mlp; cnn with --quick)",
    )
    tune.add_argument(
        "--policies",
        nargs="+",
        metavar="POLICY",
        type=_candidate_list,
        help="the candidates (space or comma separated); the plan is the best of these, "
        "whatever their speed here, and float32 is timed beside them (default: float32 "
        "and every mixed policy the probe does not measure as emulated); float8 adds "
        "per-layer float8 within each mixed policy, for the layers measured faster in it",
    )
    tune.add_argument("--dataset", default="synthetic", help="as for bench")
    tune.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="the most training steps of the proof, per candidate (default 200)",
    )
    tune.add_argument(
        "--time-budget",
        type=_positive_int,
        default=None,
        metavar="SECONDS",
        help="stop the proof after this many seconds (after its first 5 rounds)",
    )
    tune.add_argument("--batch-size", type=_positive_int, default=128)
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument(
        "--train-samples", type=_positive_int, default=None, help="use only the first N training samples"
    )
    tune.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="how far below float32's validation accuracy a plan may end (default 0.01)",
    )
    tune.add_argument(
        "--quick",
        action="store_true",
        help="a preset of under 3 minutes on 2 CPU cores: cnn, 4,000 images, 60 steps",
    )
    tune.add_argument(
        "--no-probe",
        action="store_true",
        help="do not measure the policies' speed first; judge from CPU/GPU features",
    )
    tune.add_argument("--quiet", action="store_true", help="print only the plan")
    tune.add_argument(
        "--json",
        metavar="PATH",
        help="write the plan and its evidence as JSON (mp.PrecisionPlan.from_json reads it)",
    )
    tune.add_argument("--markdown", metavar="PATH", help="write the plan as Markdown")
    tune.add_argument(
        "--plot",
        metavar="PATH",
        help="plot step time and validation metric per candidate (.png, .svg or .pdf; needs matplotlib)",
    )
    tune.set_defaults(handler=_tune)

    doctor = commands.add_parser(
        "doctor",
        help="measure which dtype policy this machine speeds up, and check versions, GPUs and CPU",
        description=(
            "Which dtype policy does this machine speed up? Versions, CUDA/cuDNN, GPUs, CPU "
            "features, and a short probe (matrix multiply and convolution, forward and "
            "backward) timed under each policy."
        ),
    )
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--no-probe", action="store_true", help="skip the measurement; advise from CPU/GPU features alone"
    )
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
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow is imported
    from mp_callbacks_bench import _native_stderr

    with _native_stderr.filtered():
        _show_progress(not getattr(args, "quiet", True))
        from mp_callbacks_bench.data import DatasetError

        try:
            return args.handler(args)
        except (BenchError, DatasetError) as error:
            print(f"{_PROG} {args.command}: error: {error}", file=sys.stderr)
            return 2


_PROGRESS_HANDLER = logging.StreamHandler()
_PROGRESS_HANDLER.setFormatter(logging.Formatter("%(message)s"))


def _show_progress(enabled: bool) -> None:
    """The benchmark reports progress through logging; show it on stderr
    (warnings even under --quiet). The handler writes to this call's
    sys.stderr: main() may run again in one process with another stream."""
    _PROGRESS_HANDLER.stream = sys.stderr  # (setStream would flush a closed old one)
    for name in ("mp_callbacks_bench", "mp_callbacks.autotune"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO if enabled else logging.WARNING)
        if _PROGRESS_HANDLER not in logger.handlers:
            logger.addHandler(_PROGRESS_HANDLER)
            logger.propagate = False


# ----------------------------------------------------------------- bench
_OUTPUT_SUFFIXES = {
    "json": (".json",),
    "markdown": (".md", ".markdown"),
    "plot": (".png", ".svg", ".pdf"),
}


def check_output_path(flag: str, path: str) -> None:
    """Refuses, before any training, an output path that cannot be written:
    a wrong extension, a folder that does not exist (none is created), a
    folder or file that is not writable, or a folder given as the file."""
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


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise BenchError('--plot needs matplotlib: pip install "mp_callbacks[plot]"') from error


def _bench(args: argparse.Namespace) -> int:
    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag):
            check_output_path(flag, getattr(args, flag))
    if args.plot:
        _require_matplotlib()
    from mp_callbacks_bench.api import run_bench
    from mp_callbacks_bench.report import format_skipped, plot_results

    policies = [p for group in args.policies for p in group] if args.policies else None
    report = run_bench(
        args.model,
        policies=policies,
        dataset=args.dataset,
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        train_samples=args.train_samples,
        repeats=args.repeats,
        quick=args.quick,
        stop_early=args.stop_early,
        force=args.force,
        probe=not args.no_probe,
        quiet=args.quiet,
    )
    print(report.header)
    print(report.table())
    for line in format_skipped(report.skipped):
        print(line)
    print(f"verdict: {report.verdict}")
    # Everything is computed: a failed write must not lose the other outputs.
    failures: list[str] = []
    if args.json:
        _write(args.json, report.to_json(), failures)
    if args.markdown:
        text = "\n".join(
            [
                report.header,
                "",
                report.table(markdown=True),
                "",
                *format_skipped(report.skipped),
                f"verdict: {report.verdict}",
                "",
            ]
        )
        _write(args.markdown, text, failures)
    if args.plot:
        try:
            plot_results(report.results, args.plot, title=f"{report.settings.model}: {report.device}")
        except (OSError, ValueError) as error:
            failures.append(f"cannot write {args.plot}: {error}")
    for failure in failures:
        print(f"{_PROG} bench: error: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _tune(args: argparse.Namespace) -> int:
    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag):
            check_output_path(flag, getattr(args, flag))
    if args.plot:
        _require_matplotlib()
    if not 0.0 < args.tolerance <= 1.0:
        raise BenchError(f"--tolerance {args.tolerance}: must be in (0, 1]")
    from mp_callbacks_bench.tune import plot_plan, run_tune

    policies = [p for group in args.policies for p in group] if args.policies else None
    plan = run_tune(
        args.model,
        policies=policies,
        dataset=args.dataset,
        steps=args.steps,
        time_budget=args.time_budget,
        batch_size=args.batch_size,
        seed=args.seed,
        train_samples=args.train_samples,
        tolerance=args.tolerance,
        quick=args.quick,
        probe=not args.no_probe,
    )
    print(plan)
    failures: list[str] = []
    if args.json:
        _write(args.json, plan.to_json(), failures)
    if args.markdown:
        text = "\n".join(
            [
                f"# Precision plan: {plan.policy}",
                "",
                "```text",
                plan.table(),
                "```",
                "",
                *(f"- {reason}" for reason in plan.reasons),
                "",
                "```python",
                plan.code,
                "```",
                "",
            ]
        )
        _write(args.markdown, text, failures)
    if args.plot:
        try:
            plot_plan(plan, args.plot)
        except (OSError, ValueError) as error:
            failures.append(f"cannot write {args.plot}: {error}")
    for failure in failures:
        print(f"{_PROG} tune: error: {failure}", file=sys.stderr)
    return 130 if plan.interrupted else (1 if failures else 0)


def _write(path: str, text: str, failures: list[str]) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as error:
        failures.append(f"cannot write {path}: {error.strerror}")


# ---------------------------------------------------------------- doctor
def _doctor(args: argparse.Namespace) -> int:
    from mp_callbacks import inspect_hardware
    from mp_callbacks_bench.api import _versions

    report = inspect_hardware(measure=not args.no_probe)
    if args.json:
        print(json.dumps({**report.as_dict(), "versions": _versions()}, indent=2))
    else:
        print(report.format_text())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
