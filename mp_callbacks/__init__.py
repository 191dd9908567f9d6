"""mp_callbacks: safe, visible and measurably fast mixed precision for Keras 3.

Public API:

* `LossScaler`: the loss scale (dynamic, fixed or none) and the skip of
  non-finite steps, usable alone.
* `MixedPrecisionModel`: a `keras.Model` whose `train_step` scales the loss,
  skips non-finite steps and reports `loss_scale`, `grad_norm` and
  `skipped_steps` in the training logs.
* `LossScaleMonitor`, `NaNGradientMonitor`, `EpochTimer`: callbacks for any
  `model.fit`.
* `LossScaleOptimizer`: `get_scaled_loss` / `get_unscaled_gradients` for
  hand-written loops, as in Keras 2.
* `mp_callbacks.tuner` (needs keras-tuner): dtype policy and loss scale as
  hyperparameters.
* `diagnose_batch(model, x, y)`: where, layer by layer, a batch overflows
  (forward and backward), and which layers to keep in float32;
  `with_float32_layers(model, names)` applies that advice;
  `HeadroomMonitor`: each layer's share of its dtype's range, in the logs.
* `recommend_policy()`, `inspect_hardware()`: which dtype policy this
  machine can speed up.
* `autotune(build, x, y)`: a measured `PrecisionPlan` for your model: the
  policy, the layers to keep in float32, the initial loss scale, proven by
  a side-by-side run; `float32_copy(model)` for serving.
"""

from mp_callbacks._backend import BACKEND
from mp_callbacks._backend import package_version as _package_version
from mp_callbacks.errors import (
    BackendNotSupportedError,
    MixedPrecisionWarning,
    NonFiniteGradientError,
    UnsupportedArgumentError,
)

if BACKEND == "tensorflow":
    from mp_callbacks.autotune import autotune
    from mp_callbacks.diagnosis import PrecisionReport, diagnose_batch
    from mp_callbacks.epoch_timer import EpochTimer
    from mp_callbacks.float32_layers import float32_copy, with_float32_layers
    from mp_callbacks.hardware import POLICIES, inspect_hardware, recommend_policy
    from mp_callbacks.headroom_monitor import HeadroomMonitor
    from mp_callbacks.loss_scale import LossScaler
    from mp_callbacks.loss_scale_monitor import LossScaleMonitor
    from mp_callbacks.loss_scale_optimizer import LossScaleOptimizer
    from mp_callbacks.model import LOG_KEYS, MixedPrecisionModel
    from mp_callbacks.model_checks import Finding, check_model
    from mp_callbacks.nan_gradient_monitor import NaNGradientMonitor
    from mp_callbacks.precision_plan import PrecisionPlan
    from mp_callbacks.speed_comparison import SpeedComparison
elif BACKEND == "jax":
    from mp_callbacks.autotune import autotune
    from mp_callbacks.backends.common.loss_scaler import LossScaler  # type: ignore[assignment]
    from mp_callbacks.backends.jax.loss_scale_optimizer import LossScaleOptimizer
    from mp_callbacks.backends.jax.model import LOG_KEYS, MixedPrecisionModel
    from mp_callbacks.diagnosis import PrecisionReport, diagnose_batch
    from mp_callbacks.epoch_timer import EpochTimer
    from mp_callbacks.float32_layers import float32_copy, with_float32_layers
    from mp_callbacks.hardware import POLICIES, inspect_hardware, recommend_policy
    from mp_callbacks.headroom_monitor import HeadroomMonitor
    from mp_callbacks.loss_scale_monitor import LossScaleMonitor
    from mp_callbacks.model_checks import Finding, check_model
    from mp_callbacks.nan_gradient_monitor import NaNGradientMonitor
    from mp_callbacks.precision_plan import PrecisionPlan
    from mp_callbacks.speed_comparison import SpeedComparison
else:  # torch
    from mp_callbacks.autotune import autotune
    from mp_callbacks.backends.common.loss_scaler import LossScaler  # type: ignore[assignment]
    from mp_callbacks.backends.torch.loss_scale_optimizer import LossScaleOptimizer
    from mp_callbacks.backends.torch.model import LOG_KEYS, MixedPrecisionModel
    from mp_callbacks.diagnosis import PrecisionReport, diagnose_batch
    from mp_callbacks.epoch_timer import EpochTimer
    from mp_callbacks.float32_layers import float32_copy, with_float32_layers
    from mp_callbacks.hardware import POLICIES, inspect_hardware, recommend_policy
    from mp_callbacks.headroom_monitor import HeadroomMonitor
    from mp_callbacks.loss_scale_monitor import LossScaleMonitor
    from mp_callbacks.model_checks import Finding, check_model
    from mp_callbacks.nan_gradient_monitor import NaNGradientMonitor
    from mp_callbacks.precision_plan import PrecisionPlan
    from mp_callbacks.speed_comparison import SpeedComparison

__version__ = _package_version()

__all__ = [
    "BACKEND",
    "LOG_KEYS",
    "POLICIES",
    "BackendNotSupportedError",
    "EpochTimer",
    "Finding",
    "HeadroomMonitor",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "LossScaler",
    "MixedPrecisionModel",
    "MixedPrecisionWarning",
    "NaNGradientMonitor",
    "NonFiniteGradientError",
    "PrecisionPlan",
    "PrecisionReport",
    "SpeedComparison",
    "UnsupportedArgumentError",
    "__version__",
    "autotune",
    "check_model",
    "diagnose_batch",
    "float32_copy",
    "inspect_hardware",
    "recommend_policy",
    "with_float32_layers",
]
