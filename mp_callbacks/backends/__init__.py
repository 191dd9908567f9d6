"""Each Keras backend's own step, apart from the backend-neutral core
(`_scale_state`, `_gradient_check`, `_model_building`).

TensorFlow's step lives in `mp_callbacks.model` and its helpers (gated
writes, `tf.cond`); JAX's in `mp_callbacks.backends.jax` (one select per
state leaf).
"""

from mp_callbacks._backend import BACKEND, SUPPORTED_BACKENDS

__all__ = ["BACKEND", "SUPPORTED_BACKENDS"]
