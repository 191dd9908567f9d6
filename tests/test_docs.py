"""The documentation's code blocks run as written, and say what they print.

Every ```python block of a page in docs/ runs, in order, in one namespace
per page, unless its first line is `# fragment`. A line
`print(...)  # expected` asserts what it prints, as in the docstring
examples (test_docstrings.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(path for path in DOCS.rglob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def runs_on_jax(page: Path) -> bool:
    """A page whose code sets Keras's JAX or torch backend runs in that
    backend's suite (tests/on_jax, tests/on_torch), not here."""
    text = page.read_text()
    return any(f'os.environ["KERAS_BACKEND"] = "{backend}"' in text for backend in ("jax", "torch"))


def code_blocks(page: Path) -> list[str]:
    return [block for block in BLOCK.findall(page.read_text()) if not block.startswith("# fragment")]


def expected_output(code: str) -> list[str]:
    return [
        line.split("  # ", 1)[1].strip()
        for line in code.splitlines()
        if line.lstrip().startswith("print(") and "  # " in line
    ]


def test_the_guide_has_pages_and_code():
    guide = [page.stem for page in PAGES if page.parent.name == "guide"]
    assert {
        "model",
        "loss-scale",
        "callbacks",
        "finding-overflows",
        "custom-train-step",
        "hand-written-loops",
        "keras-tuner",
        "distribution",
        "autotune",
        "bench-and-doctor",
        "tensorboard",
        "backends",
        "pytorch",
    } <= set(guide)
    assert sum(len(code_blocks(page)) for page in PAGES) >= 20


def run_in_this_process(page: Path) -> list[str]:
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    printed = []
    keras.utils.set_random_seed(0)
    try:
        for number, code in enumerate(code_blocks(page), 1):
            output = io.StringIO()
            with contextlib.redirect_stdout(output):
                exec(compile(code, f"<{page.name} block {number}>", "exec"), namespace)
            printed += output.getvalue().splitlines()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return printed


def run_in_a_new_process(page: Path) -> list[str]:
    # A page that creates its own tf.distribute strategy: a second strategy
    # in one process reuses the first one's collective keys (conftest.py).
    script = "\n".join(["import keras", "keras.utils.set_random_seed(0)", *code_blocks(page)])
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if code_blocks(p) and not runs_on_jax(p)],
    ids=lambda p: str(p.relative_to(DOCS)),
)
def test_page_code_runs_and_prints_what_it_says(page):
    run = run_in_a_new_process if "tf.distribute." in page.read_text() else run_in_this_process
    printed = [line.strip() for line in run(page) if line.strip()]
    expected = [line for code in code_blocks(page) for line in expected_output(code)]
    assert printed == expected


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written(tmp_path):
    # A new user copies it into a file and runs it: nothing is defined for it.
    readme = (DOCS.parent / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1]
    code = BLOCK.findall(quick_start)[0]
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout.strip().splitlines()[-1]
    assert printed.startswith("[") and printed.count("[") == 3  # three per-epoch lists


def test_ci_runs_the_readmes_test_command_on_every_backend():
    # CI runs what a new user runs: the README's second command's pytest part.
    readme = (DOCS.parent / "README.md").read_text()
    commands = re.search(r"^```bash\n(.*?)^```", readme, re.S | re.M).group(1)
    install_and_test = [
        line for line in commands.splitlines() if "pytest" in line and not line.startswith("#")
    ]
    test_command = install_and_test[0].rsplit("&& ", 1)[1]
    ci_tests = [
        line.strip()
        for line in (DOCS.parent / ".ci" / "run").read_text().splitlines()
        if line.strip().startswith("python -m pytest")
    ]
    assert test_command.startswith("python -m pytest")
    # TensorFlow's stages (run_tests, with extra arguments on the oldest
    # versions), JAX's and torch's.
    assert ci_tests == [f'{test_command} "$@"', test_command, test_command], ci_tests


MEASURED = re.compile(r"\b\d+\.\d+x\b|\b[01]\.\d{3}\b")  # a speed ratio (1.38x) or an overhead ratio (1.015)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"\b(Intel|AMD|ARM|Apple|Graviton|T4|A100|V100|H100)\b")


def _measured_blocks(text: str):
    """Each ```text block and each Markdown table holding a measured ratio,
    with the text before it (its introduction)."""
    pattern = re.compile(r"^```text\n.*?^```|(?:^\|[^\n]*\|\n)+", re.S | re.M)
    for match in pattern.finditer(text):
        if MEASURED.search(match.group(0)):
            yield match.group(0), text[max(0, match.start() - 700) : match.start()]


@pytest.mark.parametrize(
    "page", [DOCS.parent / "README.md", *PAGES], ids=lambda p: str(p.relative_to(DOCS.parent))
)
def test_every_measured_figure_names_its_date_and_machine(page):
    """Figures differ from machine to machine and day to day: a table or an
    output that quotes a measured speed says when and where, in itself or in
    the text that introduces it."""
    for block, introduction in _measured_blocks(page.read_text()):
        for what, pattern in (("a date", DATE), ("a CPU or GPU model", MACHINE)):
            assert pattern.search(block) or pattern.search(introduction), (
                f"{page.name}: a measured figure without {what}:\n{block[:300]}"
            )
