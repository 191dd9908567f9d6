"""mp_callbacks: safe, visible and measurably fast mixed precision for Keras 3.

Public API:

* `DynamicLossScale`: the loss-scale state machine (usable alone).
* `MixedPrecisionModel`: a `keras.Model` whose `train_step` scales the loss,
  skips non-finite steps and reports `loss_scale`, `grad_norm` and
  `skipped_steps` in the training logs.
"""

from mp_callbacks._backend import package_version as _package_version
from mp_callbacks.hardware import POLICIES, inspect_hardware, recommend_policy
from mp_callbacks.loss_scale import DynamicLossScale
from mp_callbacks.model import LOG_KEYS, MixedPrecisionModel

__version__ = _package_version()

__all__ = [
    "DynamicLossScale",
    "MixedPrecisionModel",
    "LOG_KEYS",
    "POLICIES",
    "inspect_hardware",
    "recommend_policy",
    "__version__",
]
