"""The scale's state after a step the host knows was applied: computed on
the host from the values the step's one read brought back, written in
place where it changes.

Torch's step reads its decision on the host (`step.LossScaling.check`),
and a healthy step is nearly every step. Its transition is the general
one (`_scale_state.transition`, some eighty scalar ops, then a copy per
variable) with `applied` known to be true; on the host, with the few
values it needs read in the same read as the decision, it leaves two
in-place calls on most steps (every counter in one, the epoch's norm sum),
a few more where the scale grows or the loss diverged. Each scalar op a
step adds costs it 2-30 microseconds (the last ones far more than the
first: measured on a small Transformer, 2026-12-04, Intel Xeon, 2
threads). A test holds this equal to the general transition, bit for bit,
on any state.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mp_callbacks._keras_internals import add_in_place
from mp_callbacks._scale_state import ScaleSettings

__all__ = ["READ_WITH_THE_DECISION", "update_after_applied_step"]

#: The state an applied step's update needs, read with the decision (as
#: float64: exact for float32 values and for counters below 2**53).
READ_WITH_THE_DECISION = ("scale", "good_steps", "lowest_scale", "divergent_run")
#: The epoch figures the logs need, read alike where there are logs.
EPOCH_READ = ("epoch_norm_sum", "epoch_applied", "epoch_skipped")

_f32 = np.float32


def update_after_applied_step(
    settings: ScaleSettings,
    values: dict[str, torch.Tensor],
    read: dict[str, float],
    loss_diverged: bool,
    global_norm: torch.Tensor,
    batch_size: int | None = None,
) -> dict[str, float]:
    """Writes, in place, what `_scale_state.transition` (and, given a
    `batch_size`, `backends/common/step.finished_state`'s epoch figures)
    writes after a step whose every gradient was finite. `values` holds the
    variables' tensors by name, `read` the host's reading of those in
    `READ_WITH_THE_DECISION` (and `EPOCH_READ`) and of the "global_norm";
    `loss_diverged`, of the loss's flag. Returns the logs' `loss_scale`,
    `grad_norm` and `skipped_steps` as numbers where the epoch figures are
    given (float32 arithmetic, as the tensors'), else the new scale."""
    scale = _f32(read["scale"])
    # A scale written by hand that is not a positive finite number restarts.
    valid = math.isfinite(scale) and scale > 0
    usable = scale if valid else _f32(settings.initial_scale)
    good = int(read["good_steps"]) + 1
    grow = good >= settings.growth_interval
    new_scale = usable
    if grow:
        with np.errstate(over="ignore"):  # an inf product is capped, as in float32 tensors
            new_scale = min(usable * _f32(settings.growth_factor), _f32(settings.max_scale))
    if not valid or new_scale != scale:
        values["scale"].fill_(float(new_scale))
    # The increments go in one call: each in-place op is a dispatch.
    counted, by = [values["step_count"]], [1]  # ints for the int64 counters
    if grow:
        values["good_steps"].zero_()
        values["hysteresis_left"].fill_(settings.hysteresis)
    else:
        counted.append(values["good_steps"])
        by.append(1)
    run = int(read["divergent_run"])
    # Applied: divergent only where the loss itself was not finite.
    if loss_diverged:
        counted += [values["nonfinite_loss_steps"], values["divergent_steps"]]
        by += [1, 1]
        values["divergent_run"].fill_(run + 1)
        values["max_divergent_run"].clamp_(min=run + 1)
    elif run != 0:
        values["divergent_run"].zero_()  # the longest run stays: it is at least 0
    lowest = _f32(read["lowest_scale"])
    if new_scale < lowest:  # (a NaN lowest stays NaN, as torch.minimum keeps it)
        values["lowest_scale"].fill_(float(new_scale))
    if batch_size is None:
        add_in_place(counted, by)
        return {"loss_scale": float(new_scale)}
    values["epoch_norm_sum"].add_(global_norm)
    add_in_place(counted + [values["epoch_applied"], values["epoch_samples"]], by + [1.0, float(batch_size)])
    norm_sum = _f32(read["epoch_norm_sum"]) + _f32(read["global_norm"])
    applied = _f32(read["epoch_applied"]) + _f32(1.0)
    return {
        "loss_scale": float(new_scale),
        # At least one applied step this epoch: the mean of their norms.
        "grad_norm": float(norm_sum / applied),
        "skipped_steps": float(_f32(read["epoch_skipped"])),
    }
