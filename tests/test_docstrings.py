"""Every public class's docstring example runs as written."""

from __future__ import annotations

import contextlib
import io
import textwrap

import pytest

import mp_callbacks as mp

DOCUMENTED = [
    mp.LossScaler,
    mp.MixedPrecisionModel,
    mp.LossScaleMonitor,
    mp.NaNGradientMonitor,
    mp.EpochTimer,
    mp.LossScaleOptimizer,
    mp.HeadroomMonitor,
    mp.diagnose_batch,
    mp.with_float32_layers,
    mp.PrecisionPlan,
    mp.float32_copy,
    mp.SpeedComparison,
]


@pytest.mark.parametrize("cls", DOCUMENTED, ids=lambda c: c.__name__)
def test_docstring_example_runs(cls):
    doc = cls.__doc__
    assert "Args:" in doc or "Arguments" in doc or cls is mp.MixedPrecisionModel
    example = textwrap.dedent(doc.split("```python", 1)[1].split("```", 1)[0])
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(example, f"<{cls.__name__} docstring>", "exec"), {})
    expected = [
        line.split("# ", 1)[1].strip()
        for line in example.splitlines()
        if line.lstrip().startswith("print(") and "# " in line
    ]
    printed = [line.strip() for line in output.getvalue().strip().splitlines()]
    assert expected, f"{cls.__name__}'s example documents no output"
    assert printed == expected
