"""The examples whose code uses no TensorFlow run on Keras's JAX backend as
written, and print what they promise there too: the TensorFlow suite's own
checks, run here with KERAS_BACKEND=jax (inherited by each subprocess).
The two examples written with TensorFlow's tape are TensorFlow's."""

from __future__ import annotations

import keras
import pytest
from test_examples import (  # noqa: F401 - collected here, run on JAX
    test_autotune_example_pins_each_policys_trap_and_only_it,
    test_find_the_overflow_example_names_the_layer_and_trains_after_the_fix,
    test_float8_transformer_example_names_the_saturating_layer_and_the_fix_clears_it,
    test_mnist_example_reproduces_the_seed_offline,
    test_mnist_example_under_mixed_float16_uses_dynamic_scaling,
    test_tuner_search_example,
)

pytestmark = pytest.mark.skipif(
    keras.backend.backend() not in ("jax", "torch"), reason="the JAX and torch backends' tests"
)


def test_the_examples_left_out_are_the_ones_written_with_tensorflow():
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    with_tensorflow = {p.name for p in examples.glob("*.py") if "import tensorflow" in p.read_text()}
    assert with_tensorflow == {"custom_train_step.py", "custom_training_loop.py"}
