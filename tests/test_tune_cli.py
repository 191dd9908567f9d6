"""`mp-callbacks tune`: bench's spec forms and error rules, and a real
quick run through a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest

import mp_callbacks as mp
from mp_callbacks_bench.cli import main

# Its module-scoped fixtures are built once: the whole file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_tune_cli")

STARTUP_NOISE = ("absl::InitializeLog", "oneDNN custom operations", "cpu_feature_guard", "rebuild TensorFlow")


@pytest.fixture(scope="module")
def quick_tune(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tune")
    paths = {
        k: directory / name
        for k, name in (("json", "plan.json"), ("markdown", "plan.md"), ("plot", "plan.png"))
    }
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mp_callbacks_bench",
            "tune",
            "--quick",
            "--train-samples",
            "1024",
            "--steps",
            "20",
            "--json",
            str(paths["json"]),
            "--markdown",
            str(paths["markdown"]),
            "--plot",
            str(paths["plot"]),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return completed, paths


@pytest.mark.slow
def test_quick_tune_prints_the_plan_and_writes_its_evidence(quick_tune):
    completed, paths = quick_tune
    assert completed.returncode == 0, completed.stderr[-3000:]
    plan = mp.PrecisionPlan.from_json(paths["json"].read_text())
    assert plan.candidates[0]["policy"] == "float32" and plan.measured_on.startswith(("CPU", "GPU"))
    for candidate in plan.candidates[1:]:
        assert candidate["speed"] in ("faster", "slower", "tie") and candidate["metric"] > 0.1
        assert len(candidate["ratios"]) >= 5  # paired rounds
    assert f"plan: {plan.policy}" in completed.stdout and "to use it:" in completed.stdout
    assert plan.code.splitlines()[0] in completed.stdout
    assert "autotune: round 1/" in completed.stderr  # progress, with the time left
    assert not [
        line for line in completed.stderr.splitlines() if any(noise in line for noise in STARTUP_NOISE)
    ]
    assert paths["markdown"].read_text().startswith(f"# Precision plan: {plan.policy}")
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["tune", "--model", "resnet"], "argument --model: 'resnet': use mlp, cnn, MODULE:FUNCTION"),
        (["tune", "--policies", "float64"], "argument --policies: unknown policy 'float64'"),
        (["tune", "--policies", "float8"], "float8 needs a mixed policy beside it"),
        (["tune", "--steps", "0"], "must be a positive integer; got '0'"),
        (["tune", "--model", "no_such_module_xyz:build"], "no module named 'no_such_module_xyz'"),
        (["tune", "--dataset", "imagenet"], "unknown dataset 'imagenet'"),
        (["tune", "--tolerance", "2"], "--tolerance 2.0: must be in (0, 1]"),
        (["tune", "--json", "x.csv"], "--json x.csv: the file name must end with .json"),
        (["tune", "--plot", "x.txt"], "--plot x.txt: the file name must end with .png or .svg or .pdf"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2_before_any_training(argv, expected, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    stderr = capsys.readouterr().err.strip()
    assert code == 2 and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("mp-callbacks tune") and expected in stderr
    assert "autotune" not in stderr and "Traceback" not in stderr


def test_help_and_argument_errors_do_not_import_tensorflow():
    script = (
        "import sys\n"
        "from mp_callbacks_bench.cli import main\n"
        "for argv in (['tune', '--help'], ['tune', '--steps', '0']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('TF', 'tensorflow' in sys.modules)\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert completed.stdout.strip().splitlines()[-1] == "TF False", completed.stderr
    assert "--quick" in completed.stdout and "float32" in completed.stdout
