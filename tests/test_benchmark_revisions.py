"""benchmarks/_revisions.py: the package at a git revision, importable beside
the work tree's, for A/B runs of `step_overhead.py --revisions`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)

PROBE = """
import sys
sys.path.insert(0, "benchmarks")
import mp_callbacks
from _revisions import package_at
old = package_at("HEAD")
print(old.__name__)
print(old.MixedPrecisionModel is not mp_callbacks.MixedPrecisionModel)
print(old.MixedPrecisionModel.__module__)
try:
    package_at("no-such-revision")
except ValueError as error:
    print(error)
"""


@pytest.mark.slow
def test_a_revision_imports_under_its_own_name_beside_the_work_tree():
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == f"mp_callbacks_{head}"
    assert lines[1] == "True"
    # Every internal import was renamed: the copy does not reach back into the work tree.
    assert lines[2] == f"mp_callbacks_{head}.model"
    assert "--revisions" in lines[3] and "'no-such-revision'" in lines[3]


@pytest.mark.slow
def test_step_graph_finds_the_same_operations_at_head_and_counts_a_difference():
    result = subprocess.run(
        [
            sys.executable,
            "step_graph.py",
            "--model",
            "transformer",
            "--optimizer",
            "sgd",
            "--revisions",
            "HEAD",
        ],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "HEAD: " in result.stdout and "the same operations" in result.stdout
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_graph import differences
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from collections import Counter

    assert differences(Counter(Add=2, Mul=1), Counter(Add=3, Mul=1, Select=1)) == {"Add": 1, "Select": 1}
