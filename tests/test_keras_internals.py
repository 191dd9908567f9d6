"""The private Keras internals mp_callbacks relies on are all still there:
a Keras release that renames or changes one fails here, not in a user's run."""

from __future__ import annotations

import keras
import pytest

from mp_callbacks import _keras_internals as internals


@pytest.mark.parametrize("internal", internals.INTERNALS, ids=lambda i: i.name)
def test_internal_is_present(internal):
    assert internal.present(), (
        f"{internal.name} changed in keras {keras.__version__}; used by {internal.used_by}"
    )


def test_missing_internals_is_empty():
    assert internals.missing_internals() == []


def test_checked_versions_include_the_declared_lower_bound():
    import configparser
    import pathlib

    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).resolve().parents[1] / "setup.cfg")
    requires = config["options"]["install_requires"]
    lower = next(
        line.split(">=")[1].split(",")[0].strip()
        for line in requires.splitlines()
        if line.strip().startswith("keras>=")
    )
    assert any(version.startswith(lower) for version in internals.CHECKED_ON)
