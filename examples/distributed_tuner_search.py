"""keras-tuner's own distributed search over the dtype policy, on localhost.

keras-tuner runs one search on several processes: a chief that holds the
oracle (it hands out trials over gRPC) and workers that train them. Each
process runs this same file; the environment says which role it has:

    KERASTUNER_TUNER_ID     "chief" for the oracle, any other name for a worker
    KERASTUNER_ORACLE_IP    the chief's address, the same in every process
    KERASTUNER_ORACLE_PORT  the chief's port, the same in every process

Run without those variables, the file starts the chief and two workers on
localhost itself, waits for them (bounded by --timeout) and prints every
trial with its policy, accuracy and epoch time:

    python examples/distributed_tuner_search.py --max-trials 4

On several machines, start it by hand with the variables set, the chief
first, all with the same --directory (a shared file system) and
--max-trials. Offline (built-in data); well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROLE = "KERASTUNER_TUNER_ID"


def build_model(hp):
    import keras

    import mp_callbacks as mp

    inputs = keras.Input((20,))
    hidden = keras.layers.Dense(hp.Choice("units", [8, 16]), activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", dtype="float32")(hidden)
    model = mp.MixedPrecisionModel(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def run_role(args: argparse.Namespace) -> None:
    """Chief or worker: the same search call; keras-tuner reads the role
    from the environment."""
    import keras_tuner as kt
    import numpy as np

    import mp_callbacks as mp
    from mp_callbacks.tuner import MixedPrecisionHyperModel

    rng = np.random.default_rng(0)
    x, y = rng.random((256, 20), dtype="float32"), rng.integers(0, 3, 256)
    hypermodel = MixedPrecisionHyperModel(build_model, policies=["float32", "mixed_bfloat16"])
    # Two policies x two widths: four trials cover every combination.
    tuner = kt.RandomSearch(
        hypermodel,
        max_trials=args.max_trials,
        objective=kt.Objective("val_accuracy", "max"),
        directory=args.directory,
        project_name="distributed",
        seed=0,
    )
    tuner.search(
        x, y, epochs=2, validation_split=0.25, verbose=0, callbacks=[mp.EpochTimer(), mp.LossScaleMonitor()]
    )
    if os.environ[ROLE] == "chief":
        trials = [
            {
                "trial_id": trial.trial_id,
                "status": trial.status,
                "policy": trial.hyperparameters.get("dtype_policy"),
                "units": trial.hyperparameters.get("units"),
                "val_accuracy": trial.metrics.get_last_value("val_accuracy"),
                "epoch_time": trial.metrics.get_last_value("epoch_time"),
            }
            for trial in tuner.oracle.trials.values()
        ]
        with open(os.path.join(args.directory, "trials.json"), "w") as handle:
            json.dump(trials, handle, indent=1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(args: argparse.Namespace) -> int:
    """Starts the chief and the workers on localhost; returns an exit code."""
    directory = args.directory or tempfile.mkdtemp(prefix="distributed_search_")
    common = {"KERASTUNER_ORACLE_IP": "127.0.0.1", "KERASTUNER_ORACLE_PORT": str(free_port())}
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--directory",
        directory,
        "--max-trials",
        str(args.max_trials),
    ]
    roles = ["chief"] + [f"worker{index}" for index in range(args.workers)]
    processes = {}
    for role in roles:
        environment = {**os.environ, **common, ROLE: role, "TF_CPP_MIN_LOG_LEVEL": "2"}
        log = open(os.path.join(directory, f"{role}.log"), "w")  # noqa: SIM115 - closed when the process ends
        processes[role] = (
            subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT),
            log,
        )
    deadline = time.monotonic() + args.timeout
    failed = []
    try:
        for role, (process, _) in processes.items():
            try:
                code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                failed.append(f"{role} ({'timed out' if code is None else f'exit code {code}'})")
    finally:
        for process, log in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    if failed:
        print(f"failed: {', '.join(failed)}; logs in {directory}", file=sys.stderr)
        return 1
    with open(os.path.join(directory, "trials.json")) as handle:
        trials = json.load(handle)
    print(f"{len(trials)} trials on {len(roles) - 1} workers; results in {directory}")
    for trial in sorted(trials, key=lambda t: t["trial_id"]):
        print(
            f"trial {trial['trial_id']}: {trial['status']}, policy {trial['policy']}, "
            f"units {trial['units']}, val_accuracy {trial['val_accuracy']:.3f}, "
            f"epoch_time {trial['epoch_time']:.3f} s"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-trials", type=int, default=4, help="trials in the search (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="workers to start on localhost (default 2)")
    parser.add_argument("--directory", default=None, help="the search's directory, shared by every process")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the launch gives up")
    args = parser.parse_args()
    if args.max_trials < 1 or args.workers < 1 or args.timeout <= 0:
        parser.error(
            f"--max-trials and --workers must be >= 1 and --timeout > 0, got "
            f"{args.max_trials}, {args.workers}, {args.timeout}"
        )
    if os.environ.get(ROLE):
        if not args.directory:
            parser.error(f"--directory is required when {ROLE} is set")
        run_role(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
