"""Keras's PyTorch backend: `MixedPrecisionModel` as a stateful step with
deferred writes and one host decision."""
