"""How reports and fix lists name a layer: by its name where that name is
the model's only one, else by its path. Transformers reuse sublayer names
in every block (`MultiHeadAttention`'s `query`, `key`, `value`; KerasHub's
`query_projector`, `output_projector`): a record keyed by name merges
them and a fix by name changes the wrong ones."""

from __future__ import annotations

from collections import Counter
from typing import Any

from mp_callbacks._keras_internals import all_layers

__all__ = ["known_labels", "layer_labels", "layer_paths", "layers_labelled"]


def layer_paths(model: Any) -> dict[int, str]:
    """id(layer) -> its path in `model`: the names from the model's own
    layers down to it, joined by "/" (a layer with two parents: its first)."""
    paths: dict[int, str] = {}

    def walk(parent: Any, prefix: str) -> None:
        for child in all_layers(parent, recursive=False):
            if id(child) in paths or child is model:
                continue
            path = f"{prefix}/{child.name}" if prefix else child.name
            paths[id(child)] = path
            walk(child, path)

    walk(model, "")
    return paths


def layer_labels(model: Any) -> dict[int, str]:
    """id(layer) -> the label reports use: its name where no other layer of
    `model` has it, else its path (`block2/proj`)."""
    paths = layer_paths(model)
    layers = all_layers(model)
    counts = Counter(layer.name for layer in layers)
    return {
        id(layer): layer.name if counts[layer.name] == 1 else paths.get(id(layer), layer.name)
        for layer in layers
    }


def layers_labelled(model: Any, labels: list[str]) -> dict[str, list[Any]]:
    """The layers each label names: a path names its one layer (a model's
    own layer has its name as its path, so it wins over a deeper layer of
    the same name, as in the labels reports use); another name names every
    layer that has it. Unknown labels map to an empty list."""
    paths = layer_paths(model)
    layers = all_layers(model)
    by_path = {paths[id(layer)]: layer for layer in layers if id(layer) in paths}
    return {
        label: [by_path[label]] if label in by_path else [layer for layer in layers if layer.name == label]
        for label in labels
    }


def known_labels(model: Any) -> list[str]:
    """Every label and path of `model`'s layers, in Keras's order (for
    messages that list what may be asked for)."""
    labels = layer_labels(model)
    paths = layer_paths(model)
    named = [name for layer in all_layers(model) for name in (labels[id(layer)], paths.get(id(layer)))]
    return list(dict.fromkeys(name for name in named if name is not None))
