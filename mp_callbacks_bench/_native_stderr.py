"""Keeps TensorFlow's C++ start-up lines off the user's terminal.

TensorFlow writes them to the process's file descriptor 2 from C++ before
absl is initialised, so `TF_CPP_MIN_LOG_LEVEL` does not silence them all
(TensorFlow 2.21 prints the oneDNN and "All log messages before
absl::InitializeLog()" lines at any level). While `filtered()` is active,
descriptor 2 goes to a temporary file and Python's `sys.stderr` to the real
terminal; on exit, every captured line that is not known start-up noise is
written out, so real errors from native code are never lost.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["filtered", "is_startup_noise"]

_NOISE = re.compile(
    r"All log messages before absl::InitializeLog\(\) is called"
    r"|oneDNN custom operations are on"
    r"|cpu_feature_guard\.cc"
    r"|This TensorFlow binary is optimized to use available CPU instructions"
    r"|To enable the following instructions: .*rebuild TensorFlow"
    r"|in other operations, rebuild TensorFlow with the appropriate compiler flags"
    r"|Unable to register cu(DNN|FFT|BLAS) factory"
    r"|computation placer already registered"
    r"|TF-TRT Warning: Could not find TensorRT"
    r"|oneDNN supports DT_HALF only on platforms with AVX-512"
    r"|oneDNN supports DT_BF16 only on platforms with AVX-512"
)


def is_startup_noise(line: str) -> bool:
    """True for TensorFlow's informational start-up lines."""
    return bool(_NOISE.search(line))


@contextlib.contextmanager
def filtered() -> Iterator[None]:
    try:
        real_fd = os.dup(2)
    except OSError:  # no descriptor 2 (embedded interpreters): nothing to do
        yield
        return
    capture = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, after the fd is restored)
    python_stderr = sys.stderr
    try:
        python_uses_fd2 = python_stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):  # captured (pytest) or replaced
        python_uses_fd2 = False
    python_stderr.flush()
    os.dup2(capture.fileno(), 2)
    if python_uses_fd2:  # Python's own messages keep going to the terminal
        sys.stderr = os.fdopen(os.dup(real_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real_fd, 2)
        os.close(real_fd)
        if python_uses_fd2:
            replacement, sys.stderr = sys.stderr, python_stderr
            replacement.close()
        capture.seek(0)
        kept = [
            line
            for line in capture.read().decode("utf-8", "replace").splitlines()
            if line.strip() and not is_startup_noise(line)
        ]
        capture.close()
        for line in kept:
            print(line, file=sys.stderr)
