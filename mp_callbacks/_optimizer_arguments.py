"""`LossScaleOptimizer`'s arguments, one parser for every backend.

tf.keras's (`dynamic`, `initial_scale`, `dynamic_growth_steps`), Keras 3's
(which refuse the base optimizer's arguments and unknown ones), and the
`LossScaler` settings beyond both, or a ready `loss_scale`: checked in
one place, so both backends refuse the same input with the same message.
The backend's `LossScaler` class comes in as an argument; `loss_scale=`
goes through the one parser, `_loss_scale_argument`.
"""

from __future__ import annotations

from typing import Any

from mp_callbacks._backend import keras
from mp_callbacks._loss_scale_argument import scaler_from_argument
from mp_callbacks._scale_state import check_fixed_scale
from mp_callbacks._validation import check_int, fail
from mp_callbacks.errors import UnsupportedArgumentError

__all__ = [
    "BASE_DEFAULTS",
    "EXTRA_SETTINGS",
    "check_inner",
    "scaler_from_arguments",
]

OWNER = "LossScaleOptimizer"
#: Keras's base-optimizer arguments: accepted at their defaults (configs
#: written by Keras carry them), refused otherwise: set them on the inner one.
BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
#: LossScaler settings beyond tf.keras's, and their defaults.
EXTRA_SETTINGS = {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    "hysteresis": 1,
}


def integral(value: Any) -> Any:
    """An integral float (2.0) as an int, as both peers accept one."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def check_inner(inner_optimizer: Any) -> None:
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "LossScaleOptimizer cannot wrap another LossScaleOptimizer, but got: "
            f"{inner_optimizer!r}: it would scale the loss twice."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            '"inner_optimizer" must be an instance of keras.optimizers.Optimizer, '
            f"but got: {inner_optimizer!r}."
        )


def scaler_from_arguments(
    inner_optimizer: Any,
    dynamic: Any,
    initial_scale: Any,
    dynamic_growth_steps: Any,
    loss_scale: Any,
    keywords: dict[str, Any],
    kwargs: dict[str, Any],
    scaler_class: type,
) -> Any:
    """The `scaler_class` object that `LossScaleOptimizer`'s arguments
    describe; every refusal names the argument and the value."""
    check_inner(inner_optimizer)
    if not isinstance(dynamic, bool):
        raise TypeError(
            f'"dynamic" argument to LossScaleOptimizer.__init__ must be a bool, but got: {dynamic!r}'
        )
    for argument, default in BASE_DEFAULTS.items():
        if argument in kwargs:
            value = kwargs.pop(argument)
            if value != default:
                raise ValueError(
                    f"LossScaleOptimizer does not support `{argument}`. Instead, set "
                    f"`{argument}` on the `inner_optimizer` (received {argument}={value!r})."
                )
    if kwargs:
        raise UnsupportedArgumentError(
            f"LossScaleOptimizer does not support arguments: `{'`, `'.join(kwargs)}`."
        )
    keywords = {
        key: integral(v) if key in ("growth_interval", "hysteresis") else v for key, v in keywords.items()
    }
    return _scaler_from_settings(
        dynamic,
        initial_scale,
        integral(dynamic_growth_steps),
        loss_scale,
        keywords,
        scaler_class,
    )


def _scaler_from_settings(
    dynamic: bool,
    initial_scale: Any,
    dynamic_growth_steps: Any,
    loss_scale: Any,
    keywords: dict[str, Any],
    scaler_class: Any,
) -> Any:
    """The scale tf.keras's arguments (and the keywords) describe, refusing
    contradictions with a message naming them."""
    if dynamic_growth_steps is not None:
        if not dynamic:
            raise ValueError(
                '"dynamic_growth_steps" must be None if "dynamic" is False, '
                f"but got: {dynamic_growth_steps!r}"
            )
        dynamic_growth_steps = check_int(OWNER, "dynamic_growth_steps", dynamic_growth_steps, low=1)
        interval = keywords["growth_interval"]
        if interval is not None and interval != dynamic_growth_steps:
            raise ValueError(
                f"{OWNER}: `dynamic_growth_steps` and `growth_interval` are the same "
                f"setting and disagree; received dynamic_growth_steps="
                f"{dynamic_growth_steps!r}, growth_interval={interval!r}."
            )
        keywords["growth_interval"] = dynamic_growth_steps
    settings = {"initial_scale": initial_scale, **keywords}
    given = {key: value for key, value in settings.items() if value is not None}
    if loss_scale is not None:
        if given or not dynamic:
            names = sorted(given) + ([] if dynamic else ["dynamic"])
            raise ValueError(
                f"{OWNER}: pass either `loss_scale` or the scale's settings "
                f"({', '.join(names)}), not both; received loss_scale={loss_scale!r} "
                f"with {', '.join(f'{k}={v!r}' for k, v in given.items()) or 'dynamic=False'}."
            )
        if isinstance(loss_scale, str) or (isinstance(loss_scale, dict) and not loss_scale):
            fail(
                OWNER,
                "loss_scale",
                loss_scale,
                "a LossScaler, its config dict, or a number in [2**-24, 2**64] (fixed scale)",
                ValueError,
            )
        result = scaler_from_argument(loss_scale, scaler_class, owner=OWNER)
        assert result is not None  # only "auto" gives None, refused above
        return result
    if dynamic:
        return scaler_class(**given)
    if initial_scale is None:
        raise ValueError(
            '"initial_scale" must be specified if "dynamic" is False: it is the fixed '
            "loss scale (Keras 3 has no dynamic=False: there, set `loss_scale_factor` "
            "on the inner optimizer instead)."
        )
    extra = sorted(set(given) - {"initial_scale"})
    if extra:
        raise ValueError(
            f"{OWNER}: {', '.join(extra)} only apply to a dynamic loss scale, but dynamic=False."
        )
    return scaler_class.fixed(check_fixed_scale(OWNER, "initial_scale", initial_scale))


class ScaleOptimizerAttributes:
    """What both backends' `LossScaleOptimizer` share over their `scaler`:
    tf.keras's and Keras 3's scale attributes, and one config layout."""

    scaler: Any
    name: str
    inner_optimizer: Any

    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic."""
        return bool(self.scaler.is_dynamic)

    @property
    def initial_scale(self) -> float:
        return float(self.scaler.initial_scale)

    @property
    def dynamic_growth_steps(self) -> int | None:
        return int(self.scaler.growth_interval) if self.dynamic else None

    def get_config(self) -> dict[str, Any]:
        """Keras 3's layout (`name`, `inner_optimizer`, `initial_scale`,
        `dynamic_growth_steps`), plus `dynamic=False` for a fixed scale and
        any `LossScaler` setting that is not its default."""
        config: dict[str, Any] = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
        }
        if not self.dynamic:
            return {**config, "dynamic": False}
        scale_config = self.scaler.get_config()
        extras = {
            key: scale_config[key] for key, default in EXTRA_SETTINGS.items() if scale_config[key] != default
        }
        return {**config, **extras}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        """From `get_config`'s layout (Keras 3's and tf.keras's), or from
        TensorFlow 2.3's (`optimizer` and a serialized `loss_scale`)."""
        config = dict(config)
        if "inner_optimizer" not in config:
            config = _from_tf23_layout(config, custom_objects)
        inner = config.pop("inner_optimizer")
        if not isinstance(inner, keras.optimizers.Optimizer):
            inner = keras.saving.deserialize_keras_object(inner, custom_objects=custom_objects)
        if not config.get("dynamic", True):
            config.pop("dynamic_growth_steps", None)  # None in a fixed scale's config
        return cls(inner, **config)  # type: ignore[call-arg]


def _from_tf23_layout(config: dict[str, Any], custom_objects: Any) -> dict[str, Any]:
    """TensorFlow 2.3's config (`optimizer`, and `loss_scale` as a
    serialized `FixedLossScale` or `DynamicLossScale`) in today's layout;
    a `DynamicLossScale`'s multiplier becomes `growth_factor`."""
    where = f"{OWNER}.from_config"
    if "optimizer" not in config or not isinstance(config.get("loss_scale"), dict):
        fail(
            where,
            "config",
            config,
            "a LossScaleOptimizer config: with `inner_optimizer` (Keras 3, tf.keras), or with "
            "`optimizer` and a serialized `loss_scale` (TensorFlow 2.3)",
        )
    rest = {key: value for key, value in config.items() if key not in ("optimizer", "loss_scale")}
    # Its optimizer config names a built-in class without a module.
    rest["inner_optimizer"] = keras.optimizers.deserialize(config["optimizer"], custom_objects=custom_objects)
    loss_scale = config["loss_scale"]
    settings = loss_scale.get("config", {})
    kind = loss_scale.get("class_name")
    if kind == "FixedLossScale" and "loss_scale_value" in settings:
        return {**rest, "dynamic": False, "initial_scale": settings["loss_scale_value"]}
    if kind == "DynamicLossScale":
        scale = {
            "initial_scale": settings.get("initial_loss_scale", 2.0**15),
            "dynamic_growth_steps": settings.get("increment_period", 2000),
        }
        if settings.get("multiplier", 2.0) != 2.0:
            scale["growth_factor"] = settings["multiplier"]
        return {**rest, **scale}
    fail(where, "config['loss_scale']", loss_scale, "a serialized FixedLossScale or DynamicLossScale")
