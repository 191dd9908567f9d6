"""The one recipe for a `train_step` of your own, on every backend: the
same verbs (`loss_scaling()`: scale, unscale, check, apply_if_finite,
commit, finish) in each backend's form of Keras's step, and the same
guarantees: a skipped step leaves every variable as it was, the scale that
moved is the one reported, two optimizers share one decision."""

from __future__ import annotations

import keras
import numpy as np
from backend_helpers import data as _data
from backend_helpers import functional as _functional
from backend_helpers import state as _state

import mp_callbacks as mp

BACKEND = keras.backend.backend()


def _recipe_class():
    """The recipe in each backend's form: body and head trained by two
    optimizers (JAX's stateless step carries one optimizer's state: one
    there)."""
    if BACKEND == "jax":
        import jax

        class Recipe(mp.MixedPrecisionModel):
            def train_step(self, state, data):
                trainable, non_trainable, optimizer_vars, metrics_vars = state
                x, y = data
                scaling = self.loss_scaling(non_trainable)

                def loss_fn(values):
                    y_pred, new_non_trainable = self.stateless_call(values, non_trainable, x, training=True)
                    loss = keras.ops.mean((y - y_pred) ** 2)
                    return scaling.scale(loss), (loss, new_non_trainable)

                (_, (loss, written)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
                grads = scaling.unscale(grads)
                outcome = scaling.check(grads, loss)
                trainable, optimizer_vars = scaling.apply_if_finite(
                    outcome, self.optimizer, optimizer_vars, grads, trainable
                )
                non_trainable = scaling.commit(outcome, list(written), list(non_trainable))
                non_trainable, logs = scaling.finish(outcome, non_trainable, x.shape[0])
                return {"loss": loss, **logs}, (trainable, non_trainable, optimizer_vars, metrics_vars)

        return Recipe

    class Recipe(mp.MixedPrecisionModel):
        def compile(self, **kwargs):
            super().compile(optimizer=keras.optimizers.Adam(1e-3), auto_scale_loss=False, **kwargs)
            self.head_optimizer = keras.optimizers.SGD(1e-2)

        def _parts(self):
            head = self.layers[-1].trainable_weights
            return [w for w in self.trainable_weights if all(w is not h for h in head)], head

        def _apply(self, scaling, outcome, grads, body, head):
            scaling.apply_if_finite(outcome, self.optimizer, grads[: len(body)], body)
            scaling.apply_if_finite(outcome, self.head_optimizer, grads[len(body) :], head)

    if BACKEND == "torch":

        class TorchRecipe(Recipe):
            def train_step(self, data):
                x, y = data
                body, head = self._parts()
                scaling = self.loss_scaling()
                with scaling.forward() as forward:
                    y_pred = self(x, training=True)
                    self.zero_grad()
                    loss = keras.ops.mean((y - y_pred) ** 2)
                scaling.scale(loss).backward()
                grads = scaling.unscale([w.value.grad for w in body + head])
                outcome = scaling.check(grads, loss)
                self._apply(scaling, outcome, grads, body, head)
                scaling.commit(outcome, forward)
                return {"loss": loss, **scaling.finish(outcome, x.shape[0])}

        return TorchRecipe

    import tensorflow as tf

    class TensorFlowRecipe(Recipe):
        def train_step(self, data):
            x, y = data
            body, head = self._parts()
            scaling = self.loss_scaling()
            with tf.GradientTape() as tape:
                with scaling.forward() as forward:
                    y_pred = self(x, training=True)
                    loss = keras.ops.mean((y - y_pred) ** 2)
                scaled = scaling.scale(loss)
            grads = scaling.unscale(tape.gradient(scaled, body + head))
            outcome = scaling.check(grads, loss)
            self._apply(scaling, outcome, grads, body, head)
            scaling.commit(outcome, forward)
            return {"loss": loss, **scaling.finish(outcome, tf.shape(x)[0])}

    return TensorFlowRecipe


def _every_state(model):
    state = _state(model)
    head_optimizer = getattr(model, "head_optimizer", None)
    if head_optimizer is not None:
        state.update({f"head/{v.path}": np.array(v.numpy()) for v in head_optimizer.variables})
    return state


def test_the_one_recipe_skips_exactly_and_reports_the_scale_that_moved():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _functional(_recipe_class(), loss_scale={"initial_scale": 2.0**20, "growth_interval": 1000})
    if BACKEND == "jax":
        model.compile(keras.optimizers.Adam(1e-3), auto_scale_loss=False)
    else:
        model.compile()
    x, y = _data(64)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history
    state = model.loss_scale_state()
    # 2**20 overflows float16's gradients: the scale backed off, and every
    # report says where it went.
    assert 1 <= state["skipped_steps"] < 8 and state["step_count"] == 8  # one update a step
    assert (
        history["loss_scale"]
        == [state["scale"]]
        == [model.get_scale()]
        == [2.0 ** (20 - state["skipped_steps"])]
    )
    assert history["skipped_steps"] == [float(state["skipped_steps"])]
    if BACKEND != "jax":
        assert (
            int(model.optimizer.iterations.numpy())
            == int(model.head_optimizer.iterations.numpy())
            == 8 - state["skipped_steps"]
        )

    before = _every_state(model)
    assert any("moving_mean" in path for path in before) and any("seed_generator" in path for path in before)
    bad = x[:8].copy()
    bad[3, 1] = np.nan
    history = model.fit(bad, y[:8], batch_size=8, epochs=1, verbose=0).history
    after = _every_state(model)
    changed = [path for path in before if not np.array_equal(before[path], after[path])]
    assert changed == []
    assert history["skipped_steps"] == [1.0]
    assert model.loss_scale_state()["scale"] == state["scale"]  # bad data: no back-off
    assert model.loss_scale_state()["nonfinite_loss_steps"] == 1
