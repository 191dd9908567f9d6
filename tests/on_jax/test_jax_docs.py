"""The backends page's code runs on JAX as written, and says what it prints."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import keras
import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "backends.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX backend's tests")


def _printed_and_expected(page: Path) -> tuple[list[str], list[str]]:
    """What a page's code blocks print when run in order in one namespace,
    and what its `print(...)  # expected` lines say they print."""
    blocks = [b for b in BLOCK.findall(page.read_text()) if not b.startswith("# fragment")]
    assert blocks
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    printed: list[str] = []
    keras.utils.set_random_seed(0)
    try:
        for number, code in enumerate(blocks, 1):
            output = io.StringIO()
            with contextlib.redirect_stdout(output):
                exec(compile(code, f"<{page.name} block {number}>", "exec"), namespace)
            printed += [line.strip() for line in output.getvalue().splitlines() if line.strip()]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    expected = [
        line.split("  # ", 1)[1].strip()
        for code in blocks
        for line in code.splitlines()
        if line.lstrip().startswith("print(") and "  # " in line
    ]
    return printed, expected


def test_the_backends_page_runs_and_prints_what_it_says():
    printed, expected = _printed_and_expected(PAGE)
    assert printed == expected


def test_the_page_names_what_does_not_run_on_jax_as_the_library_does():

    cells = [line.split("|") for line in PAGE.read_text().splitlines() if line.startswith("|")]
    rows = ["|".join(row) for row in cells if len(row) > 3 and "not yet" in row[3]]  # JAX's column
    named = {name for row in rows for name in re.findall(r"`([A-Za-z_]+)`", row.split("|")[1])}
    assert named == set()  # every public name runs on JAX


DOCS = PAGE.parents[1]
TORCH_PAGE = PAGE.with_name("pytorch.md")
_USES_TENSORFLOW = re.compile(r"\btf\.|import tensorflow")


def _pages_without_tensorflow():
    """The pages whose code uses no TensorFlow: a JAX user runs them as
    written (the rest are TensorFlow's own: tapes, tf.distribute)."""
    pages = sorted(DOCS.rglob("*.md"))
    return [
        page
        for page in pages
        if page not in (PAGE, TORCH_PAGE)
        and any(not block.startswith("# fragment") for block in BLOCK.findall(page.read_text()))
        and not any(_USES_TENSORFLOW.search(block) for block in BLOCK.findall(page.read_text()))
    ]


def test_the_sweep_runs_the_pages_a_jax_user_would_run():
    names = {page.stem for page in _pages_without_tensorflow()}
    assert {"model", "callbacks", "finding-overflows", "autotune", "keras-tuner", "index"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_without_tensorflow(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_page_without_tensorflow_runs_on_jax_and_prints_what_it_says(page):
    printed, expected = _printed_and_expected(page)
    assert printed == expected
