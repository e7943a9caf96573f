"""``Updater``: the jitted update (``rl.train_step.update_step``) for one model, update config and optimizer, on a
mesh, with its program compiled ahead of time (``compile_ahead``)."""

from __future__ import annotations

import threading
from typing import Optional

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from mtrl_jax.compile_ahead import Programs
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.sharding import abstract_batch, activate, on_mesh, place_batch
from mtrl_jax.rl.batch import TrajectoryBatch
from mtrl_jax.rl.optimizer import TrainState, init_state
from mtrl_jax.rl.train_step import UpdateConfig, update_step
from mtrl_jax.rl.turn_credit import empty_turn_rewards


class Updater:
    """``update_step`` jitted for one model, update config and optimizer. With a ``mesh`` it runs with
    the logical-axis rules active and the batch split over ``data`` x ``fsdp``; the train state keeps
    the parameters' shardings (the optimizer state follows them). The parameters that do not train (the base
    under LoRA adapters: ``lora.Policy.base``) are an argument of every call, never held here."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        config: UpdateConfig,
        tx: optax.GradientTransformation,
        mesh: Optional[Mesh] = None,
    ):
        self.model_cfg, self.config, self.tx, self.mesh = model_cfg, config, tx, mesh

        # The optimizer state is donated: the new moments are written over the old ones, which saves
        # twice the parameters' size (Adam) at the update's peak. The parameters are not: they are
        # also the collector's published parameters, in use until the new ones are published.
        def step_fn(params, opt_state, step, rng, batch, ref_params, frozen):
            return update_step(
                model_cfg, config, tx, TrainState(params, opt_state, step, rng), batch, ref_params, frozen
            )

        self._update = jax.jit(step_fn, donate_argnames=("opt_state",))
        self._programs = Programs("update")  # signature -> the program compile_ahead() compiled ahead of time

    @staticmethod
    def _signature(batch: TrajectoryBatch, ref_params) -> tuple:
        """What selects a compiled program besides the (fixed) train state: the batch's shapes and
        dtypes, its group size, and whether there is a KL reference."""
        arrays = (batch.tokens, batch.attention_mask, batch.loss_mask, batch.behav_logp, batch.reward)
        return tuple((tuple(x.shape), str(x.dtype)) for x in arrays) + (batch.group_size, ref_params is None)

    def init_state(self, params, rng) -> TrainState:
        with activate(self.mesh):
            return on_mesh(init_state(self.tx, params, rng), self.mesh)

    def lower(self, state: TrainState, batch: TrajectoryBatch, ref_params=None, base=None):
        """The update lowered for these arguments (arrays or ``jax.ShapeDtypeStruct`` with shardings), for
        ``.compile()`` and its memory and cost analyses (``tools/plan_scale.py``); ``base``: the parameters
        that do not train (``{}`` without adapters)."""
        with activate(self.mesh):
            return self._update.lower(*state, batch, ref_params, {} if base is None else base)

    def compile_ahead(
        self, state: TrainState, rows: int, length: int, group_size: int, with_reference: bool, base=None
    ) -> threading.Thread:
        """Compile the update for ``[rows, length]`` batches ahead of time in a background thread, so
        the first real update finds its program ready. The trainer starts this before the cold start and
        the first evaluation, which leave a core idle. Only compiled, never run: running it would hold
        a second train state and the update's buffers while the evaluation holds its KV cache."""
        credit = self.config.turn_credit  # per-search credit: the batch carries its turns' rewards (make_batch's)
        empty = TrajectoryBatch(
            np.zeros((rows, length), np.int32),
            np.zeros((rows, length), np.int32),
            np.zeros((rows, length), np.float32),
            np.zeros((rows, length), np.float32),
            np.zeros((rows,), np.float32),
            group_size=group_size,
            turns=None if credit is None else empty_turn_rewards(rows, length, credit.max_turns),
        )
        ref = state.params if with_reference else None
        lower = lambda: self.lower(state, abstract_batch(empty, self.mesh), ref, base)  # noqa: E731 - nothing runs
        return self._programs.compile_in_background(self._signature(empty, ref), lower, "update-compile")

    def settle(self) -> None:
        """Wait for the background compiles (``warm``): a process must not exit while XLA compiles in a thread."""
        self._programs.settle()

    def update(self, state: TrainState, batch: TrajectoryBatch, ref_params=None, base=None) -> tuple[TrainState, dict]:
        """The new state and the metrics as device scalars (fetch them with ``jax.device_get``); ``base``: the
        parameters that do not train, which the forward pass sees (``{}`` without adapters).
        ``state.opt_state`` is donated: use the returned state's; ``state.params`` stay valid."""
        args = (*state, place_batch(batch, self.mesh), ref_params, {} if base is None else base)
        with activate(self.mesh):  # the program compile_ahead() compiled (waiting for it if it is compiling), or jit's
            return self._programs.run(self._signature(batch, ref_params), self._update, args)
