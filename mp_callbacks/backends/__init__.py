"""Each Keras backend's own step, apart from the backend-neutral core
(`_scale_state`, `_gradient_check`, `_model_building`).

TensorFlow's step lives in `mp_callbacks.model` and its helpers (gated
writes, `tf.cond`), its hardware answers in `backends/tensorflow`; JAX's
step, optimizer, scale and answers in `backends/jax` (one conditional over
the state). Each backend's `platform.py` answers the same questions.
"""

from mp_callbacks._backend import BACKEND, SUPPORTED_BACKENDS

__all__ = ["BACKEND", "SUPPORTED_BACKENDS"]
