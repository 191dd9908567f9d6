"""torch.distributed on 2 CPU processes (gloo, localhost): one skip
decision across ranks, with keras-io's DistributedDataParallel recipe, with
each rank's own gradients, and with `MixedPrecisionModel.fit`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import keras
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch backend's tests"),
]

WORKER = Path(__file__).with_name("torch_ddp_worker.py")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(mode: str, tmp_path: Path) -> list[list[dict]]:
    environment = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    outputs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", mode, str(outputs[rank])],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for rank in ranks:
        _, stderr = rank.communicate(timeout=240)
        assert rank.returncode == 0, stderr[-3000:]
    return [json.loads(path.read_text()) for path in outputs]


@pytest.mark.parametrize("mode", ["ddp", "local"])
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(mode, tmp_path):
    first, second = _run(mode, tmp_path)
    for steps in (first, second):
        assert [s["iterations"] for s in steps] == [1, 1, 2]  # the second step skipped
        assert [s["scale"] for s in steps] == [2.0**8, 2.0**7, 2.0**7]
        assert steps[1]["weights"] == steps[0]["weights"]  # nothing written on the skip
    if mode == "ddp":  # DDP's averaged gradients: the ranks stay identical
        assert [s["weights"] for s in first] == [s["weights"] for s in second]


def test_mixed_precision_model_fit_skips_on_every_rank(tmp_path):
    first, second = _run("fit", tmp_path)
    for steps in (first, second):
        assert [s["skipped"] for s in steps] == [0.0, 1.0, 0.0]
        assert [s["iterations"] for s in steps] == [1, 1, 2]
        # Only rank 1's loss was NaN: the loss's flag is reduced with the
        # gradients', so both ranks count it alike and their scales agree.
        assert [s["state"]["nonfinite_loss_steps"] for s in steps] == [0.0, 1.0, 1.0]
    assert [s["state"] for s in first] == [s["state"] for s in second]
