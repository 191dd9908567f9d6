"""`HeadroomMonitor.plot`: each format's figures as a heat map of layer by
epoch, one panel a figure (matplotlib, drawn off-screen)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FIGURES", "layer_epoch_tables", "plot_tables"]

#: The figures a panel can show, in the order panels are drawn; the first
#: four are drawn unless others are asked for.
FIGURES = (
    "headroom",
    "bfloat16/error",
    "float8/saturation",
    "float8/underflow",
    "bfloat16/underflow",
    "float8/amax_ratio",
    "float8/current_underflow",
    "float8/mx_underflow",
    "float8/history_nonfinite",
)
DEFAULT_FIGURES = FIGURES[:4]


def _values(record: dict[str, Any], figure: str) -> dict[str, float]:
    """One probe's values of `figure`, by row (a layer; for float8, a
    layer's tensor: `dense/inputs`)."""
    if figure == "headroom":
        return dict(record.get("headroom", {}))
    fmt, name = figure.split("/")
    if fmt == "bfloat16":
        return {layer: entry[name] for layer, entry in record.get("bfloat16", {}).items()}
    if name == "history_nonfinite":
        return {layer: float(entry[name]) for layer, entry in record.get("float8", {}).items()}
    return {
        f"{layer}/{tensor}": entry[tensor][name]
        for layer, entry in record.get("float8", {}).items()
        for tensor in ("inputs", "kernel", "outputs_grad")
        if name in entry.get(tensor, {})
    }


def layer_epoch_tables(
    history: list[dict[str, Any]], figures: tuple[str, ...] = DEFAULT_FIGURES
) -> dict[str, tuple[list[str], list[int], np.ndarray]]:
    """For each figure with any value: its rows, its epochs, and a
    rows x epochs array of the epoch's highest value (NaN where a row has
    none), as the epoch logs hold it."""
    epochs = sorted({record["epoch"] for record in history})
    tables = {}
    for figure in figures:
        highest: dict[str, dict[int, float]] = {}
        for record in history:
            for row, value in _values(record, figure).items():
                by_epoch = highest.setdefault(row, {})
                by_epoch[record["epoch"]] = max(by_epoch.get(record["epoch"], -np.inf), value)
        if not highest:
            continue
        rows = sorted(highest)
        table = np.full((len(rows), len(epochs)), np.nan)
        for i, row in enumerate(rows):
            for j, epoch in enumerate(epochs):
                table[i, j] = highest[row].get(epoch, np.nan)
        tables[figure] = (rows, epochs, table)
    return tables


def plot_tables(tables: dict[str, tuple[list[str], list[int], np.ndarray]], path: str) -> None:
    """One heat-map panel a table, side by side, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tallest = max(len(rows) for rows, _, _ in tables.values())
    figure, axes = plt.subplots(
        1, len(tables), figsize=(4.5 * len(tables), 1.5 + 0.3 * tallest), squeeze=False
    )
    for axis, (name, (rows, epochs, table)) in zip(axes[0], tables.items()):
        # Shares live in [0, 1]; an amax ratio or an overflow may pass 1.
        finite = table[np.isfinite(table)]
        top = max(1.0, float(finite.max())) if finite.size else 1.0
        image = axis.imshow(np.nan_to_num(table, posinf=top), aspect="auto", vmin=0.0, vmax=top, cmap="magma")
        axis.set_title(name)
        axis.set_xlabel("epoch")
        axis.set_xticks(range(len(epochs)))
        axis.set_xticklabels([str(e + 1) for e in epochs])  # as Keras counts them
        axis.set_yticks(range(len(rows)))
        axis.set_yticklabels(rows)
        figure.colorbar(image, ax=axis)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
