"""Keras's TensorFlow backend: what the backend-neutral modules ask of it
(the hardware advisor's probe, devices and build, so far). The step itself
still lives in `mp_callbacks.model` and its helpers."""
