"""`mp-callbacks bench` and `doctor`, through subprocess and through main()."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mp_callbacks.hardware import PATHOLOGICAL_SPEED, inspect_hardware
from mp_callbacks_bench.cli import _version, main
from mp_callbacks_bench.report import verdict
from mp_callbacks_bench.settings import POLICIES

# The `bench --quick` run takes minutes: the tests that read it share one
# xdist group, so it is built on one worker, once. Only they: a group runs
# on one worker, and the whole file there would be the suite's longest path.
QUICK_BENCH_GROUP = pytest.mark.xdist_group("test_cli.quick_bench")

RESULT_FIELDS = {
    "policy",
    "epoch_time",
    "epoch_time_min",
    "epoch_time_max",
    "samples_per_sec",
    "speedup",
    "peak_memory_mb",
    "estimated_step_memory",
    "accuracy",
    "skipped_steps",
    "optimizer",
    "diverged",
}
STARTUP_NOISE = ("absl::InitializeLog", "oneDNN custom operations", "cpu_feature_guard", "rebuild TensorFlow")


def _cli(*args, env=None, timeout=600, module="mp_callbacks_bench"):
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench")
    paths = {
        k: directory / name
        for k, name in (("json", "out.json"), ("markdown", "table.md"), ("plot", "plot.png"))
    }
    # --quick, cut to 1,024 training samples to keep the suite short.
    completed = _cli(
        "bench",
        "--quick",
        "--train-samples",
        "1024",
        "--json",
        str(paths["json"]),
        "--markdown",
        str(paths["markdown"]),
        "--plot",
        str(paths["plot"]),
    )
    return completed, paths


@pytest.mark.slow
@QUICK_BENCH_GROUP
def test_quick_bench_compares_every_policy_the_probe_does_not_rule_out(quick_bench):
    completed, paths = quick_bench
    assert completed.returncode == 0, completed.stderr[-2000:]
    document = json.loads(paths["json"].read_text())
    measured = document["hardware"]["measured"]
    assert set(measured) == set(POLICIES) and measured["float32"] == 1.0
    emulated = [p for p in ("mixed_float16",) if measured[p] < PATHOLOGICAL_SPEED]
    assert [s["policy"] for s in document["skipped_policies"]] == emulated
    for skipped in document["skipped_policies"]:
        assert "in the probe" in skipped["reason"] and "--force" in skipped["reason"]
    results = {r["policy"]: r for r in document["results"]}
    assert list(results) == [p for p in POLICIES if p not in emulated]
    assert "mixed_bfloat16" in results  # always compared
    for result in results.values():
        assert set(result) >= RESULT_FIELDS
        assert result["epoch_time_min"] <= result["epoch_time"] <= result["epoch_time_max"]
        assert result["optimizer"] == "Adam" and not result["diverged"]
        if result.get("stopped_early"):
            # A mixed policy above the probe's cutoff (0.25x) that is still
            # hopeless after its first epoch: one epoch of one run, and why.
            # (Measured on a 2-core AMD EPYC: float16 at 0.26x in the probe.)
            assert result["policy"] != "float32" and result["epochs"] == 1
            assert result["epoch_times_of_runs"] == [result["epoch_time"]]
            assert result["stopped_early"].startswith("stopped after its first epoch")
            continue
        # Two alternating runs, and up to four while they do not separate.
        assert 2 <= len(result["epoch_times_of_runs"]) <= 4
        assert result["accuracy"] > 0.2  # ten classes: chance is 0.1
        assert result["epochs"] == 4
    assert results["float32"]["speedup"] == 1.0
    assert document["recommended_policy"] == verdict(document["results"])[0]
    assert document["verdict"] == verdict(document["results"])[1]
    assert document["model"] == "cnn" and document["settings"]["epochs"] == 4
    assert {"tensorflow", "keras", "mp_callbacks", "python"} <= set(document["versions"])


@pytest.mark.slow
@QUICK_BENCH_GROUP
def test_estimated_step_memory_shows_what_mixed_precision_changes(quick_bench):
    _, paths = quick_bench
    rows = {r["policy"]: r["estimated_step_memory"] for r in json.loads(paths["json"].read_text())["results"]}
    float32, bfloat16 = rows["float32"], rows["mixed_bfloat16"]
    # Variables stay float32 (same weights, gradients, Adam slots); the
    # activations are computed in bfloat16: half, except the float32 softmax.
    for part in ("weights", "gradients", "optimizer"):
        assert bfloat16[part] == float32[part] > 0
    assert 0.5 * float32["activations"] < bfloat16["activations"] < 0.55 * float32["activations"]
    assert bfloat16["total"] < float32["total"]


@pytest.mark.slow
@QUICK_BENCH_GROUP
def test_quick_bench_prints_table_verdict_and_writes_markdown_and_plot(quick_bench):
    completed, paths = quick_bench
    document = json.loads(paths["json"].read_text())
    lines = completed.stdout.strip().splitlines()
    assert lines[0].startswith("cnn on built-in synthetic digits")
    assert lines[1].split()[:3] == ["policy", "epoch", "time"]
    assert any(line.startswith("float32") and "1.00x" in line for line in lines)
    assert lines[-1] == f"verdict: {document['verdict']}"
    for skipped in document["skipped_policies"]:
        assert f"not run: {skipped['policy']}: {skipped['reason']}" in lines
    assert "epoch 4/4" in completed.stderr  # progress per policy and epoch
    markdown = paths["markdown"].read_text()
    assert "| policy | epoch time (s) | range over runs (s) |" in markdown
    assert f"verdict: {document['verdict']}" in markdown
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@QUICK_BENCH_GROUP
def test_no_tensorflow_start_up_lines_reach_the_terminal(quick_bench):
    # Seven processes (the command and six training runs) each print these
    # at start-up; none gets through, and the runs' own progress does.
    completed, _ = quick_bench
    for noise in STARTUP_NOISE:
        assert noise not in completed.stderr
    assert "[float32] training cnn (run 2/2)" in completed.stderr


# ------------------------------------------------------ the user's model
USER_MODELS = """
import keras


def build():
    return keras.Sequential([
        keras.Input((28, 28)), keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10),
        keras.layers.Activation("softmax", dtype="float32"),
    ])


def build_compiled():
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def build_named():
    # Named inputs, as KerasHub's text models take them.
    ids = keras.Input((8,), dtype="int32", name="token_ids")
    mask = keras.Input((8,), dtype="float32", name="padding_mask")
    hidden = keras.layers.Embedding(16, 8)(ids) * keras.ops.expand_dims(mask, -1)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    outputs = keras.layers.Dense(2, activation="softmax", dtype="float32")(hidden)
    return keras.Model({"token_ids": ids, "padding_mask": mask}, outputs)


def wrong_input():
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(10)])


def three_classes():
    return keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten(), keras.layers.Dense(3)])


def not_a_model():
    return 42


def raises():
    raise RuntimeError("no GPU memory")


VALUE = 3
"""


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    directory = tmp_path_factory.mktemp("user_models")
    (directory / "bench_user_models.py").write_text(USER_MODELS)
    sys.path.insert(0, str(directory))
    yield directory / "bench_user_models.py"
    sys.path.remove(str(directory))
    sys.modules.pop("bench_user_models", None)


SMALL = ["--policies", "float32", "mixed_bfloat16", "--epochs", "2", "--train-samples", "512"]


@pytest.mark.slow
def test_bench_of_a_model_in_a_file(user_module, tmp_path, capsys):
    out = tmp_path / "file.json"
    code = main(["bench", "--model", f"{user_module}:build_compiled", *SMALL, "--quiet", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    document = json.loads(out.read_text())
    assert document["model"] == f"{user_module}:build_compiled"
    rows = document["results"]
    assert [r["policy"] for r in rows] == ["float32", "mixed_bfloat16"]
    assert {r["optimizer"] for r in rows} == {"SGD"}  # the user's compile is kept
    assert all(r["epochs"] == 2 and np.isfinite(r["loss"]) and not r["diverged"] for r in rows)
    assert capsys.readouterr().out.startswith(f"{user_module}:build_compiled on built-in")


def _named_npz(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 16, (160, 8)).astype("int32")
    mask = np.ones((160, 8), "float32")
    labels = ids[:, 0] % 2
    path = tmp_path / "named.npz"
    np.savez(
        path,
        **{"x_train.token_ids": ids[:128], "x_train.padding_mask": mask[:128], "y_train": labels[:128]},
        **{"x_test.token_ids": ids[128:], "x_test.padding_mask": mask[128:], "y_test": labels[128:]},
    )
    return str(path)


@pytest.mark.slow
def test_bench_of_a_model_with_named_inputs(user_module, tmp_path, capsys):
    data, out = _named_npz(tmp_path), tmp_path / "named.json"
    argv = ["--dataset", data, "--policies", "float32", "mixed_bfloat16", "--epochs", "1", "--quiet"]
    code = main(["bench", "--model", f"{user_module}:build_named", *argv, "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in rows] == ["float32", "mixed_bfloat16"]
    assert all(np.isfinite(r["loss"]) and 0.0 <= r["accuracy"] <= 1.0 for r in rows)
    tuned = tmp_path / "tuned.json"
    tune = ["--model", f"{user_module}:build_named", "--dataset", data, "--steps", "10", "--batch-size", "16"]
    assert (
        main(["tune", *tune, "--policies", "float32", "mixed_bfloat16", "--quiet", "--json", str(tuned)]) == 0
    )
    plan = json.loads(tuned.read_text())
    assert [c["policy"] for c in plan["candidates"]] == ["float32", "mixed_bfloat16"]
    assert main(["bench", "--model", "mlp", *argv]) == 2  # a built-in model takes one array
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            f"--model mlp: a built-in model takes one input array, and {data} has named inputs "
            "['padding_mask', 'token_ids']: give --model path/to/file.py:FUNCTION"
        )
    )


@pytest.mark.slow
def test_python_api_benches_a_module_function_with_the_same_rows(user_module, tmp_path):
    import bench_user_models

    from mp_callbacks_bench import run_bench

    report = run_bench(
        bench_user_models.build, policies=["float32", "mixed_bfloat16"], epochs=2, train_samples=512
    )
    assert report.settings.model == "bench_user_models:build"
    assert [r["policy"] for r in report.results] == ["float32", "mixed_bfloat16"]
    assert {r["optimizer"] for r in report.results} == {"Adam"}  # compiled for the user
    assert set(report.results[0]) >= RESULT_FIELDS
    document = json.loads(report.to_json())
    assert document["recommended_policy"] == report.recommended_policy
    assert report.table().splitlines()[2].startswith("float32")
    # The CLI's rows have the same fields.
    out = tmp_path / "cli.json"
    assert (
        main(
            [
                "bench",
                "--model",
                "bench_user_models:build",
                "--policies",
                "float32",
                "--epochs",
                "1",
                "--train-samples",
                "256",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    cli_row = json.loads(out.read_text())["results"][0]
    assert set(cli_row) == set(report.results[0])


@pytest.mark.parametrize(
    "function, expected",
    [
        (
            "wrong_input",
            "--model {spec}: the model does not take the data's samples of shape "
            "(28, 28) (it expects (10,)): ValueError: ",
        ),
        (
            "three_classes",
            "--model {spec}: the model's output has shape (3,) per sample; the data "
            "has 10 classes, so it needs (10,)",
        ),
        ("not_a_model", "--model {spec}: not_a_model() returned 42 (of type int), not a Keras model"),
        ("raises", "--model {spec}: raises() raised RuntimeError: no GPU memory"),
        ("VALUE", "--model {spec}: VALUE is not a function (it is of type int)"),
        ("missing", "--model {spec}: bench_user_models has no function 'missing'"),
    ],
)
def test_a_bad_model_is_one_line_before_any_training(function, expected, user_module, capsys):
    spec = f"bench_user_models:{function}"
    assert main(["bench", "--model", spec, "--policies", "float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("mp-callbacks bench: error: " + expected.format(spec=spec))
    assert "training" not in err


def test_missing_module_and_file_are_one_line(tmp_path, capsys):
    assert main(["bench", "--model", "no_such_module_xyz:build"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mp-callbacks bench: error: --model no_such_module_xyz:build: no module named 'no_such_module_xyz'"
    )
    missing = tmp_path / "nowhere.py"
    assert main(["bench", "--model", f"{missing}:build"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mp-callbacks bench: error: --model {missing}:build: no such file {missing}"
    )


# ------------------------------------------------------------ bad input
def _bad_npz(tmp_path, **arrays):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize(
    "argv_builder, expected",
    [
        (lambda t: ["bench", "--policies", "float64"], "argument --policies: unknown policy 'float64'"),
        (
            lambda t: ["bench", "--model", "resnet"],
            "argument --model: 'resnet': use mlp, cnn, MODULE:FUNCTION or path/to/file.py:FUNCTION",
        ),
        (
            lambda t: ["bench", "--model", "a-b:c"],
            "argument --model: 'a-b:c': 'a-b' is not a Python module name",
        ),
        (lambda t: ["bench", "--dataset", "imagenet"], "unknown dataset 'imagenet'"),
        (lambda t: ["bench", "--dataset", str(t / "missing.npz")], "no such file"),
        (lambda t: ["bench", "--epochs", "0"], "must be a positive integer; got '0'"),
        (lambda t: ["bench", "--batch-size", "-8"], "must be a positive integer; got '-8'"),
        (lambda t: ["bench", "--epochs", "two"], "must be a positive integer; got 'two'"),
        (
            lambda t: (
                t.joinpath("garbage.npz").write_bytes(b"not a zip"),
                ["bench", "--dataset", str(t / "garbage.npz")],
            )[1],
            "not an .npz archive",
        ),
        (
            lambda t: ["bench", "--dataset", _bad_npz(t, x_train=np.zeros((4, 3)))],
            "lacks y_train, x_test, y_test; it needs the arrays x_train, y_train, x_test, y_test "
            "(named inputs as x_train.<name> and x_test.<name>), and has x_train",
        ),
        (
            lambda t: [
                "bench",
                "--dataset",
                _bad_npz(
                    t,
                    x_train=np.zeros((4, 3)),
                    y_train=np.zeros(5, int),
                    x_test=np.zeros((2, 3)),
                    y_test=np.zeros(2, int),
                ),
            ],
            "same N",
        ),
        (
            lambda t: [
                "bench",
                "--model",
                "cnn",
                "--dataset",
                _bad_npz(
                    t,
                    x_train=np.zeros((4, 3)),
                    y_train=np.zeros(4, int),
                    x_test=np.zeros((2, 3)),
                    y_test=np.zeros(2, int),
                ),
            ],
            "use --model mlp",
        ),
        (lambda t: ["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_gives_one_line_and_exit_code_2(argv_builder, expected, tmp_path, capsys):
    argv = argv_builder(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    stderr = capsys.readouterr().err.strip()
    assert code == 2
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith(f"mp-callbacks {argv[0] if argv[0] == 'bench' else ''}".rstrip())
    assert expected in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_mnist_that_cannot_be_downloaded_is_a_clear_error(tmp_path):
    env = dict(
        os.environ,
        KERAS_HOME=str(tmp_path),
        HTTPS_PROXY="http://127.0.0.1:9",
        HTTP_PROXY="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
    )
    completed = _cli("bench", "--dataset", "mnist", "--policies", "float32", env=env, timeout=180)
    assert completed.returncode == 2
    assert "could not download MNIST" in completed.stderr
    assert "Traceback" not in completed.stderr


@pytest.mark.parametrize(
    "flag, name, expected",
    [
        ("--plot", "x.txt", "--plot {path}: the file name must end with .png or .svg or .pdf"),
        ("--json", "x.csv", "--json {path}: the file name must end with .json"),
        ("--markdown", "x.json", "--markdown {path}: the file name must end with .md or .markdown"),
        ("--json", "missing_dir/x.json", "--json {path}: the folder {parent} does not exist"),
        ("--json", "a_folder.json", "--json {path}: is a folder, not a file"),
    ],
)
def test_output_paths_are_refused_before_any_training(flag, name, expected, tmp_path, capsys):
    (tmp_path / "a_folder.json").mkdir()
    path = str(tmp_path / name)
    code = main(["bench", flag, path])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip() == "mp-callbacks bench: error: " + expected.format(
        path=path, parent=str(tmp_path / "missing_dir")
    )
    assert captured.out == ""
    assert not (tmp_path / "missing_dir").exists()  # no folder is created


# ------------------------------------------------- fast, quiet start-up
@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["bench", "--help"], 0),
        (["doctor", "--help"], 0),
        (["--version"], 0),
        (["bench", "--epochs", "0"], 2),
        (["bench", "--model", "resnet"], 2),
        ([], 2),
    ],
)
def test_help_version_and_argument_errors_do_not_import_tensorflow(argv, code):
    script = (
        "import sys\n"
        "from mp_callbacks_bench.cli import main\n"
        f"try:\n    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
        "print('EXIT', code, 'tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert completed.stdout.strip().splitlines()[-1] == f"EXIT {code} False False", completed.stderr


def test_help_texts_stand_on_their_own():
    texts = [
        _cli(*args, timeout=60).stdout for args in (["--help"], ["bench", "--help"], ["doctor", "--help"])
    ]
    assert all("usage: mp-callbacks" in text for text in texts)
    assert "--quick" in texts[1] and "MODULE:FUNCTION" in texts[1] and "--no-probe" in texts[2]
    for text in texts:
        assert "seed's" not in text and "the seed" not in text and "§" not in text


@pytest.mark.slow
def test_version_without_a_command():
    completed = _cli("--version", timeout=60)
    assert completed.returncode == 0
    assert completed.stdout.strip() == f"mp-callbacks {_version()}"
    assert _cli("--version", module="mp_callbacks", timeout=120).stdout == completed.stdout


# --------------------------------------------------------------- doctor
@pytest.mark.slow
def test_doctor_json_reports_measured_ratios_and_advice_that_follows_them():
    completed = _cli("doctor", "--json", timeout=300)
    assert completed.returncode == 0, completed.stderr
    document = json.loads(completed.stdout)
    measured = document["measured"]
    assert list(measured) == list(POLICIES) and measured["float32"] == 1.0
    assert all(isinstance(v, float) and v > 0 for v in measured.values())
    assert 0 < document["probe"]["seconds"] < 60
    # Given the same measurement, the advisor gives the same advice.
    same = inspect_hardware(speed=measured)
    assert document["recommended_policy"] == same.recommended_policy
    assert document["fast_policies"] == same.fast_policies
    assert document["cpu"]["model"] and document["versions"]["tensorflow"]
    for noise in STARTUP_NOISE:
        assert noise not in completed.stderr


@pytest.mark.slow
def test_doctor_text_and_no_probe():
    text = _cli("doctor", timeout=300)
    assert text.returncode == 0
    assert "Measured speed vs float32 on " in text.stdout and "Recommended policy: " in text.stdout
    unmeasured = json.loads(_cli("doctor", "--json", "--no-probe", timeout=300).stdout)
    assert unmeasured["measured"] is None and unmeasured["probe"] is None
    assert "not measured" in unmeasured["reason"]


def test_startup_noise_filter_keeps_real_errors():
    from mp_callbacks_bench._native_stderr import is_startup_noise

    assert is_startup_noise(
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
    )
    assert is_startup_noise("I0000 00:00:1795 port.cc:153] oneDNN custom operations are on. You may")
    assert not is_startup_noise("E0000 00:00:1795 cuda_driver.cc:1] failed call to cuInit")
    assert not is_startup_noise("Traceback (most recent call last):")
