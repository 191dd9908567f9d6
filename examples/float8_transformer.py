"""A small Transformer with float8 layers: find the layer that saturates, fix it.

A one-block Transformer classifies token sequences under `mixed_bfloat16`,
its feed-forward layers quantized with `quantize("float8")` (delayed
scaling: each layer scales its inputs by the largest value of earlier
steps). Then the block's first LayerNormalization drifts (its gain grows
50x, as a norm's gain can when the learning rate is too high): the first
feed-forward layer's inputs jump past the range their delayed scale
covers, and float8 clips them without an inf, so no loss scaler sees it.
`HeadroomMonitor` measures the probe batch and names the layer, with the
share of its inputs clipped. The fix is that layer's: built again with it
left out of float8, the same drift saturates nothing.

    python examples/float8_transformer.py

Runs offline on TensorFlow, JAX and PyTorch (float8 trains on a CPU with a
GPU's numerics, fake-quantized on PyTorch; its speed needs FP8 hardware).
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import mp_callbacks as mp

VOCABULARY, LENGTH, WIDTH = 32, 16, 32
FEED_FORWARD = ("ffn_up", "ffn_down")


def make_data(samples: int, seed: int = 0):
    """Token sequences; the class says whether token 1 occurs more often than token 2."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 8, size=(samples, LENGTH)).astype("int32")
    return ids, ((ids == 1).sum(axis=1) > (ids == 2).sum(axis=1)).astype("int64")


def build_model(float8_layers: tuple[str, ...]) -> mp.MixedPrecisionModel:
    keras.utils.set_random_seed(0)
    ids = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, WIDTH, name="embedding")(ids)
    attended = keras.layers.MultiHeadAttention(2, WIDTH // 2, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="norm1")(x + attended)
    hidden = keras.layers.Dense(2 * WIDTH, activation="relu", name="ffn_up")(x)
    hidden = keras.layers.LayerNormalization(name="ffn_norm")(hidden)  # NormFormer's mid-FFN norm
    x = keras.layers.LayerNormalization(name="norm2")(x + keras.layers.Dense(WIDTH, name="ffn_down")(hidden))
    pooled = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(2, activation="softmax", dtype="float32", name="head")(pooled)
    model = mp.MixedPrecisionModel(ids, outputs)
    for name in float8_layers:
        model.get_layer(name).quantize("float8")
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def train_through_the_drift(model, x, y, epochs: int) -> tuple[list, list, list[str]]:
    """Trains `epochs`, lets norm1's gain grow 50x, trains one more epoch.
    Returns the monitor's records (one a probe) before and after the drift,
    and the layers it warned of."""
    probe = x[:64]
    calm = mp.HeadroomMonitor(probe=probe, every_n_steps=len(x) // 32)  # once an epoch
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[calm])
    gamma = model.get_layer("norm1").gamma
    gamma.assign(gamma * 50.0)
    # A delayed scale lags one step behind its inputs: the probe after the
    # first step past the drift sees what that step clipped.
    drift = mp.HeadroomMonitor(probe=probe, every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", mp.MixedPrecisionWarning)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[drift])
    named = sorted({str(w.message).split("'")[1] for w in caught if "saturate" in str(w.message)})
    return calm.history, drift.history, named


def saturation(records: list, layer: str) -> float:
    """The largest share of `layer`'s inputs float8 clipped on the probes
    of `records` (0 when the layer is not float8)."""
    return max(record["float8"].get(layer, {}).get("inputs", {}).get("saturation", 0.0) for record in records)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x, y = make_data(args.samples)
    print(f"1. training with {', '.join(FEED_FORWARD)} in float8, then norm1's gain drifts 50x")
    before, after, named = train_through_the_drift(build_model(FEED_FORWARD), x, y, args.epochs)
    for layer in FEED_FORWARD:
        print(
            f"   {layer}: inputs clipped {saturation(before, layer):.3f} before the drift, "
            f"{saturation(after, layer):.3f} after"
        )
    print(f"   HeadroomMonitor warned of: {named}")

    kept = tuple(layer for layer in FEED_FORWARD if layer not in named)
    print(f"\n2. the fix: {named} left out of float8, float8 kept for {list(kept)}")
    _, after, named_after = train_through_the_drift(build_model(kept), x, y, args.epochs)
    worst = max(saturation(after, layer) for layer in FEED_FORWARD)
    print(f"   largest share clipped after the drift: {worst:.3f}")
    print(f"   HeadroomMonitor warned of: {named_after}")
    keras.mixed_precision.set_global_policy("float32")


if __name__ == "__main__":
    main()
