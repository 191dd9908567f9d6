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


def test_the_backends_page_runs_and_prints_what_it_says():
    blocks = [b for b in BLOCK.findall(PAGE.read_text()) if not b.startswith("# fragment")]
    assert blocks
    namespace: dict = {"__name__": "docs_backends"}
    printed: list[str] = []
    keras.utils.set_random_seed(0)
    try:
        for number, code in enumerate(blocks, 1):
            output = io.StringIO()
            with contextlib.redirect_stdout(output):
                exec(compile(code, f"<backends.md block {number}>", "exec"), namespace)
            printed += [line.strip() for line in output.getvalue().splitlines() if line.strip()]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    expected = [
        line.split("  # ", 1)[1].strip()
        for code in blocks
        for line in code.splitlines()
        if line.lstrip().startswith("print(") and "  # " in line
    ]
    assert printed == expected


def test_the_page_names_what_does_not_run_on_jax_as_the_library_does():
    import mp_callbacks as mp

    rows = [line for line in PAGE.read_text().splitlines() if line.startswith("|") and "not yet" in line]
    named = {name for row in rows for name in re.findall(r"`([A-Za-z_]+)`", row.split("|")[1])}
    assert named == set(mp.TENSORFLOW_ONLY)
    assert not named & set(mp.__all__)  # nothing that runs here is said not to
