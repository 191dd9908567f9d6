"""The built wheel carries the license and the PEP 561 marker."""

from __future__ import annotations

import configparser
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_license_and_py_typed(tmp_path):
    # Built from a copy: pip builds in the source tree (egg-info, build/), and
    # CI installs other venvs from the checkout while this suite runs.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "site", "*.egg-info", "__pycache__", ".hypothesis"
        ),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("mp_callbacks-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "mp_callbacks/py.typed" in names
    # The library and, apart from it, the benchmark application.
    assert "mp_callbacks/loss_scale.py" in names and "mp_callbacks_bench/cli.py" in names
    assert not any(name.startswith(("tests/", "benchmarks/", "examples/")) for name in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mp-callbacks = mp_callbacks_bench.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert any(
        name.endswith(".dist-info/licenses/LICENSE") or name.endswith(".dist-info/LICENSE") for name in names
    ), names
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text


def test_the_bench_application_uses_the_librarys_public_api_only():
    private = []
    for path in sorted((ROOT / "mp_callbacks_bench").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith(("import mp_callbacks.", "from mp_callbacks.")) and (
                "mp_callbacks._" in stripped or "mp_callbacks." in stripped.split(" import")[0]
            ):
                private.append(f"{path.name}:{number}: {stripped}")
    assert private == [], private


def test_the_core_install_names_no_benchmark_only_dependency():
    setup = (ROOT / "setup.cfg").read_text()
    core = setup.split("install_requires =", 1)[1].split("\n[", 1)[0]
    assert "psutil" not in core and "keras" in core


def test_the_hub_extra_is_keras_hubs_dependencies_but_tensorflow_text():
    """`.[hub]` then `pip install --no-deps keras-hub` must leave keras-hub whole."""
    metadata = pytest.importorskip("importlib.metadata")
    try:
        required = metadata.requires("keras-hub") or []
    except metadata.PackageNotFoundError:
        pytest.skip("keras-hub is not installed here")
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    hub = setup["options.extras_require"]["hub"]
    extra = {line.strip() for line in hub.splitlines() if line.strip()}
    core = {
        requirement.split(";")[0].strip()
        for requirement in required
        if "extra ==" not in requirement and not requirement.startswith("tensorflow-text")
    }
    assert extra == core
