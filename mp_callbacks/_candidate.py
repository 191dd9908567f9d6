"""One candidate of `autotune`'s proof run: a model trained under one plan,
step by step on request, in a process of its own (or in this one).

The parent starts one `ProcessCandidate` per candidate and asks each in
turn to train a few steps, so that the candidates' timings are interleaved
round by round; each process times its own steps, so the pipe costs
nothing. Every candidate starts from the same initial weights and sees the
same batches in the same order. `python -m mp_callbacks._candidate_worker
REQUEST` is the worker; it reads one JSON command a line and answers one
JSON line.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mp_callbacks._samples import from_entries, sample_count, take

__all__ = ["CandidateSpec", "LocalCandidate", "ProcessCandidate", "build_model", "load_function"]


@dataclass
class CandidateSpec:
    """What a candidate trains: the model (`target`, "module:function" or
    "path/to/file.py:function", called with `args` under `policy`), the
    layers pinned to float32, the initial loss scale, and where the initial
    weights and the data are (.npz files)."""

    name: str
    policy: str
    target: str
    args: list[Any] = field(default_factory=list)
    float32_layers: list[str] = field(default_factory=list)
    initial_scale: float | None = None
    float8_layers: list[str] = field(default_factory=list)
    weights: str = ""
    data: str = ""
    batch_size: int = 32
    seed: int = 0
    sys_path: list[str] = field(default_factory=list)


def load_function(target: str) -> Callable[..., Any]:
    """The function `target` names: "module:function" or "path.py:function"."""
    module_name, _, function = target.rpartition(":")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        path = os.path.abspath(module_name)
        spec = importlib.util.spec_from_file_location(
            "_mp_callbacks_model_" + os.path.splitext(os.path.basename(path))[0], path
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {module_name}")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(os.path.dirname(path))
    else:
        module = importlib.import_module(module_name)
    return getattr(module, function)


def build_model(
    build: Callable[..., Any],
    policy: str,
    args: list[Any],
    float32_layers: list[str],
    initial_scale: float | None,
    float8_layers: Sequence[str] = (),
    weights: list[np.ndarray] | None = None,
) -> Any:
    """`build(*args)` under `policy`, made a `MixedPrecisionModel` when it is
    functional or Sequential (so that float16 gets loss scaling), with the
    pinned layers in float32, the `weights` (the unquantized model's), the
    `float8_layers` (labels: names, or paths where names repeat) then
    quantized to float8 and the initial loss scale,
    compiled (Adam, sparse categorical cross-entropy and accuracy when it
    was not)."""
    from mp_callbacks import LossScaler, MixedPrecisionModel  # this backend's
    from mp_callbacks._backend import keras
    from mp_callbacks._keras_internals import has_layer_graph
    from mp_callbacks._model_building import policy_scope
    from mp_callbacks.precision_plan import pin_float32

    with policy_scope(policy):
        model = build(*args)
        if not isinstance(model, keras.Model):
            raise TypeError(f"the model function returned {type(model).__name__}, not a Keras model")
        if float32_layers:
            pin_float32(model, float32_layers)
        compile_config = None
        if getattr(model, "compiled", False):
            compile_config = keras.saving.deserialize_keras_object(model.get_compile_config())
            optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
            compile_config["optimizer"] = type(optimizer).from_config(optimizer.get_config())
        if not isinstance(model, MixedPrecisionModel) and (has_layer_graph(model)):
            model = MixedPrecisionModel.from_model(model)
        if weights is not None:
            model.set_weights(weights)
        if float8_layers:
            from mp_callbacks.precision_plan import quantize_float8

            quantize_float8(model, float8_layers)
        if compile_config is None:
            compile_config = {
                "optimizer": keras.optimizers.Adam(),
                "loss": "sparse_categorical_crossentropy",
                "metrics": ["accuracy"],
            }
        model.compile(**compile_config)
        if isinstance(model, MixedPrecisionModel) and initial_scale is not None:
            model.set_loss_scale(LossScaler(initial_scale=float(initial_scale)))
    return model


class Trainer:
    """Trains one candidate model step by step on fixed batches."""

    def __init__(
        self, model: Any, data: dict[str, np.ndarray], batch_size: int, weights: list[np.ndarray] | None
    ) -> None:
        from mp_callbacks._backend import keras

        self.model = model
        if weights is not None:
            model.set_weights(weights)
        x, y = from_entries("x_train", data), data["y_train"]

        def tensor(value: Any) -> Any:
            return keras.tree.map_structure(keras.ops.convert_to_tensor, value)

        self.batches = [
            (tensor(take(x, slice(i, i + batch_size))), tensor(y[i : i + batch_size]))
            for i in range(0, sample_count(x) - batch_size + 1, batch_size)
        ] or [(tensor(x), tensor(y))]
        self.validation = (from_entries("x_val", data), data["y_val"])
        self.batch_size = batch_size
        self.position = 0
        self.nonfinite_losses = 0

    def train(self, steps: int) -> dict[str, Any]:
        start = time.perf_counter()
        loss = None
        for _ in range(steps):
            x, y = self.batches[self.position % len(self.batches)]
            self.position += 1
            logs = self.model.train_on_batch(x, y, return_dict=True)
            loss = float(logs.get("loss", np.nan))
            if not np.isfinite(loss):
                self.nonfinite_losses += 1
        return {"seconds": time.perf_counter() - start, "loss": loss}

    def evaluate(self) -> dict[str, Any]:
        x, y = self.validation
        results = self.model.evaluate(x, y, batch_size=self.batch_size, verbose=0, return_dict=True)
        from mp_callbacks._loss_scale_source import LossScaleSource

        loss_scale = LossScaleSource.of(self.model).scaler
        state = loss_scale.diagnostics() if loss_scale is not None else {}
        return {
            "metrics": {k: float(v) for k, v in results.items()},
            "steps": self.position,
            "skipped_steps": int(state.get("skipped_steps", 0)),
            "divergent_steps": int(state.get("divergent_steps", 0)) + self.nonfinite_losses,
            "loss_scale": float(state["scale"]) if "scale" in state else None,
            "weights_finite": all(bool(np.all(np.isfinite(w))) for w in self.model.get_weights()),
        }


def _trainer(spec: CandidateSpec, build: Callable[..., Any] | None = None) -> Trainer:
    from mp_callbacks._backend import keras

    weights = None
    if spec.weights:
        with np.load(spec.weights) as stored:
            weights = [stored[f"arr_{i}"] for i in range(len(stored.files))]
    keras.utils.set_random_seed(spec.seed)
    model = build_model(
        build or load_function(spec.target),
        spec.policy,
        spec.args,
        spec.float32_layers,
        spec.initial_scale,
        spec.float8_layers,
        weights,
    )
    with np.load(spec.data) as data:
        arrays = {k: data[k] for k in data.files}
    return Trainer(model, arrays, spec.batch_size, None)


class LocalCandidate:
    """A candidate trained in this process (for a model function that a
    fresh process cannot import)."""

    def __init__(self, spec: CandidateSpec, build: Callable[..., Any] | None = None) -> None:
        self.spec = spec
        self.trainer = _trainer(spec, build)

    def request(self, command: dict[str, Any]) -> dict[str, Any]:
        if command["cmd"] == "train":
            return self.trainer.train(int(command["steps"]))
        if command["cmd"] == "evaluate":
            return self.trainer.evaluate()
        return {}

    def close(self) -> None:
        pass


class ProcessCandidate:
    """A candidate trained in a fresh Python process of its own."""

    def __init__(self, spec: CandidateSpec) -> None:
        self.spec = spec
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        # A file, not a pipe: a worker that logs much must never block on it.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mp_callbacks._candidate_worker", json.dumps(asdict(spec))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            bufsize=1,
        )

    def request(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it ended, perhaps with an error reply to read
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise RuntimeError(f"the {self.spec.name} run failed: {self._last_error()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the {self.spec.name} run failed: {reply['error']}")
        return reply

    def _last_error(self) -> str:
        """The worker's last error line (not a warning), or its exit code."""
        self.log.seek(0)
        lines = [
            line for line in self.log.read().strip().splitlines() if line.strip() and "Warning" not in line
        ]
        errors = [line for line in lines if "Error" in line or "error" in line]
        code = self.process.returncode
        return (errors or lines or [""])[-1] + f" (exit code {code})"

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


def _worker(argv: list[str]) -> int:
    spec = CandidateSpec(**json.loads(argv[0]))
    sys.path.extend(p for p in spec.sys_path if p not in sys.path)
    # Replies go to the real stdout; anything else printed goes to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr
    try:
        trainer = _trainer(spec)
    except Exception as error:  # reported to the parent, which names the candidate
        replies.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        return 3
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "exit":
            break
        try:
            reply = trainer.train(int(command["steps"])) if command["cmd"] == "train" else trainer.evaluate()
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")
    return 0
