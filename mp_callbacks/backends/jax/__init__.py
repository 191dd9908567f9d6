"""Keras's JAX backend: `MixedPrecisionModel` as a stateless step."""
