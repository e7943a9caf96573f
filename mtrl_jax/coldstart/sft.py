"""The cold start's supervised step and loop: cross-entropy on the demonstrations' assistant tokens, with the
views that make it cheap (first-turn cuts, length groups, the shared prompt computed once, loss columns,
micro-batches) and a progress that a stopped run continues exactly."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtrl_jax.coldstart.masks import assistant_turns, turn_end
from mtrl_jax.coldstart.settings import ColdStartSettings
from mtrl_jax.model import lora
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.sharding import activate, on_mesh, place_batch
from mtrl_jax.rl.batch import bucket, pad_rows
from mtrl_jax.rl.guard import NonFiniteGuard, all_finite
from mtrl_jax.rl.logprobs import logprobs_at, sequence_logprobs, shared_prefix_logprobs


def common_prefix(demos: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
    """The tokens every demonstration ``(tokens, loss mask)`` begins with, up to the first trained
    token of any and leaving each at least one token (the system prompt on the default)."""
    first = demos[0][0]
    n = min(len(t) for t, _ in demos) - 1
    for tokens, mask in demos:
        k = 0
        while k < n and tokens[k] == first[k] and not mask[k]:
            k += 1
        n = k
    return [int(t) for t in first[:n]]


def _pack(demos, length_multiple: int = 8):
    T = bucket(max(len(t) for t, _ in demos), length_multiple)
    return (
        pad_rows([t for t, _ in demos], T, np.int32),
        pad_rows([[1] * len(t) for t, _ in demos], T, np.int32),
        pad_rows([m for _, m in demos], T, np.float32),
    )


@dataclasses.dataclass
class WarmupProgress:
    """Where a supervised cold start stands: enough to continue it exactly (``step`` of ``steps`` done)."""

    params: Any
    opt_state: Any
    step: int
    rng_state: dict  # the batch sampler's numpy bit-generator state
    losses: list


def step_view(i: int, full_every: int, two_turn_every: int) -> str:
    """Which view of the demonstrations cold start step ``i`` (0-based) trains on: ``"full"`` (whole
    ones, one step in ``full_every``), ``"two"`` (cut after their second turn, one of the other steps
    in ``two_turn_every``; 0: never) or ``"first"`` (cut after their first turn)."""
    if (i + 1) % full_every == 0:
        return "full"
    return "two" if two_turn_every and i % two_turn_every == 1 % two_turn_every else "first"


def warmup_optimizer(steps: int, learning_rate: float) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 20), max(steps, 2)), weight_decay=0.0
        ),
    )


def loss_columns(loss_mask: np.ndarray, multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``(columns [B, K], weights [B, K])``: each row's loss-mask positions, padded (column 0, weight 0) to
    ``K``, the longest row's count rounded up to ``multiple`` (a few shapes, few compiles)."""
    counts = loss_mask.sum(axis=1).astype(int)
    K = bucket(max(int(counts.max()), 1), multiple)
    columns, weights = np.zeros((len(loss_mask), K), np.int32), np.zeros((len(loss_mask), K), np.float32)
    for row, mask in enumerate(loss_mask):
        where = np.flatnonzero(mask)
        columns[row, : len(where)], weights[row, : len(where)] = where, mask[where]
    return columns, weights


def warmup_step(
    model_cfg: ModelConfig,
    tx: optax.GradientTransformation,
    shared: np.ndarray,
    logprob_chunk: int = 512,
    columns_only: bool = False,
    micro_batches: int = 1,
):
    """The jitted cold start step ``(params, opt_state, frozen, tokens, attention, loss_mask) -> (params,
    opt_state, loss, finite)``: mean cross-entropy on the loss-mask tokens, trained on ``params`` (the trainable
    parameters; ``frozen`` the rest of the model, ``lora.split``). With a non-empty ``shared`` prefix the
    rows are what follows it, and it is computed once (``shared_prefix_logprobs``). The optimizer state is
    donated; the parameters are not (the caller's may be published).

    ``columns_only``: the step takes ``(columns, weights)`` (``loss_columns``) instead of the loss mask and
    runs the output projection at those columns alone (``logprobs_at``): the same loss and gradients, to
    float rounding, for a fraction of the head's work when most tokens carry no loss (tool results).
    ``micro_batches``: the rows in that many slices, their gradients accumulated (``lax.scan``), so that only
    one slice's activations are held at a time; the same loss and gradient, to float rounding.
    A step whose loss or updated parameters are not finite leaves parameters and optimizer state as they
    were (``finite`` false)."""
    P = len(shared)

    def loss_fn(trainable, frozen, tok, att, mask, normaliser=None):
        params = lora.merge(frozen, trainable)
        if columns_only:
            columns, weights = mask
            prefix = jnp.asarray(shared) if P else None
            logp, _ = logprobs_at(model_cfg, params, tok, att, columns, 1.0, logprob_chunk, prefix=prefix)
            total = weights.sum() if normaliser is None else normaliser
            return -(logp * weights).sum() / jnp.maximum(total, 1.0)
        if P:
            logp, _ = shared_prefix_logprobs(model_cfg, params, jnp.asarray(shared), tok, att, chunk_size=logprob_chunk)
        else:
            logp, _ = sequence_logprobs(model_cfg, params, tok, att, temperature=1.0, chunk_size=logprob_chunk)
        return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, opt_state, frozen, tok, att, mask):
        if micro_batches == 1:
            loss, grads = jax.value_and_grad(loss_fn)(params, frozen, tok, att, mask)
        else:  # every slice normalised by the whole batch's count: their sum is the batch's loss and gradient
            if not columns_only:
                raise ValueError("warm-up micro-batches take the loss columns (columns_only)")
            total = mask[1].sum()
            slices = jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), (tok, att, mask))

            def accumulate(carry, xs):
                loss, grads = jax.value_and_grad(loss_fn)(params, frozen, *xs, normaliser=total)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zero, slices)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & all_finite(new_params)  # else the step is skipped: nothing changes
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt_state, opt_state), loss, finite

    return step


class DemonstrationViews:
    """The demonstrations as the steps see them, packed once: ``full`` (whole, grouped by length in multiples
    of ``full_bucket``), ``first`` (cut after their first turn) and ``two`` (cut after their second turn; None
    when no demonstration has more than two turns or ``two_turn_every`` is 0), each without the ``shared``
    prefix's columns (computed once per step)."""

    def __init__(self, demos, shared_length: int, settings: ColdStartSettings):
        self.demos, self.P, self.bucket = demos, shared_length, settings.full_bucket
        self.full = self._grouped(len)
        first = [(t[: turn_end(m, 1)], m[: turn_end(m, 1)]) for t, m in demos]
        self.first = self._after_prefix(_pack(first))
        # with demonstrations of more than two turns (the teacher's hops), one step in two_turn_every trains on
        # them cut after their second turn: the hop's call (copied from the first results) or the answer there
        hops = settings.two_turn_every and any(assistant_turns(m) > 2 for _, m in demos)
        self.two = self._grouped(lambda m: turn_end(m, 2)) if hops else None

    def _after_prefix(self, packed):
        return tuple(x[:, self.P :] for x in packed)

    def _grouped(self, cut):  # the demonstrations cut by cut(mask), grouped by length
        cuts = [(t[: cut(m)], m[: cut(m)]) for t, m in self.demos]
        group_of = [bucket(len(t), self.bucket) for t, _ in cuts]
        groups = {}
        for length in sorted(set(group_of)):
            members = [i for i, g in enumerate(group_of) if g == length]
            groups[length] = np.array(members), self._after_prefix(_pack([cuts[i] for i in members], self.bucket))
        return group_of, groups

    def batch(self, view: str, rng: np.random.Generator, batch_size: int):
        """``(tokens, attention, loss mask)`` of a batch of ``view`` (``step_view``'s), drawn with ``rng``."""
        grouped = {"full": self.full, "two": self.two, "first": None}[view]
        if grouped is not None:  # a demonstration drawn, its batch filled from its length group
            group_of, groups = grouped
            members, (tokens, attention, loss_mask) = groups[group_of[int(rng.integers(len(self.demos)))]]
            idx = rng.choice(len(members), size=batch_size, replace=len(members) < batch_size)
        else:
            tokens, attention, loss_mask = self.first
            idx = rng.choice(len(self.demos), size=min(batch_size, len(self.demos)), replace=False)
        return tokens[idx], attention[idx], loss_mask[idx]


def supervised_warmup(
    model_cfg: ModelConfig,
    params,
    demos: Sequence[tuple[list[int], list[int]]],
    settings: ColdStartSettings,
    *,
    frozen=None,
    mesh=None,
    resume: Optional[WarmupProgress] = None,
    should_stop: Optional[Callable[[], bool]] = None,
    log=print,
) -> WarmupProgress:
    """Cross-entropy on the demonstrations' assistant tokens, ``settings.steps`` steps. Returns the progress:
    ``step == steps`` when done, fewer when ``should_stop()`` turned true (then ``resume=`` the progress
    continues exactly where it stopped). ``params`` are the trainable parameters (the LoRA adapters; ``frozen``
    the rest of the model, or None when every parameter trains).

    The first assistant turn (the tool call, which has to copy the question) carries most of what there is to
    learn, and it comes early in the sequence: so every step but one in ``full_every`` trains on the
    demonstrations cut after their first turn, which is several times cheaper; one of those in
    ``two_turn_every`` on them cut after their second turn, so the hop's copy and the choice between hopping
    and answering are learnt too (``DemonstrationViews``, ``step_view``). A full step draws a demonstration and
    fills its batch from its length group, so a few long tool responses do not pad every batch. With
    ``share_prefix``, the tokens every demonstration opens with (``common_prefix``: the system prompt) are
    computed once per step (``shared_prefix_logprobs``: the same loss and gradients).
    A step with a non-finite loss or updated parameters is skipped (a warning); ``max_nonfinite_steps`` of them
    in a row, or all of the steps run, stop the cold start with a ``FloatingPointError`` (``NonFiniteGuard``).
    """
    s = settings
    tx = warmup_optimizer(s.steps, s.learning_rate)
    shared = np.asarray(common_prefix(demos) if s.share_prefix else [], np.int32)
    if log and len(shared):
        log(f"warm-up: the {len(shared)} tokens every demonstration opens with are computed once per step")
    views = DemonstrationViews(demos, len(shared), s)
    frozen = {} if frozen is None else frozen
    step = warmup_step(model_cfg, tx, shared, s.logprob_chunk, s.loss_columns_only, s.micro_batches)
    rng = np.random.default_rng(s.batch_seed)
    if resume is None:
        opt_state, start, losses = on_mesh(tx.init(params), mesh), 0, []
    else:
        params, opt_state, start, losses = resume.params, resume.opt_state, resume.step, list(resume.losses)
        rng.bit_generator.state = resume.rng_state
    if log and start < s.steps:  # XLA compiles each view's program at its first step (minutes on a 2-core CPU)
        log("warm-up: compiling its step (one program per view and length group, at its first use)")
    remedy = f"Nothing of them was saved. Check warmup.learning_rate={s.learning_rate}"
    guard = NonFiniteGuard(s.max_nonfinite_steps, "warm-up", "steps", remedy)
    for i in range(start, s.steps):
        if should_stop is not None and should_stop():
            return WarmupProgress(params, opt_state, i, rng.bit_generator.state, losses)
        tokens, attention, loss_mask = views.batch(step_view(i, s.full_every, s.two_turn_every), rng, s.batch_size)
        with activate(mesh):
            mask = loss_columns(loss_mask) if s.loss_columns_only else loss_mask
            batch = place_batch((tokens, attention, mask), mesh)
            params, opt_state, loss, finite = step(params, opt_state, frozen, *batch)
        guard.observe(i + 1, 0 if bool(finite) else 1)
        if not bool(finite):
            continue
        losses.append(float(loss))
        if log and (i + 1) % s.log_every == 0:
            log(f"warm-up step {i + 1}/{s.steps}: loss {np.mean(losses[-s.log_every :]):.4f}")
    guard.check_some_trained()
    return WarmupProgress(params, opt_state, s.steps, rng.bit_generator.state, losses)
