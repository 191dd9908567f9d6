"""The PyTorch page's code runs on torch as written and says what it
prints; the backends table names what does not run on torch as the
library does."""

from __future__ import annotations

import re
from pathlib import Path

import keras
import pytest

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch backend's tests")

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_pytorch_page_runs_and_prints_what_it_says(capsys):
    blocks = [b for b in BLOCK.findall((GUIDE / "pytorch.md").read_text()) if not b.startswith("# fragment")]
    assert len(blocks) == 2
    namespace: dict = {"__name__": "docs_pytorch"}
    keras.utils.set_random_seed(0)
    try:
        for number, code in enumerate(blocks, 1):
            exec(compile(code, f"<pytorch.md block {number}>", "exec"), namespace)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    printed = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip()]
    expected = [
        line.split("  # ", 1)[1].strip()
        for code in blocks
        for line in code.splitlines()
        if line.lstrip().startswith("print(") and "  # " in line
    ]
    assert printed == expected


def test_the_backends_table_names_what_does_not_run_on_torch_as_the_library_does():

    cells = [
        line.split("|") for line in (GUIDE / "backends.md").read_text().splitlines() if line.startswith("|")
    ]
    assert cells[0][4].strip() == "PyTorch"
    not_yet = [row for row in cells if len(row) > 4 and "not yet" in row[4]]
    named = {name for row in not_yet for name in re.findall(r"`([A-Za-z_]+)`", row[1])[:1]}
    assert named == set() and not_yet == []
