"""`autotune`: the fastest dtype policy for your model, the few layers that
must stay float32 under it, and a measured run that proves the plan.

For each mixed policy the candidates allow, `select_float32_layers` finds
on your own batches the minimal set of layers that must compute in float32
(and, for float16, an initial loss scale from the measured gradients).
Then every candidate plan and float32 train side by side, from the same
initial weights on the same batches in the same order, each in a process of
its own: a few steps each in turn, round after round, until the paired
step-time ratios separate (`SpeedComparison`) or the budget is spent. The
plan is the fastest candidate that is clearly faster than float32, never
diverged and ends within `tolerance` of float32's validation metric;
otherwise float32, with the reasons. Every candidate's evidence is kept in
the plan.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mp_callbacks._backend import keras
from mp_callbacks._candidate import (
    CandidateSpec,
    LocalCandidate,
    ProcessCandidate,
    build_model,
    load_function,
)
from mp_callbacks._float8_candidates import FLOAT8_MAX_ERROR, FLOAT8_MAX_SATURATION, float8_layer_verdicts
from mp_callbacks._keras_internals import all_layers
from mp_callbacks._samples import as_samples, sample_count, shapes, take, to_entries
from mp_callbacks._validation import check_int, check_real, fail
from mp_callbacks.hardware import POLICIES, inspect_hardware
from mp_callbacks.layer_selection import select_float32_layers
from mp_callbacks.precision_plan import PrecisionPlan
from mp_callbacks.speed_comparison import SpeedComparison

__all__ = ["autotune", "choose_plan"]

logger = logging.getLogger(__name__)

_OWNER = "autotune"
_DIAGNOSIS_BATCHES = 3
_DIAGNOSIS_BATCH_SIZE = 32
_MIN_ROUNDS = 5
_WARMUP_STEPS = 2


def _importable_target(build: Callable[..., Any]) -> str | None:
    """ "module:function" (or "script.py:function" for a script's own
    function) when a fresh process can import `build` itself."""
    module, qualname = getattr(build, "__module__", None), getattr(build, "__qualname__", "")
    if not module or "." in qualname or "<" in qualname:
        return None
    if module == "__main__":
        script = getattr(sys.modules["__main__"], "__file__", None)
        if not script or getattr(sys.modules["__main__"], qualname, None) is not build:
            return None
        return f"{os.path.abspath(script)}:{qualname}"  # imported there without running main
    try:
        return f"{module}:{qualname}" if load_function(f"{module}:{qualname}") is build else None
    except Exception:
        return None


def _model_cloner(model: keras.Model) -> Callable[[], keras.Model]:
    """A build function for a model instance: a copy, with the same weights,
    whose layers take the policy in force when it is called; layers the
    model gave a policy of their own other than its own (a float32 head)
    keep it."""
    own = model.dtype_policy.name
    config = model.get_config()
    weights = model.get_weights()

    def clone() -> keras.Model:
        import copy

        layer_configs = copy.deepcopy(config)
        current = keras.dtype_policies.serialize(keras.config.dtype_policy())
        for layer_config in layer_configs.get("layers", []):
            dtype = layer_config.get("config", {}).get("dtype")
            name = dtype.get("config", {}).get("name") if isinstance(dtype, dict) else dtype
            if name is None or name == own:
                layer_config["config"]["dtype"] = current
        copy_ = type(model).from_config(layer_configs)
        copy_.set_weights(weights)
        if getattr(model, "compiled", False):
            compile_config = keras.saving.deserialize_keras_object(model.get_compile_config())
            optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
            compile_config["optimizer"] = type(optimizer).from_config(optimizer.get_config())
            copy_.compile(**compile_config)
        return copy_

    return clone


def _metric_of(metrics: dict[str, float]) -> tuple[str, bool]:
    """The validation figure to compare, and whether higher is better."""
    for name in metrics:
        if "accuracy" in name:
            return name, True
    return "loss", False


def choose_plan(candidates: list[dict[str, Any]], tolerance: float, forced: bool) -> tuple[str, list[str]]:
    """Decides from the evidence: the chosen policy and the reasons.

    Args:
        candidates: one dict per candidate, float32 first (always measured,
            as the reference), with `policy`, `ratios` (float32 step time /
            this one's, one per paired round), `metrics` (validation),
            `divergent_steps`, `weights_finite` and `listed` (a candidate,
            not only the reference). Each gets `verdict`, `speedup`,
            `speedup_range` and `speed` (faster, slower or tie) set.
        tolerance: how far below float32's validation metric a plan may end.
        forced: the candidates were listed: choose among them whatever the
            speed, and report the speed beside.

    Returns:
        (policy, reasons).
    """
    reference = candidates[0]
    metric_name, higher_is_better = _metric_of(reference.get("metrics") or {})
    reference_metric = (reference.get("metrics") or {}).get(metric_name)
    reasons: list[str] = []
    passing = []
    for candidate in candidates:
        metrics = candidate.get("metrics") or {}
        candidate["metric_name"] = metric_name
        candidate["metric"] = metrics.get(metric_name)
        if candidate is reference:
            candidate.update(speedup=1.0, speedup_range=None, speed="baseline")
        else:
            comparison = SpeedComparison(candidate.get("ratios", []))
            candidate.update(
                speedup=comparison.median,
                speedup_range=comparison.quartiles,
                speed=comparison.verdict,
                speed_text=comparison.describe(),
            )
        if not candidate.get("listed", True):
            candidate["verdict"] = "reference"
            continue
        problems = []
        if candidate.get("divergent_steps", 0) or not candidate.get("weights_finite", True):
            problems.append("diverged")
        metric = candidate["metric"]
        if candidate is not reference and metric is not None and reference_metric is not None:
            shortfall = (
                (reference_metric - metric)
                if higher_is_better
                else ((metric - reference_metric) / max(abs(reference_metric), 1e-12))
            )
            if shortfall > tolerance:
                problems.append(
                    f"validation {metric_name} {metric:.4g} against float32's "
                    f"{reference_metric:.4g}, beyond the tolerance {tolerance:g}"
                )
        if candidate is not reference and not forced and candidate["speed"] != "faster":
            problems.append(
                f"not clearly faster than float32: {candidate['speed_text']} "
                f"({'slower' if candidate['speed'] == 'slower' else 'a tie'})"
            )
        candidate["verdict"] = "; ".join(problems) if problems else "passes"
        if not problems:
            passing.append(candidate)
    if forced:
        chosen = max(passing, key=lambda c: c.get("speedup") or 0.0) if passing else None
        if chosen is None:
            listed = [c for c in candidates if c.get("listed", True)]
            chosen = listed[0]
            reasons.append(
                f"no listed candidate passed the proof; {chosen['policy']} is the "
                "first listed: " + "; ".join(f"{c['policy']}: {c['verdict']}" for c in listed)
            )
    else:
        faster = [c for c in passing if c is not reference]
        chosen = max(faster, key=lambda c: c["speedup"]) if faster else reference
        if chosen is reference:
            objections = [f"{c['policy']}: {c['verdict']}" for c in candidates[1:] if c.get("listed", True)]
            reasons.append(
                "float32: "
                + ("; ".join(objections) if objections else "no mixed policy to try on this machine")
                + "."
            )
    for candidate in candidates:
        if candidate is chosen:
            candidate["verdict"] = "chosen"
    if chosen is reference and not reasons:  # listed, and the fastest that passed
        others = [f"{c['policy']}: {c['verdict']}" for c in candidates[1:] if c.get("listed", True)]
        reasons.append(
            "float32: the fastest listed candidate that passed the proof"
            + (f" ({'; '.join(others)})" if others else "")
            + "."
        )
    if chosen is not reference:
        text = f"{chosen['policy']}: {chosen.get('speed_text', '')} float32's speed"
        if chosen.get("metric") is not None and reference_metric is not None:
            text += (
                f"; validation {metric_name} {chosen['metric']:.4g} against float32's {reference_metric:.4g}"
            )
        text += f"; {chosen.get('skipped_steps', 0)} skipped steps, no divergence."
        reasons.append(text)
    return chosen["policy"], reasons


def autotune(
    build: Callable[..., keras.Model] | keras.Model | str,
    x: Any,
    y: Any = None,
    *,
    validation_data: tuple[Any, Any] | None = None,
    policies: Sequence[str] | None = None,
    steps: int | None = None,
    time_budget: float | None = None,
    tolerance: float = 0.01,
    batch_size: int | None = None,
    build_args: Sequence[Any] = (),
    hardware: Any = None,
    in_subprocess: bool | None = None,
    seed: int = 0,
) -> PrecisionPlan:
    """Finds, on your model and data and this machine, the dtype policy to
    train under and the layers that must stay float32, and proves it.

    Args:
        build: a function of no arguments (or of `build_args`) returning a
            Keras model, compiled or not (an uncompiled one gets Adam,
            sparse categorical cross-entropy and accuracy), called after the
            candidate's dtype policy is set; "module:function" or
            "path/to/file.py:function" naming one; or a model instance,
            which is copied under each policy (its layers with a policy of
            their own, such as a float32 head, keep it).
        x: training inputs, as `fit` takes them: a NumPy array, or named
            inputs (a dict of arrays, as KerasHub's text models take), or a
            list of arrays; batches for the layer diagnosis and for the
            proof run.
        y: training targets (a NumPy array). Defaults to None.
        validation_data: `(x_val, y_val)` for the proof's validation metric.
            Defaults to None: the last fifth of `x`, `y`.
        policies: the candidates. Defaults to None: float32 and every mixed
            policy the hardware probe does not measure as emulated here, and
            the plan is the best of them. A list forces the candidates: the
            plan is the best of those (float32 only if listed) whatever
            their speed here (preparing a GPU run on a laptop); float32 is
            timed beside them for the report. `"float8"` in the list (tried
            by default where every GPU has float8 units) makes float8 a
            per-layer candidate within each mixed policy: a `Dense` or
            `EinsumDense` layer is quantized (`quantize("float8")`) only
            where, measured on its own, it is clearly faster in float8 on
            this device, its output differs from the unquantized layer's
            by at most 5 % (relative error) and at most 5 % of its
            inputs or kernel saturate;
            the side-by-side proof then includes those layers. The plan's
            reasons give each layer's measured figures.
        steps: the most training steps of the proof, per candidate.
            Defaults to None: 200 (or two epochs of `x`, if fewer).
        time_budget: seconds the proof may take at most, after its first
            five rounds. Defaults to None (no limit).
        tolerance: how far below float32's validation metric a plan may
            end: points of accuracy (0.01 is one point), or a relative
            increase of the validation loss for a model without accuracy.
            Defaults to 0.01.
        batch_size: the batch size of the proof run. Defaults to None (32).
        build_args: positional arguments for `build`. Defaults to none.
        hardware: a `HardwareReport` (`mp.inspect_hardware()`), to decide
            the candidates from; defaults to None (measured now).
        in_subprocess: train each candidate in a fresh process (True) or in
            this one. Defaults to None: a fresh process when `build` can be
            imported there.
        seed: the random seed of the initial weights. Defaults to 0.

    Returns:
        A `PrecisionPlan`; `print(plan)` shows the evidence and the code.

    Raises:
        ValueError, TypeError: a bad argument, named; a model that does not
            take the data, before any training.

    Ctrl-C during the proof stops it and returns what was measured so far
    (`plan.interrupted`).
    """
    started = time.monotonic()
    tolerance = check_real(_OWNER, "tolerance", tolerance, low=0.0, high=1.0, low_inclusive=False)
    if steps is not None:
        steps = check_int(_OWNER, "steps", steps, low=_MIN_ROUNDS)
    if time_budget is not None:
        time_budget = check_real(_OWNER, "time_budget", time_budget, low=0.0, low_inclusive=False)
    batch_size = check_int(_OWNER, "batch_size", batch_size, low=1) if batch_size is not None else 32
    seed = check_int(_OWNER, "seed", seed, low=0)
    forced = policies is not None
    _check_policies(policies)
    try_float8 = "float8" in (policies or ())
    target, build_function = _resolve_build(build)
    if in_subprocess is None:
        in_subprocess = target is not None
    if in_subprocess and target is None:
        fail(
            _OWNER,
            "build",
            build,
            "importable in a fresh process for in_subprocess=True "
            "(a function at the top of a module, 'module:function' or 'file.py:function')",
        )
    x_train, y_train, x_val, y_val = _split(x, y, validation_data)
    if sample_count(x_train) < batch_size:
        fail(
            _OWNER,
            "x",
            f"{sample_count(x_train)} training samples",
            f"at least batch_size ({batch_size}) samples",
        )
    weights = _reference_weights(build_function, list(build_args), seed, x_train, y_train)

    if hardware is None:
        hardware = inspect_hardware(measure=not forced)
    try_float8 = try_float8 or (policies is None and hardware.float8_units)
    candidate_policies, notes = _candidate_policies(
        None if policies is None else [p for p in policies if p != "float8"], hardware
    )
    n_diagnosis = min(_DIAGNOSIS_BATCH_SIZE, batch_size)
    diagnosis_batches = [
        (take(x_train, slice(i, i + n_diagnosis)), y_train[i : i + n_diagnosis])
        for i in range(0, min(sample_count(x_train), _DIAGNOSIS_BATCHES * n_diagnosis), n_diagnosis)
    ]
    dropped: list[dict[str, Any]] = []  # candidates that could not run, and why
    evidence: list[dict[str, Any]] = [
        {
            "policy": "float32",
            "listed": "float32" in candidate_policies,
            "float32_layers": [],
            "reasons": {},
            "initial_scale": None,
        }
    ]
    for policy in candidate_policies:
        if policy == "float32":
            continue
        try:
            evidence.append(
                _layer_evidence(
                    policy, build_function, list(build_args), weights, diagnosis_batches, seed, try_float8
                )
            )
        except Exception as error:  # one candidate that cannot run is dropped, not the call
            dropped.append(_dropped(policy, "finding its float32 layers", error))

    interrupted = _prove(
        evidence,
        build_function,
        target,
        list(build_args),
        weights,
        (x_train, y_train, x_val, y_val),
        batch_size,
        seed,
        steps,
        time_budget,
        in_subprocess,
        started,
        dropped,
    )
    plan = _plan_from(evidence, dropped, notes, interrupted, tolerance, forced, candidate_policies, hardware)
    logger.info("autotune: plan %s in %.0f s", plan.policy, time.monotonic() - started)
    return plan


def _check_policies(policies: Sequence[str] | None) -> None:
    if policies is None:
        return
    allowed = ", ".join((*POLICIES, "float8"))
    if isinstance(policies, str) or not list(policies):
        fail(_OWNER, "policies", policies, f"None or a non-empty list from {allowed}")
    unknown = [p for p in policies if p not in (*POLICIES, "float8")]
    if unknown:
        fail(_OWNER, "policies", list(policies), f"policies from {allowed}")
    if "float8" in policies and not any(p.startswith("mixed_") for p in policies):
        fail(
            _OWNER,
            "policies",
            list(policies),
            "a list with a mixed policy beside 'float8' (float8 is a per-layer candidate "
            "within a mixed policy: add 'mixed_bfloat16' or 'mixed_float16')",
        )


def _reference_weights(
    build_function: Callable, build_args: list, seed: int, x_train: Any, y_train: Any
) -> list:
    """The float32 model's initial weights, which every candidate starts
    from; a model that does not take the data fails here, before training."""
    keras.utils.set_random_seed(seed)
    reference_model = build_model(build_function, "float32", build_args, [], None)
    try:
        reference_model.evaluate(take(x_train, slice(None, 2)), y_train[:2], verbose=0)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(
            f"{_OWNER}: the model does not train on the data (x of shape "
            f"{shapes(x_train)}, y of shape {np.shape(y_train)}): {type(error).__name__}: "
            f"{first}"
        ) from error
    return reference_model.get_weights()


def _candidate_policies(policies: Sequence[str] | None, hardware: Any) -> tuple[list[str], list[str]]:
    """The policies to try, and notes on those left out: the listed ones,
    or float32 and every mixed policy not measured as emulated here."""
    if policies is not None:
        return list(dict.fromkeys(policies)), []
    slow = hardware.slow_policies()
    notes = [f"not a candidate: {p} ({why})" for p, why in slow.items()]
    for note in notes:
        logger.info("autotune: %s", note)
    return ["float32"] + [p for p in POLICIES if p != "float32" and p not in slow], notes


def _layer_evidence(
    policy: str,
    build_function: Callable,
    build_args: list,
    weights: list,
    batches: list,
    seed: int,
    try_float8: bool = False,
) -> dict[str, Any]:
    """One candidate's layers to keep in float32, found on `batches`, and
    with `try_float8` those to quantize to float8 (`_float8_candidates`)."""
    began = time.monotonic()
    keras.utils.set_random_seed(seed)
    model = build_model(build_function, policy, build_args, [], None)
    model.set_weights(weights)
    selection = select_float32_layers(model, batches)
    layer_dtypes = _layer_dtypes(model, policy, selection.layers)
    logger.info(
        "autotune: %s: %s [%.1f s]",
        policy,
        (
            f"{len(selection.layers)} layer(s) to compute in float32: "
            + "; ".join(f"{n} ({why})" for n, why in selection.reasons.items())
            if selection.layers
            else "no layer needs float32"
        ),
        time.monotonic() - began,
    )
    float8: dict[str, dict[str, Any]] = {}
    if try_float8:
        float8 = {
            label: entry
            for label, entry in float8_layer_verdicts(model, batches[0][0], policy).items()
            if label not in selection.layers
        }
        logger.info(
            "autotune: %s: float8: %s",
            policy,
            "; ".join(f"{label} {entry['verdict']}" for label, entry in float8.items())
            or "no layer to quantize",
        )
    return {
        "policy": policy,
        "listed": True,
        "float32_layers": selection.layers,
        "float8": float8,
        "float8_layers": [label for label, entry in float8.items() if entry["verdict"] == "passes"],
        "reasons": selection.reasons,
        "dropped": selection.dropped,
        "initial_scale": selection.initial_scale,
        "layer_dtypes": layer_dtypes,
        "notes": selection.notes,
        "selection_seconds": time.monotonic() - began,
    }


def _plan_from(
    evidence: list[dict[str, Any]],
    dropped: list[dict[str, Any]],
    notes: list[str],
    interrupted: bool,
    tolerance: float,
    forced: bool,
    candidate_policies: list[str],
    hardware: Any,
) -> PrecisionPlan:
    """The plan the proven evidence supports (float32 if interrupted)."""
    for candidate in dropped:
        logger.warning("autotune: %s dropped: %s", candidate["policy"], candidate["error"])
        notes.append(f"dropped: {candidate['policy']} ({candidate['error']})")
    if interrupted:
        for candidate in evidence:
            candidate.setdefault("metrics", None)
        policy, reasons = (
            "float32",
            [
                "interrupted before the proof finished: float32, since no "
                "plan was proven (the speeds measured so far are below)."
            ],
        )
        choose_plan(evidence, tolerance, forced)
        for candidate in evidence:
            candidate["verdict"] = "interrupted"
    else:
        policy, reasons = choose_plan(evidence, tolerance, forced)
    chosen = next(c for c in evidence if c["policy"] == policy)
    device = hardware.device_summary() if hardware is not None else ""
    if forced and "float32" not in candidate_policies and policy != "float32":
        reasons.append(
            f"speed against float32, measured on {device}: {chosen.get('speed_text', 'n/a')} "
            "(the candidates were listed, so it does not override the choice)."
        )
    reasons += _float8_reasons(chosen)
    reasons += notes
    return PrecisionPlan(
        policy=policy,
        float32_layers=list(chosen.get("float32_layers", [])),
        initial_scale=chosen.get("initial_scale") if policy == "mixed_float16" else None,
        layer_dtypes=dict(chosen.get("layer_dtypes", {})),
        reasons=reasons,
        candidates=[_public(c) for c in evidence + dropped],
        measured_on=device,
        interrupted=interrupted,
        float8_layers=list(chosen.get("float8_layers", [])) if not interrupted else [],
    )


def _float8_reasons(chosen: dict[str, Any]) -> list[str]:
    """One sentence on the float8 layers of the chosen policy: those it
    quantizes, and each one left out with its measured figures."""
    measured = chosen.get("float8") or {}
    if not measured:
        return []
    kept = chosen.get("float8_layers", [])
    left = [
        f"{label} ({entry['verdict']}; error {entry['error']:.1%})"
        for label, entry in measured.items()
        if label not in kept
    ]
    sentence = (
        f"float8 (thresholds: faster, error <= {FLOAT8_MAX_ERROR:.0%}, saturation <= "
        f"{FLOAT8_MAX_SATURATION:.0%}): "
        + (f"quantized {', '.join(kept)}" if kept else "no layer quantized")
        + (f"; left out: {'; '.join(left)}" if left else "")
        + "."
    )
    return [sentence]


def _resolve_build(build: Any) -> tuple[str | None, Callable[..., Any]]:
    if isinstance(build, str):
        if ":" not in build:
            fail(_OWNER, "build", build, "'module:function' or 'path/to/file.py:function'")
        try:
            return build, load_function(build)
        except Exception as error:
            raise ValueError(
                f"{_OWNER}: cannot import build={build!r}: {type(error).__name__}: {error}"
            ) from error
    if isinstance(build, keras.Model):
        return None, _model_cloner(build)
    if not callable(build):
        fail(
            _OWNER,
            "build",
            build,
            "a function returning a Keras model, 'module:function', or a model",
            TypeError,
        )
    return _importable_target(build), build


def _split(x: Any, y: Any, validation_data: Any) -> tuple[Any, ...]:
    """x and y for training and for validation; x may be named inputs (a
    dict of arrays, as KerasHub's text models take) or a list of arrays."""
    if y is None:
        fail(_OWNER, "y", y, "the training targets (NumPy arrays)")
    x, y = as_samples(_OWNER, "x", x), np.asarray(y)
    if sample_count(x) != len(y):
        fail(_OWNER, "y", f"{len(y)} samples", f"as many samples as x ({sample_count(x)})")
    if validation_data is not None:
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
            fail(
                _OWNER, "validation_data", type(validation_data).__name__, "an (x_val, y_val) pair", TypeError
            )
        return x, y, as_samples(_OWNER, "validation_data", validation_data[0]), np.asarray(validation_data[1])
    cut = max(1, sample_count(x) // 5)
    return take(x, slice(None, -cut)), y[:-cut], take(x, slice(-cut, None)), y[-cut:]


def _layer_dtypes(model: keras.Model, policy: str, pinned: list[str]) -> dict[str, str]:
    """Layer path -> policy name, for the layers whose policy is not
    `policy` in the measured model: its own float32 layers and the pinned."""
    dtypes = {}
    for layer in all_layers(model, recursive=False):
        name = getattr(layer.dtype_policy, "name", policy)
        if layer.name in pinned:
            name = "float32"
        if name != policy and not isinstance(layer, keras.layers.InputLayer):
            dtypes[layer.path] = name
    return dtypes


def _dropped(policy: str, stage: str, error: BaseException) -> dict[str, Any]:
    """The evidence of a candidate that could not run: its policy, and why."""
    first = (str(error).strip().splitlines() or [""])[0]
    return {
        "policy": policy,
        "listed": True,
        "float32_layers": [],
        "verdict": "dropped",
        "error": f"{stage} failed: {type(error).__name__}: {first}",
    }


def _public(candidate: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "policy",
        "error",
        "listed",
        "float32_layers",
        "reasons",
        "dropped",
        "initial_scale",
        "step_time",
        "speedup",
        "speedup_range",
        "speed",
        "ratios",
        "metric_name",
        "metric",
        "metrics",
        "skipped_steps",
        "divergent_steps",
        "steps",
        "verdict",
        "notes",
        "selection_seconds",
        "float8",
        "float8_layers",
    )
    return {k: candidate[k] for k in keep if k in candidate}


def _prove(
    evidence: list[dict[str, Any]],
    build: Callable[..., Any],
    target: str | None,
    build_args: list[Any],
    weights: list[np.ndarray],
    data: tuple[np.ndarray, ...],
    batch_size: int,
    seed: int,
    steps: int | None,
    time_budget: float | None,
    in_subprocess: bool,
    started: float,
    dropped: list[dict[str, Any]],
) -> bool:
    """Trains every candidate side by side and adds the timings and the
    validation results to `evidence`; a mixed candidate that fails to
    train moves from `evidence` to `dropped`. Returns True if interrupted."""
    x_train, y_train, x_val, y_val = data
    per_epoch = max(1, sample_count(x_train) // batch_size)
    steps = steps or max(_MIN_ROUNDS, min(200, 2 * per_epoch))
    chunk = max(1, min(20, steps // 10))
    max_rounds = max(_MIN_ROUNDS, steps // chunk)
    workers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as directory:
        data_path = os.path.join(directory, "data.npz")
        weights_path = os.path.join(directory, "weights.npz")
        arrays: dict[str, Any] = {
            **to_entries("x_train", x_train),
            "y_train": y_train,
            **to_entries("x_val", x_val),
            "y_val": y_val,
        }
        np.savez(data_path, **arrays)
        np.savez(weights_path, *weights)  # arr_0, arr_1, ... in order
        try:
            for candidate in evidence:
                spec = CandidateSpec(
                    name=candidate["policy"],
                    policy=candidate["policy"],
                    target=target or "",
                    args=build_args,
                    float32_layers=candidate["float32_layers"],
                    initial_scale=candidate["initial_scale"],
                    float8_layers=candidate.get("float8_layers", []),
                    weights=weights_path,
                    data=data_path,
                    batch_size=batch_size,
                    seed=seed,
                    sys_path=[p for p in sys.path if p],
                )
                workers[candidate["policy"]] = (
                    ProcessCandidate(spec) if in_subprocess else LocalCandidate(spec, build)
                )
            for candidate in list(evidence):  # tracing and compiling, not timed
                try:
                    workers[candidate["policy"]].request({"cmd": "train", "steps": _WARMUP_STEPS})
                except Exception as error:
                    if candidate["policy"] == "float32":
                        raise  # the reference itself: nothing to compare with
                    dropped.append(_dropped(candidate["policy"], "training", error))
                    evidence.remove(candidate)
                    workers.pop(candidate["policy"]).close()
            return _rounds(evidence, workers, chunk, max_rounds, time_budget, started)
        finally:
            for worker in workers.values():
                worker.close()


def _rounds(
    evidence: list[dict[str, Any]],
    workers: dict[str, Any],
    chunk: int,
    max_rounds: int,
    time_budget: float | None,
    started: float,
) -> bool:
    times: dict[str, list[float]] = {c["policy"]: [] for c in evidence}
    proof_started = time.monotonic()
    interrupted = False
    try:
        for round_index in range(max_rounds):
            # Rotate the order, so that no candidate always runs first.
            shift = round_index % len(evidence)
            for candidate in evidence[shift:] + evidence[:shift]:
                reply = workers[candidate["policy"]].request({"cmd": "train", "steps": chunk})
                times[candidate["policy"]].append(reply["seconds"] / chunk)
            comparisons = {
                c["policy"]: SpeedComparison([f / t for f, t in zip(times["float32"], times[c["policy"]])])
                for c in evidence[1:]
            }
            elapsed = time.monotonic() - proof_started
            left = elapsed / (round_index + 1) * (max_rounds - round_index - 1)
            logger.info(
                "autotune: round %d/%d: %s; at most %.0f s left",
                round_index + 1,
                max_rounds,
                ", ".join(f"{p} {c.describe()}" for p, c in comparisons.items()) or "float32",
                left,
            )
            if round_index + 1 >= _MIN_ROUNDS:
                if all(c.decided for c in comparisons.values()):
                    break
                if time_budget is not None and time.monotonic() - started > time_budget:
                    break
    except KeyboardInterrupt:
        interrupted = True
    for candidate in evidence:
        measured = times[candidate["policy"]]
        candidate["step_time"] = float(np.median(measured)) if measured else None
        n = min(len(measured), len(times["float32"]))
        candidate["ratios"] = [f / t for f, t in zip(times["float32"][:n], measured[:n])]
    if interrupted:
        return True
    for candidate in evidence:
        result = workers[candidate["policy"]].request({"cmd": "evaluate"})
        candidate.update(
            metrics=result["metrics"],
            steps=result["steps"],
            skipped_steps=result["skipped_steps"],
            divergent_steps=result["divergent_steps"],
            weights_finite=result["weights_finite"],
        )
    return False
