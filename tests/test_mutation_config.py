"""The mutation-testing configuration is by behaviour: every text pattern
still matches the library, none names a library attribute, and the marks
tools/mutation_marks.py finds are the placeholders and logging-only
branches it describes, in the callbacks as they are."""

from __future__ import annotations

import configparser
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "mp_callbacks").rglob("*.py"))
_spec = importlib.util.spec_from_file_location("mutation_marks", ROOT / "tools" / "mutation_marks.py")
marks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(marks)


def _patterns():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return [line for line in config.get("mutmut", "do_not_mutate_patterns").strip().splitlines() if line]


@pytest.mark.parametrize("pattern", _patterns())
def test_every_pattern_still_matches_the_library(pattern):
    lines = [line for path in LIBRARY for line in path.read_text().splitlines()]
    assert any(re.search(pattern, line) for line in lines), f"{pattern!r} matches no line: stale"


@pytest.mark.parametrize("pattern", _patterns())
def test_no_pattern_names_a_private_attribute_of_the_library(pattern):
    assert not re.search(r"self\\?\._|_[a-z]+\(", pattern), pattern


CALLBACK = textwrap.dedent(
    """
    class Monitor:
        def __init__(self, every):
            self.every = every            # public: a user may read it before fit
            self._reset("none")           # placeholder call: on_train_begin makes it again
            self._count = 0               # placeholder: on_epoch_begin sets it

        def _reset(self, source):
            self._source = source         # read by on_train_begin itself: a decision
            self._count = 0               # placeholder: on_epoch_begin sets it
            self._total = 0               # kept across epochs: a decision

        def on_train_begin(self, logs=None):
            self._reset(self._source)

        def on_epoch_begin(self, epoch, logs=None):
            self._count = 0
            if epoch > 3:
                self._total = 0

        def on_epoch_end(self, epoch, logs=None):
            if self._count:
                logger.info("counted %d", self._count)
            if self._count > self.every:
                logger.info("many")
                self._total += 1
    """
)


def test_marks_are_the_placeholders_and_the_logging_only_branches():
    lines = CALLBACK.splitlines()
    marked = {lines[number - 1].strip() for number in marks.unmutated_lines(CALLBACK)}
    assert marked == {
        'self._reset("none")           # placeholder call: on_train_begin makes it again',
        "self._count = 0               # placeholder: on_epoch_begin sets it",
        "if self._count:",
    }
    # Both `self._count = 0` lines before the epoch are marked, on_epoch_begin's is not.
    numbers = marks.unmutated_lines(CALLBACK)
    assert [lines[n - 1].strip().startswith("self._count = 0") for n in sorted(numbers)].count(True) == 2
    assert lines.index("        self._count = 0") + 1 not in numbers


def test_marks_in_the_library_are_in_the_callbacks_only():
    marked = {
        path.relative_to(ROOT / "mp_callbacks").with_suffix("").as_posix(): marks.unmutated_lines(
            path.read_text()
        )
        for path in LIBRARY
    }
    # The decision modules have no placeholders: every line of theirs is mutated.
    for module in (
        "_scale_state",
        "_gradient_check",
        "backends/tensorflow/skip",
        "backends/tensorflow/gated_update",
        "backends/tensorflow/step",
    ):
        assert not marked[module], module
    # LossScaleMonitor's epoch placeholders in _reset are found.
    source = (ROOT / "mp_callbacks" / "loss_scale_monitor.py").read_text().splitlines()
    texts = {source[n - 1].strip() for n in marked["loss_scale_monitor"]}
    assert "self._epoch_steps = 0" in texts and "self._lowest_scale = math.inf" in texts
