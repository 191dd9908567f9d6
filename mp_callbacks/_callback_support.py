"""What the three callbacks share: deep copies that do not drag a model
along (keras-tuner deep-copies the callbacks of every trial)."""

from __future__ import annotations

import copy
from typing import Any


class ConfigCopyMixin:
    """`copy.deepcopy` rebuilds the callback from its config.

    A callback that has been attached to a model holds it; copying that
    would copy (or, for Keras objects, re-save) the whole model. A copy made
    from the config is what keras-tuner wants for a new trial: same
    settings, fresh state.
    """

    def __deepcopy__(self, memo: dict) -> Any:
        clone = type(self).from_config(copy.deepcopy(self.get_config(), memo))
        memo[id(self)] = clone
        return clone

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Any:
        return cls(**config)
