"""keras-tuner glue: the dtype policy (and the loss scale) as hyperparameters.

keras-tuner builds every trial's model under whatever global dtype policy
is set, and a build function that calls `set_global_policy` leaks its
choice into the next trial and past the search. `MixedPrecisionHyperModel`
makes the policy a hyperparameter and sets it only while the trial's model
is built: layers keep the policy they were built with, and the global
policy is back to what it was before `build` returns.

    import keras_tuner as kt
    from mp_callbacks.tuner import MixedPrecisionHyperModel

    hypermodel = MixedPrecisionHyperModel(build_model, policies=["float32", "mixed_bfloat16"])
    tuner = kt.RandomSearch(hypermodel, objective=kt.Objective("epoch_time", "min"), max_trials=4)
    tuner.search(x, y, epochs=2, callbacks=[EpochTimer(), LossScaleMonitor(), NaNGradientMonitor()])

Importing this module needs keras-tuner: `pip install "mp_callbacks[tuner]"`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mp_callbacks import LossScaler, MixedPrecisionModel  # this backend's
from mp_callbacks._backend import keras
from mp_callbacks._model_building import policy_scope
from mp_callbacks._scale_state import check_scale
from mp_callbacks._validation import fail
from mp_callbacks.hardware import POLICIES

try:
    import keras_tuner as kt
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "mp_callbacks.tuner needs keras-tuner (and tensorboard, which keras-tuner "
        'imports in every trial): pip install "mp_callbacks[tuner]"'
    ) from error

__all__ = ["LOSS_SCALE_HP_PREFIX", "POLICY_HP", "MixedPrecisionHyperModel", "policy_scope"]

#: Name of the dtype-policy hyperparameter.
POLICY_HP = "dtype_policy"
#: Prefix of the loss-scale hyperparameters (`loss_scale_initial_scale`, ...).
LOSS_SCALE_HP_PREFIX = "loss_scale_"

_LOSS_SCALE_ARGS = (
    "initial_scale",
    "growth_interval",
    "growth_factor",
    "backoff_factor",
    "min_scale",
    "max_scale",
    "hysteresis",
)


class MixedPrecisionHyperModel(kt.HyperModel):
    """A hypermodel whose dtype policy (and loss scale) are hyperparameters.

    Args:
        hypermodel: `kt.HyperModel` or callable. A hypermodel, or a build
            function `build(hp)` that returns a compiled model (a
            `MixedPrecisionModel` for `loss_scale_space`).
        policies: sequence of str. The dtype policies to choose from
            (hyperparameter `"dtype_policy"`). Defaults to
            `("float32", "mixed_bfloat16")`.
        loss_scale_space: dict or None. `{argument: [values]}` over
            `LossScaler` arguments, e.g.
            `{"initial_scale": [2**10, 2**15], "hysteresis": [1, 2]}`; each
            becomes a hyperparameter `"loss_scale_<argument>"`, active only
            in trials whose policy computes in float16 (loss scaling does
            nothing for float32 and bfloat16), and those trials' models get
            that `LossScaler`. Needs a float16 policy among `policies`.
            Defaults to None.
        name: str or None. As for `kt.HyperModel`. Defaults to None.
        tunable: bool. As for `kt.HyperModel`. Defaults to `True`.
    """

    def __init__(
        self,
        hypermodel: kt.HyperModel | Callable[[Any], keras.Model],
        policies: Sequence[str] = ("float32", "mixed_bfloat16"),
        loss_scale_space: dict[str, Sequence[Any]] | None = None,
        name: str | None = None,
        tunable: bool = True,
    ) -> None:
        super().__init__(name=name, tunable=tunable)
        policies = list(policies)
        unknown = [p for p in policies if p not in POLICIES]
        if not policies or unknown:
            fail(
                "MixedPrecisionHyperModel",
                "policies",
                policies,
                f"a non-empty list from {', '.join(POLICIES)}",
            )
        for argument, values in (loss_scale_space or {}).items():
            if argument not in _LOSS_SCALE_ARGS or not list(values):
                fail(
                    "MixedPrecisionHyperModel",
                    "loss_scale_space",
                    {argument: values},
                    f"a dict from LossScaler arguments ({', '.join(_LOSS_SCALE_ARGS)}) "
                    "to non-empty lists of values",
                )
            for value in values:  # refused now, not in the middle of a search
                if argument in ("initial_scale", "min_scale", "max_scale"):
                    # Their bounds depend on each other: checked alone here.
                    check_scale("MixedPrecisionHyperModel", f"loss_scale_space[{argument!r}]", value)
                else:
                    LossScaler(**{argument: value})
        self.hypermodel = hypermodel
        self.policies = policies
        self.loss_scale_space = {k: list(v) for k, v in (loss_scale_space or {}).items()}
        self._float16_policies = [
            p for p in policies if keras.dtype_policies.get(p).compute_dtype == "float16"
        ]
        if self.loss_scale_space and not self._float16_policies:
            fail(
                "MixedPrecisionHyperModel",
                "loss_scale_space",
                loss_scale_space,
                f"given only with a float16 policy among the policies ({', '.join(policies)} "
                "compute in float32 or bfloat16, where a loss scale does nothing)",
            )

    def build(self, hp: kt.HyperParameters) -> keras.Model:
        policy = hp.Choice(POLICY_HP, self.policies)
        with policy_scope(policy):
            if isinstance(self.hypermodel, kt.HyperModel):
                model = self.hypermodel.build(hp)
            else:
                model = self.hypermodel(hp)
            if self.loss_scale_space:
                if not isinstance(model, MixedPrecisionModel):
                    raise TypeError(
                        "MixedPrecisionHyperModel: `loss_scale_space` needs the build "
                        f"function to return a MixedPrecisionModel; got {type(model).__name__}."
                    )
                with hp.conditional_scope(POLICY_HP, self._float16_policies):
                    settings = {
                        argument: hp.Choice(LOSS_SCALE_HP_PREFIX + argument, values)
                        for argument, values in self.loss_scale_space.items()
                    }
                if policy in self._float16_policies:
                    model.set_loss_scale(LossScaler(**settings))
        return model

    def fit(self, hp: kt.HyperParameters, model: keras.Model, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.hypermodel, kt.HyperModel):
            return self.hypermodel.fit(hp, model, *args, **kwargs)
        return model.fit(*args, **kwargs)
