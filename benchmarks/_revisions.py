"""The package as it was at a git revision, importable next to the work tree's.

An A/B of two versions of the library is only fair in one process, on the
same batches, steps interleaved: separate runs differ by more than most
changes are worth here. So each revision's `mp_callbacks/` is copied out of
git under its own package name (`mp_callbacks_<rev>`, every reference to
the package renamed) and imported beside the work tree's.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PACKAGE = "mp_callbacks"
_REPOSITORY = Path(__file__).resolve().parent.parent
_EXPORTS = Path(tempfile.mkdtemp(prefix="mp_callbacks_revisions_"))


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(_REPOSITORY), *args], check=True, capture_output=True).stdout


def package_at(revision: str) -> ModuleType:
    """Imports `mp_callbacks` as of `revision` (anything `git` accepts) and
    returns it; its name is `mp_callbacks_<short hash>`."""
    try:
        commit = _git("rev-parse", "--short", f"{revision}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError as error:
        raise ValueError(f"--revisions: {revision!r} is not a commit of {_REPOSITORY}") from error
    name = f"{PACKAGE}_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    target = _EXPORTS / name
    for path in _git("ls-tree", "-r", "--name-only", commit, f"{PACKAGE}/").decode().split():
        content = _git("show", f"{commit}:{path}")
        if path.endswith(".py"):
            content = re.sub(rb"\bmp_callbacks\b", name.encode(), content)
        destination = target / Path(path).relative_to(PACKAGE)
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_bytes(content)
    if str(_EXPORTS) not in sys.path:
        sys.path.insert(0, str(_EXPORTS))
    return importlib.import_module(name)
