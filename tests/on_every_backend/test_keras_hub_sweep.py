"""The KerasHub sweep: every task class KerasHub exports, built tiny and
adopted the documented way (a subclass mixing `MixedPrecisionModel` in
first), through the library's functions: `check_model`, a poisoned step,
a healthy step with `HeadroomMonitor`, `diagnose_batch` and
`float32_copy`, training equal to stock in float32, and saving; or left out
with a reason (`tests/keras_hub_zoo.py`). `generate()`, presets and LoRA
are in `test_adopted_task.py`."""

from __future__ import annotations

import keras
import keras_hub_zoo as zoo
import numpy as np
import pytest

import mp_callbacks as mp
from mp_callbacks._layer_labels import layers_labelled

keras_hub = pytest.importorskip("keras_hub")
pytestmark = pytest.mark.slow  # a fit of a tiny model per task

BACKEND = keras.backend.backend()
# JAX's dot_general on the CPU has no float16 product accumulated in float32,
# which several KerasHub attentions ask for (stock fails alike).
POLICY = "mixed_bfloat16" if BACKEND == "jax" else "mixed_float16"


def test_every_task_class_is_swept_or_left_out_with_a_reason():
    classes = zoo.task_classes(keras_hub)
    assert sorted(set(zoo.LEFT_OUT) - set(classes)) == []  # no reason for a class KerasHub dropped
    assert len(zoo.swept(keras_hub)) == 38  # the model guide says so
    assert set(zoo.OTHER_POLICY[BACKEND]) | set(SWEPT) <= set(zoo.swept(keras_hub))
    for name in zoo.swept(keras_hub):
        zoo.backbone(classes[name].backbone_cls)  # builds from the tiny config


# JAX compiles each step anew and replays op by op: a tiny task takes 20 to
# 150 s there, against 5 to 50 s on TensorFlow. To keep CI in its time, JAX
# sweeps one task of each architecture family and kind, and replays
# (HeadroomMonitor's probe, diagnose_batch) one of each kind.
REPLAYED = {"BartSeq2SeqLM", "BertMaskedLM", "BertTextClassifier", "GPT2CausalLM", "ViTImageClassifier"}
SWEPT = (
    zoo.swept(keras_hub)
    if BACKEND == "tensorflow"
    else sorted(
        REPLAYED
        | {"EfficientNetImageClassifier", "GemmaCausalLM", "LlamaCausalLM", "MixtralCausalLM", "QwenCausalLM"}
        | {"ResNetImageClassifier", "T5Seq2SeqLM"}
    )
)


# T5 overflows in float16 (stock too): its attention's softmax, inside the
# attention layer's own operations; the dropout after it only receives it.
OVERFLOWS_FORWARD = (
    {"T5Seq2SeqLM": "transformer_encoder_layer_0/self_attention"} if POLICY == "mixed_float16" else {}
)


def _fails_eagerly(model) -> bool:
    """KerasHub's masked-LM head adds its float32 bias to low-precision
    logits, which TensorFlow refuses outside a traced function: the stock
    task's eager call fails alike, and `HeadroomMonitor`'s probe and
    `diagnose_batch` run the model eagerly."""
    return (
        BACKEND == "tensorflow"
        and isinstance(model, keras_hub.models.MaskedLM)
        and keras.config.dtype_policy().name != "float32"
    )


def _label(key: str) -> str:
    """`headroom/<label>` and `bfloat16/<label>/error` -> the layer label."""
    parts = key.split("/")
    return "/".join(parts[1:] if parts[0] == "headroom" else parts[1:-1])


@pytest.mark.parametrize("name", SWEPT)
def test_a_task_adopted_runs_through_every_library_function(name, tmp_path):
    task_class = zoo.task_classes(keras_hub)[name]
    # Trains as the stock task: one step in float32 from the same seed.
    trained = []
    for mixed_in in (None, mp.MixedPrecisionModel):
        keras.utils.set_random_seed(0)
        model = zoo.task(task_class, keras_hub, mixed_in=mixed_in, name="task")
        model.train_on_batch(*zoo.batch(model, keras_hub))
        trained.append([np.array(w.numpy()) for w in model.weights])
    assert all(np.array_equal(stock, ours) for stock, ours in zip(*trained))

    keras.config.set_dtype_policy(POLICY)
    if name in zoo.OTHER_POLICY[BACKEND]:  # the reason still holds: stock fails under the mixed policy
        stock = zoo.task(task_class, keras_hub)
        with pytest.raises((TypeError, ValueError)):
            stock.train_on_batch(*zoo.batch(stock, keras_hub))
        keras.config.set_dtype_policy(zoo.OTHER_POLICY[BACKEND][name][0])
    keras.utils.set_random_seed(0)
    model = zoo.task(task_class, keras_hub, mixed_in=mp.MixedPrecisionModel)
    x, y = zoo.batch(model, keras_hub)
    assert mp.check_model(model) == []

    before = [np.array(w.numpy()) for w in model.weights]
    poisoned = model.fit(x, y, sample_weight=np.full(y.shape, np.nan, "float32"), verbose=0).history
    assert poisoned["skipped_steps"] == [1.0]
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights))

    ones = np.ones(y.shape, "float32")  # the poisoned step's structure: no second trace
    if BACKEND != "tensorflow" and name not in REPLAYED:
        assert model.fit(x, y, sample_weight=ones, verbose=0).history["skipped_steps"] == [0.0]
    elif _fails_eagerly(model):
        with pytest.raises(Exception, match="cannot compute AddV2"):
            zoo.task(task_class, keras_hub)(x)  # the stock task, eagerly
        with pytest.warns(mp.MixedPrecisionWarning, match="cannot run through"):
            model.fit(x, y, sample_weight=ones, verbose=0, callbacks=[mp.HeadroomMonitor(probe=x)])
    else:
        monitor = mp.HeadroomMonitor(probe=x, every_n_steps=1)
        healthy = model.fit(x, y, sample_weight=ones, verbose=0, callbacks=[monitor]).history
        # A per-layer figure names one layer (its name where no other layer
        # has it, else its path), the one a fix by that label changes.
        labels = [_label(key) for key in healthy if key.startswith(("headroom/", "bfloat16/"))]
        if keras.config.dtype_policy().name != "float32":
            assert labels and all(len(layers_labelled(model, [label])[label]) == 1 for label in labels)

        report = mp.diagnose_batch(model, x, y)
        expected = OVERFLOWS_FORWARD.get(name)
        assert report.forward_origin == (expected and f"{model.backbone.name}/{expected}")
        if expected:  # the step skipped it; the fix list fixes it
            assert healthy["skipped_steps"] == [1.0] and not report.loss_finite
            fixed = mp.with_float32_layers(model, report.float32_layers)
            assert fixed.fit(x, y, sample_weight=ones, verbose=0).history["skipped_steps"] == [0.0]

    served = mp.float32_copy(model)
    assert type(served) is task_class
    assert {layer.compute_dtype for layer in served._flatten_layers()} <= {"float32", "int32", "bool"}

    model.save(str(tmp_path / "task.keras"))
    loaded = keras.models.load_model(str(tmp_path / "task.keras"))
    assert isinstance(loaded, zoo.adopted(task_class, mp.MixedPrecisionModel))
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
