"""The suite's own set-up: the README's test command keeps each
`xdist_group` on one worker."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("test_xdist_groups")


def test_an_xdist_group_reaches_the_scheduler(request):
    # Module-scoped fixtures built once per file (test_cli.py's `bench
    # --quick` run takes minutes) rely on their file's group. On pytest 9.2
    # pytest-xdist 3.8 silently ignores the mark, and each of those
    # fixtures was built on both workers (pytest-dev/pytest-xdist#1386).
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs under the README's test command (-n auto --dist loadgroup)")
    assert request.node.nodeid.endswith("@test_xdist_groups"), request.node.nodeid
