"""The documentation's code blocks run as written, and say what they print.

Every ```python block of a page in docs/ runs, in order, in one namespace
per page, unless its first line is `# fragment`. A line
`print(...)  # expected` asserts what it prints, as in the docstring
examples (test_docstrings.py).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import keras
import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(path for path in DOCS.rglob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def code_blocks(page: Path) -> list[str]:
    return [block for block in BLOCK.findall(page.read_text()) if not block.startswith("# fragment")]


def expected_output(code: str) -> list[str]:
    return [line.split("  # ", 1)[1].strip() for line in code.splitlines()
            if line.lstrip().startswith("print(") and "  # " in line]


def test_the_guide_has_pages_and_code():
    guide = [page.stem for page in PAGES if page.parent.name == "guide"]
    assert {"model", "loss-scale", "callbacks", "finding-overflows", "custom-train-step",
            "hand-written-loops", "keras-tuner", "distribution", "autotune",
            "bench-and-doctor"} <= set(guide)
    assert sum(len(code_blocks(page)) for page in PAGES) >= 20


@pytest.mark.parametrize("page", [p for p in PAGES if code_blocks(p)],
                         ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs_and_prints_what_it_says(page):
    namespace: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    printed, expected = [], []
    keras.utils.set_random_seed(0)
    try:
        for number, code in enumerate(code_blocks(page), 1):
            output = io.StringIO()
            with contextlib.redirect_stdout(output):
                exec(compile(code, f"<{page.name} block {number}>", "exec"), namespace)
            printed += [line.strip() for line in output.getvalue().splitlines() if line.strip()]
            expected += expected_output(code)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert printed == expected
