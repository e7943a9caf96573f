"""The cold start as a stage of a run: trained once (``resume_or_warm_up``: continued exactly after a stop),
then read back (``restore_policy``: the policy a work directory holds after its cold start or its RL steps,
for the resumed run, the evaluation and the export alike). With ``warmup.train_base`` the cold start trains
the base model and RL fresh LoRA adapters over it."""

from __future__ import annotations

from typing import Callable, Optional

import jax

from mtrl_jax.checkpoint import CheckpointError, abstract_state
from mtrl_jax.coldstart.demonstrations import demonstrations
from mtrl_jax.coldstart.sft import WarmupProgress, supervised_warmup, warmup_optimizer
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.lora import Policy


def warm_up(
    components,
    params,
    log=print,
    resume: Optional[WarmupProgress] = None,
    should_stop: Optional[Callable[[], bool]] = None,
) -> WarmupProgress:
    """The cold start of ``params`` (``warmed_parameters``): ``supervised_warmup`` on ``demonstrations``."""
    cfg = components.warmup
    model_cfg, frozen = warmup_model(components)
    demos = demonstrations(components, log)
    log(
        f"warm-up on {len(demos)} scripted demonstrations for {cfg.steps} steps"
        + (f", continuing at step {resume.step}" if resume is not None else "")
    )
    return supervised_warmup(
        model_cfg,
        params,
        demos,
        cfg,
        frozen=frozen,
        mesh=components.mesh,
        resume=resume,
        should_stop=should_stop,
        log=log,
    )


def warmup_model(components) -> tuple[ModelConfig, dict]:
    """``(model config, frozen parameters)`` of the cold start: those of RL (the LoRA adapters train over the
    frozen base, or every parameter), or with ``warmup.train_base`` the base model alone, all of it trained."""
    if components.warmup.train_base:
        return components.model_cfg.replace(lora_rank=0), {}
    return components.model_cfg, components.policy.base


def warmed_parameters(components, trainable):
    """What the cold start trains: RL's ``trainable`` parameters, or with ``warmup.train_base`` the base."""
    return components.policy.base if components.warmup.train_base else trainable


def rl_policy(components, warmed) -> Policy:
    """The policy RL starts from, given what the finished cold start trained (``warmed``): RL's trainable
    parameters over the initial base, or with ``warmup.train_base`` the initial (fresh) adapters over the
    cold-started base."""
    if components.warmup is not None and components.warmup.train_base:
        return Policy(warmed, components.policy.trainable)
    return Policy(components.policy.base, warmed)


def resume_or_warm_up(
    components, checkpoints, params, log=print, should_stop: Optional[Callable[[], bool]] = None
) -> WarmupProgress:
    """The cold start of ``params`` (RL's trainable parameters; the base with ``warmup.train_base``), continued
    from the progress saved in the work directory (``checkpoints.restore_warmup``), its progress saved again
    at the end or when ``should_stop()`` turned true (then ``step < steps``: the caller stops, and the next
    run continues it exactly)."""
    cfg = components.warmup
    params = warmed_parameters(components, params)
    like_opt = jax.eval_shape(warmup_optimizer(cfg.steps, cfg.learning_rate).init, params)
    saved = checkpoints.restore_warmup(params, like_opt)
    progress = (
        None
        if saved is None
        else WarmupProgress(saved[0], saved[1], saved[2]["step"], saved[2]["rng_state"], saved[2]["losses"])
    )
    if progress is None or progress.step < cfg.steps:
        progress = warm_up(components, params, log=log, resume=progress, should_stop=should_stop)
        checkpoints.save_warmup(progress.params, progress.opt_state, progress.step, progress.rng_state, progress.losses)
    return progress


STAGES = ("rl", "warmup")  # what restore_policy reads: RL's latest checkpoint, or the finished cold start


def restore_policy(components, checkpoints, stage: str) -> Policy:
    """The policy a work directory (``checkpoints``) holds, read-only (no checkpoint is moved): with
    ``stage="warmup"`` the one RL started from (its finished cold start); with ``stage="rl"`` RL's latest
    checkpoint, its trainable parameters over the base RL trained over (with ``warmup.train_base``, the one the
    cold start trained). A resumed run takes its base from here, and the evaluation and the export the whole of it."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: one of {STAGES}")
    train_base = components.warmup is not None and components.warmup.train_base
    why = "warmup.train_base=True, and the RL adapters train over the base the warm-up trained, but its"
    if stage == "warmup":
        if components.warmup is None:
            raise ValueError("the config has no warm-up (warmup.steps=0), so a run of it has no warmed-up policy")
        asked = why if train_base else "the warmed-up policy was asked for, but the"
        return rl_policy(components, restore_finished_warmup(components, checkpoints, asked))
    base = restore_finished_warmup(components, checkpoints, why) if train_base else components.policy.base
    like = abstract_state(components.tx, components.policy.trainable, jax.random.PRNGKey(0))
    restored = checkpoints.restore(like, read_only=True)
    if restored is None:
        raise FileNotFoundError(f"{checkpoints.workdir}: no checkpoint under {checkpoints.workdir / 'checkpoints'}")
    return Policy(base, restored[0].params)


def restore_finished_warmup(components, checkpoints, why: str):
    """What the work directory's finished cold start trained (``warmed_parameters``); a ``CheckpointError`` that
    names the directory (``why`` opens its reason) when the cold start checkpoint is missing or unfinished."""
    cfg = components.warmup
    like = warmed_parameters(components, components.policy.trainable)
    like_opt = jax.eval_shape(warmup_optimizer(cfg.steps, cfg.learning_rate).init, like)
    saved = checkpoints.restore_warmup(like, like_opt)
    if saved is None or saved[2]["step"] < cfg.steps:
        found = "none" if saved is None else f"step {saved[2]['step']} of {cfg.steps}"
        raise CheckpointError(
            f"{checkpoints.warmup_path}: {why} finished warm-up checkpoint is missing (found: {found}); restore "
            "that directory or start over in a new workdir"
        )
    return saved[0]
