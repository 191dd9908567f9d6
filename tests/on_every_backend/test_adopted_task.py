"""A KerasHub task adopted the documented way, a subclass that mixes
`MixedPrecisionModel` in before the task's class, on every backend where
keras-hub is installed: it keeps the task (its compile defaults,
`generate()`, saving as the task), trains as stock in float32, skips a
poisoned step, and copies to the float32 task."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import mp_callbacks as mp

keras_hub = pytest.importorskip("keras_hub")
pytestmark = pytest.mark.slow  # fits of tiny transformers


@keras.saving.register_keras_serializable(package="test_adopted_task")
class MixedGPT2(mp.MixedPrecisionModel, keras_hub.models.GPT2CausalLM):
    pass


def _backbone():
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=64,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
    )


def _batch(n=8):
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 64, (n, 16)).astype("int32"), "padding_mask": np.ones((n, 16), bool)}
    return x, rng.integers(0, 64, (n, 16))


def test_an_adopted_task_trains_as_stock_and_keeps_the_task():
    x, y = _batch()
    trained = []
    for cls in (keras_hub.models.GPT2CausalLM, MixedGPT2, keras_hub.models.GPT2CausalLM, MixedGPT2):
        keras.utils.set_random_seed(3)
        model = cls(backbone=_backbone(), preprocessor=None)  # compiled by the task: its defaults
        losses = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False).history["loss"]
        trained.append((losses, [w.numpy() for w in model.weights]))
    # Built in any order beside the stock task: our class is never
    # rewritten, and a stock task built before still runs.
    assert "Functional" not in [c.__name__ for c in mp.MixedPrecisionModel.__mro__]
    stock_model = keras_hub.models.GPT2CausalLM(backbone=_backbone(), preprocessor=None)
    MixedGPT2(backbone=_backbone(), preprocessor=None)
    assert stock_model.predict(x, verbose=0).shape == (8, 16, 64)
    stock, ours = trained[0], trained[1]
    assert ours[0] == stock[0] and all(np.array_equal(a, b) for a, b in zip(stock[1], ours[1]))
    assert isinstance(model.optimizer, keras.optimizers.Adam) and model.loss.get_config()["from_logits"]
    assert sorted(model.generate({k: v[:1] for k, v in x.items()}, stop_token_ids=None)) == [
        "padding_mask",
        "token_ids",
    ]

    keras.mixed_precision.set_global_policy("mixed_bfloat16")  # the copy of a mixed model
    model = MixedGPT2(backbone=_backbone(), preprocessor=None)
    model.fit(x, y, verbose=0)
    served = mp.float32_copy(model)
    assert type(served) is keras_hub.models.GPT2CausalLM
    keras.mixed_precision.set_global_policy("float32")
    reference = keras_hub.models.GPT2CausalLM(backbone=_backbone(), preprocessor=None)
    reference.set_weights(model.get_weights())
    np.testing.assert_array_equal(served.predict(x, verbose=0), reference.predict(x, verbose=0))
    assert {layer.compute_dtype for layer in served._flatten_layers()} == {"float32"}


def test_an_adopted_task_loads_a_local_preset_and_saves_one(tmp_path):
    x, _ = _batch(2)
    stock = keras_hub.models.GPT2CausalLM(backbone=_backbone(), preprocessor=None)
    stock.save_to_preset(str(tmp_path / "stock"))
    lm = MixedGPT2.from_preset(str(tmp_path / "stock"), preprocessor=None)  # the stock preset's weights
    assert isinstance(lm, MixedGPT2)
    np.testing.assert_array_equal(lm.predict(x, verbose=0), stock.predict(x, verbose=0))
    lm.save_to_preset(str(tmp_path / "ours"))
    back = keras_hub.models.GPT2CausalLM.from_preset(str(tmp_path / "ours"), preprocessor=None)
    assert isinstance(back, MixedGPT2)  # the preset names the registered class, as Keras's saving does
    np.testing.assert_array_equal(back.predict(x, verbose=0), stock.predict(x, verbose=0))


def _tokenizer():
    """A byte-pair vocabulary just big enough for its text, as KerasHub's tests build one."""
    vocabulary = {"<|endoftext|>": 0}
    for character in ["Ġ", *sorted(set("airplane at airport") - {" "})]:
        vocabulary[character] = len(vocabulary)
    merges = ["a i", "ai r", "Ġ a", "Ġa t", "Ġ air"]
    for merge in merges:
        vocabulary[merge.replace(" ", "")] = len(vocabulary)
    return keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)


def test_an_adopted_task_keeps_its_preprocessor_through_fit_generate_and_presets(tmp_path):
    def build(cls):
        keras.utils.set_random_seed(5)
        preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer=_tokenizer(), sequence_length=8)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
            num_layers=1,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=8,
        )
        model = cls(backbone=backbone, preprocessor=preprocessor)
        model.compile(sampler="greedy")
        return model

    text = ["airplane at airport", "airport", "air at plane", "plane"]
    stock, ours = build(keras_hub.models.GPT2CausalLM), build(MixedGPT2)
    try:
        import tensorflow_text  # noqa: F401
    except ImportError:
        text_in_fit = keras.backend.backend() != "tensorflow"
    else:
        text_in_fit = True
    if text_in_fit:  # the preprocessor runs in fit: raw strings in
        histories = [
            m.fit(text, batch_size=2, verbose=0, shuffle=False).history["loss"] for m in (stock, ours)
        ]
        assert histories[0] == histories[1]
    else:  # KerasHub's TensorFlow data pipeline tokenizes with tensorflow-text; stock alike
        with pytest.raises(Exception, match="requires `tensorflow` and `tensorflow-text`"):
            stock.fit(text, batch_size=2, verbose=0)
    assert ours.generate("air", max_length=8) == stock.generate("air", max_length=8)
    assert ours.generate("air", max_length=8).startswith("air")

    ours.save(str(tmp_path / "lm.keras"))
    loaded = keras.models.load_model(str(tmp_path / "lm.keras"))
    assert type(loaded.preprocessor) is keras_hub.models.GPT2CausalLMPreprocessor
    assert loaded.preprocessor.tokenizer.get_vocabulary() == ours.preprocessor.tokenizer.get_vocabulary()
    ours.save_to_preset(str(tmp_path / "preset"))
    from_preset = MixedGPT2.from_preset(str(tmp_path / "preset"))  # the preprocessor with it
    assert isinstance(from_preset, MixedGPT2) and from_preset.preprocessor.sequence_length == 8
    for model in (loaded, from_preset):
        model.compile(sampler="greedy")
        assert model.generate("air", max_length=8) == ours.generate("air", max_length=8)


def test_from_model_on_a_task_says_how_to_keep_it():
    task = keras_hub.models.GPT2CausalLM(backbone=_backbone(), preprocessor=None)
    with pytest.warns(
        mp.MixedPrecisionWarning, match=r"class MixedGPT2CausalLM\(MixedPrecisionModel, GPT2CausalLM\)"
    ):
        wrapped = mp.MixedPrecisionModel.from_model(task)
    assert not hasattr(wrapped, "generate")


def _text_batch(n=8, segments=False):
    x, _ = _batch(n)
    if segments:
        x["segment_ids"] = np.zeros((n, 16), "int32")
    return x


def _gemma_with_lora():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
    )
    backbone.enable_lora(2)
    return backbone


def _lm_batch():
    return _text_batch(), np.random.default_rng(1).integers(0, 64, (8, 16))


# The sweep (test_keras_hub_sweep.py) takes every task through the same
# steps; LoRA on top of a task is this table's.
_TINY_TASKS = {
    "GemmaCausalLM with LoRA": ("GemmaCausalLM", _gemma_with_lora, {}, _lm_batch),
}


@pytest.mark.parametrize("name", sorted(_TINY_TASKS))
def test_adopted_tasks_skip_exactly_save_and_copy_as_the_task(name, tmp_path):
    class_name, backbone, arguments, data = _TINY_TASKS[name]
    task_class = getattr(keras_hub.models, class_name)
    adopted = keras.saving.register_keras_serializable(package="test_adopted_task")(
        type(f"Mixed{class_name}", (mp.MixedPrecisionModel, task_class), {})
    )
    x, y = data()
    # JAX's dot_general on the CPU has no float16 product accumulated in
    # float32, which Llama's attention asks for (stock Llama fails alike).
    keras.mixed_precision.set_global_policy(
        "mixed_bfloat16" if keras.backend.backend() == "jax" else "mixed_float16"
    )
    model = adopted(backbone=backbone(), preprocessor=None, **arguments)
    assert mp.check_model(model) == []
    model.fit(x, y, verbose=0)
    before = [w.numpy().copy() for w in model.weights + model.optimizer.variables]
    poisoned = model.fit(x, y, sample_weight=np.full(y.shape, np.nan, "float32"), verbose=0).history
    assert poisoned["skipped_steps"] == [1.0]
    assert all(
        np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights + model.optimizer.variables)
    )
    model.save(str(tmp_path / "task.keras"))
    loaded = keras.models.load_model(str(tmp_path / "task.keras"))
    assert type(loaded).__name__ == f"Mixed{class_name}"
    # KerasHub loads a LoRA backbone with its LoRA merged into the kernels
    # (stock too), which rounds differently in low precision.
    tolerance = 5e-2 if "LoRA" in name else 0.0
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=0, atol=tolerance
    )
    served = mp.float32_copy(model)
    assert type(served) is task_class
    assert {layer.compute_dtype for layer in served._flatten_layers()} <= {"float32", "int32", "bool"}
