"""KerasHub's tasks from tiny configs, for the sweep over the model zoo
(`tests/on_every_backend/test_keras_hub_sweep.py`).

Every task class `keras_hub.models` exports is either built here (its
backbone from `TINY`, the few arguments most backbones share, or from its
own entry in `CONFIGS`) or left out with a reason in `LEFT_OUT`; a new
KerasHub release with a new task fails the sweep until it is one or the
other. No weights are downloaded: `preprocessor=None` and synthetic inputs
made from the backbone's own input specs.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import keras
import numpy as np

VOCABULARY = 64
SEQUENCE = 16

#: The arguments most KerasHub backbones share, tiny: a backbone whose
#: required arguments are all here is built from them.
TINY: dict[str, Any] = {
    "vocabulary_size": VOCABULARY,
    "num_layers": 1,
    "num_heads": 2,
    "num_attention_heads": 2,
    "num_query_heads": 2,
    "num_key_value_heads": 1,
    "hidden_dim": 16,
    "intermediate_dim": 32,
    "head_dim": 8,
    "embedding_dim": 16,
    "max_sequence_length": SEQUENCE,
    "patch_size": 4,
    "image_shape": (16, 16, 3),
    "mlp_dim": 32,
    "num_experts": 4,  # Qwen3-MoE routes to its default top 4
    "moe_intermediate_dim": 16,
}

#: Backbones with architecture-specific arguments, on top of `TINY`'s.
CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3_5Backbone": {  # its linear-attention layers default to 32 heads of 128
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
    },
    "ResNetBackbone": {
        "input_conv_filters": [64],
        "input_conv_kernel_sizes": [3],
        "stackwise_num_filters": [64, 16],  # KerasHub asks for 64 first
        "stackwise_num_blocks": [1, 1],
        "stackwise_num_strides": [1, 2],
        "block_type": "basic_block",
        "image_shape": (16, 16, 3),
    },
    "EfficientNetBackbone": {
        "stackwise_kernel_sizes": [3, 3],
        "stackwise_num_repeats": [1, 1],
        "stackwise_input_filters": [8, 8],
        "stackwise_output_filters": [8, 8],
        "stackwise_expansion_ratios": [1, 2],
        "stackwise_squeeze_and_excite_ratios": [0.0, 0.25],
        "stackwise_strides": [1, 2],
        "stackwise_block_types": ["fused", "unfused"],
        "width_coefficient": 1.0,
        "depth_coefficient": 1.0,
        "image_shape": (16, 16, 3),
    },
}

_COMPOSED = "its backbone is composed of other models (encoders, decoders, a VAE) built separately"
_GENERATIVE = "an image-generation pipeline: it trains no loss through fit"
_OWN_CONFIG = "its backbone has a dozen architecture-specific arguments and no small config here yet"

#: Task class -> why the sweep leaves it out.
LEFT_OUT: dict[str, str] = {
    "BASNetImageSegmenter": _COMPOSED,
    "BLIP2CausalLM": _COMPOSED,
    "BLIP2Seq2SeqLM": _COMPOSED,
    "DFineObjectDetector": _COMPOSED,
    "DeepLabV3ImageSegmenter": _COMPOSED,
    "DepthAnythingDepthEstimator": _COMPOSED,
    "PARSeqCausalLM": _COMPOSED,
    "RetinaNetObjectDetector": _COMPOSED,
    "SAM3PromptableConceptImageSegmenter": _COMPOSED,
    "SAMImageSegmenter": _COMPOSED,
    "SegFormerImageSegmenter": _COMPOSED,
    "FluxTextToImage": _GENERATIVE,
    "StableDiffusion3ImageToImage": _GENERATIVE,
    "StableDiffusion3Inpaint": _GENERATIVE,
    "StableDiffusion3TextToImage": _GENERATIVE,
    "PaliGemmaCausalLM": "a vision-language model: its backbone builds a ViT beside Gemma from a dozen arguments",
    "Gemma3CausalLM": "its backbone asks for a vision encoder's image size; Gemma's and Gemma with LoRA stand in",
    "Gemma3TextEmbedder": "its backbone asks for a vision encoder's image size",
    "Gemma4AssistantCausalLM": "a drafting head over another Gemma 4 model's hidden states",
    "Gemma4CausalLM": "its backbone asks for a vision encoder's image size",
    "Gemma3nCausalLM": _OWN_CONFIG,
    "SmolLM3CausalLM": _OWN_CONFIG,
    "T5GemmaSeq2SeqLM": _OWN_CONFIG,
    "T5Gemma2Seq2SeqLM": _OWN_CONFIG,
    "MoonshineAudioToText": _OWN_CONFIG,
    "EdRecSeq2SeqLM": _OWN_CONFIG,
    "Qwen3_5MoeCausalLM": _OWN_CONFIG,
    "QwenMoeCausalLM": _OWN_CONFIG,
    "RWKV7CausalLM": _OWN_CONFIG,
    "RoformerV2MaskedLM": _OWN_CONFIG,
    "RoformerV2TextClassifier": _OWN_CONFIG,
    "CSPNetImageClassifier": _OWN_CONFIG,
    "DenseNetImageClassifier": _OWN_CONFIG,
    "HGNetV2ImageClassifier": _OWN_CONFIG,
    "MiTImageClassifier": _OWN_CONFIG,
    "MobileNetImageClassifier": _OWN_CONFIG,
    "MobileNetV5ImageClassifier": _OWN_CONFIG,
    "SwinTransformerImageClassifier": _OWN_CONFIG,
    "VGGImageClassifier": _OWN_CONFIG,
    "XceptionImageClassifier": _OWN_CONFIG,
    "BertTextEmbedder": "an embedding model: its compile has no loss for fit",
    "Qwen3TextEmbedder": "an embedding model: its compile has no loss for fit",
    "XLMRobertaTextEmbedder": "an embedding model: its compile has no loss for fit",
}


_MOE = "its sparse mixture-of-experts block multiplies low-precision values by float32 routing weights"

#: backend -> task class -> (the policy the sweep trains it in instead of
#: the backend's mixed one, why): stock KerasHub fails these under the mixed
#: policy (the sweep checks that it still does).
OTHER_POLICY: dict[str, dict[str, tuple[str, str]]] = {
    "tensorflow": {
        "ESMMaskedPLM": ("mixed_bfloat16", "its rotary embedding asks TensorFlow for a float16 range"),
        "ESMProteinClassifier": (
            "mixed_bfloat16",
            "its rotary embedding asks TensorFlow for a float16 range",
        ),
        "MixtralCausalLM": ("float32", _MOE),
        "Qwen3MoeCausalLM": ("float32", _MOE),
    },
    "jax": {},
    "torch": {},
}


def task_classes(keras_hub: Any) -> dict[str, type]:
    """Every concrete task class KerasHub exports, by name; an alias (the
    same class under a second name) counts once, under its class's name."""
    models = keras_hub.models
    found = {}
    for name in dir(models):
        value = getattr(models, name)
        if isinstance(value, type) and issubclass(value, models.Task) and value.backbone_cls is not None:
            found.setdefault(value.__name__, value)
    return found


def swept(keras_hub: Any) -> list[str]:
    return sorted(name for name in task_classes(keras_hub) if name not in LEFT_OUT)


def backbone(backbone_class: type) -> Any:
    """`backbone_class` built tiny: `TINY`'s arguments it takes, then its
    own from `CONFIGS`."""
    own = CONFIGS.get(backbone_class.__name__, {})
    parameters = inspect.signature(backbone_class.__init__).parameters
    required = [
        name
        for name, p in parameters.items()
        if name != "self" and p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    missing = [name for name in required if name not in TINY and name not in own]
    if missing:
        raise ValueError(f"{backbone_class.__name__} needs {missing}: give it an entry in CONFIGS")
    wanted = set(required) | {"max_sequence_length", "image_shape"}
    shared = {name: TINY[name] for name in parameters if name in TINY and name in wanted}
    return backbone_class(**{**shared, **own})


@functools.cache
def adopted(task_class: type, mixed_in: type) -> type:
    """The documented adoption, `class Mixed<Task>(mixed_in, task_class)`,
    registered for saving (one class per task, however often asked for)."""
    cls = type(f"Mixed{task_class.__name__}", (mixed_in, task_class), {})
    return keras.saving.register_keras_serializable(package="keras_hub_zoo")(cls)


def task(task_class: type, keras_hub: Any, mixed_in: type | None = None, name: str | None = None) -> Any:
    """A tiny `task_class` (or its adoption by `mixed_in`), compiled with
    the task's own defaults. TensorFlow orders a graph's independent
    operations by name, which can change the last bit of a sum: give two
    models that must train bit for bit alike the same `name`."""
    cls = task_class if mixed_in is None else adopted(task_class, mixed_in)
    arguments: dict[str, Any] = {} if name is None else {"name": name}
    if "num_classes" in inspect.signature(task_class.__init__).parameters:
        arguments["num_classes"] = 2
    return cls(backbone=backbone(task_class.backbone_cls), preprocessor=None, **arguments)


def batch(model: Any, keras_hub: Any, n: int = 4, seed: int = 0) -> tuple[Any, Any]:
    """Synthetic inputs for `model`'s backbone (ids under the vocabulary,
    masks all on, images in [0, 1)) and targets for its task."""
    rng = np.random.default_rng(seed)
    specs = model.backbone.input
    named = specs if isinstance(specs, dict) else {"": specs}
    x = {}
    for key, spec in named.items():
        shape = (n, *(SEQUENCE if d is None else d for d in spec.shape[1:]))
        if "mask" in key:
            x[key] = np.ones(shape, bool)
        elif "segment" in key:
            x[key] = np.zeros(shape, "int32")
        elif "int" in str(spec.dtype):
            x[key] = rng.integers(0, VOCABULARY, shape).astype("int32")
        else:
            x[key] = rng.random(shape).astype("float32")
    models = keras_hub.models
    if isinstance(model, models.CausalLM):  # Seq2SeqLM included: the targets are the decoder's
        y = rng.integers(
            0, VOCABULARY, x["decoder_token_ids" if "decoder_token_ids" in x else "token_ids"].shape
        )
    elif isinstance(model, models.MaskedLM):
        x["mask_positions"] = np.tile(np.arange(2, dtype="int32"), (n, 1))
        y = rng.integers(0, VOCABULARY, (n, 2))
    else:
        y = rng.integers(0, 2, (n,))
    return x.get("", x), y
