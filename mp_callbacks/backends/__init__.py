"""Each Keras backend's own step, apart from the backend-neutral core
(`_scale_state`, `_gradient_check`, `_model_building`).

TensorFlow's step lives in `backends/tensorflow` (`step.py`: check once,
decide once, apply or skip with gated writes or a `tf.cond`, update the
state), beside its hardware answers; the public `MixedPrecisionModel`,
`LossScaler` and `LossScaleOptimizer` on TensorFlow call it. JAX's step,
optimizer, scale and answers are in `backends/jax` (each write gated, or
one conditional over the state). Each backend's `platform.py` answers the
same questions.
"""

from mp_callbacks._backend import BACKEND, SUPPORTED_BACKENDS

__all__ = ["BACKEND", "SUPPORTED_BACKENDS"]
