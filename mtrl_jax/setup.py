"""From a configuration to the components of a run, used by training and evaluation alike.

``build(config, workdir)`` converts the ``ml_collections`` config once into frozen dataclasses and
builds, in order: the data (collections, train/validation split, mixture), the search environment,
the chat format (tokenizer), the mesh, the policy (an HF checkpoint or the tiny default model), the
optimizer and the jitted updater. It returns them as one frozen ``Components`` value. Invalid values
are reported here, naming the field, before anything expensive runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Any, Mapping, Optional

import jax
import optax

from mtrl_jax import distributed, ranges
from mtrl_jax.coldstart.settings import ColdStartSettings, coldstart_settings
from mtrl_jax.chat import ChatFormat
from mtrl_jax.chat_build import build_chat, resolve_tool_prompt
from mtrl_jax.data.build import build_data, csv, load_collections, split_sizes  # noqa: F401 - the entry points' names
from mtrl_jax.data.collection import Collection, Task
from mtrl_jax.data.schedule import TaskSchedule
from mtrl_jax.model import ModelConfig
from mtrl_jax.model.build import build_model, check_kv_cache, check_model_fields
from mtrl_jax.model.sharding import make_mesh
from mtrl_jax.model.lora import Policy
from mtrl_jax.rl.advantages import ESTIMATORS
from mtrl_jax.rl.batch import REWARD_BASELINES, bucket
from mtrl_jax.rl.losses import LOSSES
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.registry import parse_options
from mtrl_jax.rl.optimizer import make_optimizer
from mtrl_jax.rl.train_step import UpdateConfig
from mtrl_jax.rl.turn_credit import TURN_REWARDS, TurnCreditConfig
from mtrl_jax.rl.updater import Updater
from mtrl_jax.rollout.collector import CollectorConfig
from mtrl_jax.rollout.interfaces import Environment, EnvironmentRouter
from mtrl_jax.rollout.selection import TRUNCATION_MODES, GroupSelector
from mtrl_jax.search.build import SearchSettings, index_description, make_environment
from mtrl_jax.search.env import SearchEnvConfig
from mtrl_jax.search.curriculum import hard_tasks, one_search_scores
from mtrl_jax.search.tools import check_service


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What the training loop itself needs."""

    seed: int
    global_batch_size: int
    group_size: int
    total_steps: int  # RL steps of the run
    asynchronous: bool
    max_staleness: int
    batch_length: int  # T of every update batch: rollout.max_len rounded up to rl.length_bucket (one program)
    checkpoint_every: int
    checkpoint_keep: int
    eval_every: int
    eval_temperature: float
    log_trajectories: bool
    log_progress: bool
    max_nonfinite_steps: int  # RL steps in a row with a skipped (non-finite) optimizer step before the run stops
    filter_groups: bool = False  # drop groups whose rewards are all equal (rollout.selection)
    filter_max_extra_groups: int = 0  # with filter_groups: extra groups a step may generate to refill its batch
    truncation: str = "penalty"  # failed episodes: "penalty" (trained with reward -1) or "mask" (no gradient)
    eval_before_warmup: bool = False  # evaluate the base policy before the cold start too (summary.json's "base")


@dataclasses.dataclass(frozen=True)
class Components:
    collections: Mapping[str, Collection]
    train_tasks: tuple  # the cold start's demonstrations are of these
    rl_tasks: tuple  # RL's: train_tasks, or with data.curriculum_max_baseline the hard ones among them
    dev_tasks: tuple
    env: Environment
    chat: ChatFormat
    mesh: Any  # the global mesh: update, cold start, log-prob recomputation
    rollout_mesh: Any  # this process's devices (the global mesh itself with one process): rollouts
    model_cfg: ModelConfig
    policy: Policy  # the initial policy: its base (frozen under LoRA adapters; {} without) and trainable parameters
    tx: optax.GradientTransformation
    updater: Updater
    collector: CollectorConfig
    schedule: TaskSchedule
    run: RunSettings
    warmup: Optional[ColdStartSettings]  # None: no supervised cold start (a real checkpoint, or warmup.steps=0)
    selector: GroupSelector  # which groups of an RL step train
    # rl.reward_baseline="one_search": each training task's best one-search nDCG@10, subtracted from its rewards
    # in the update (make_batch's reward_offset); None: rewards as they are
    reward_baseline: Optional[Mapping[str, float]] = None


# ----------------------------------------------------------------------------- data and environment


def search_settings(config) -> SearchSettings:
    return SearchSettings(
        tools=tuple(csv(config.search.tools)),
        encoder=config.search.encoder,
        tfidf_dim=config.search.tfidf_dim,
        index_type=config.search.index_type,
        top_k=config.search.top_k,
        max_doc_chars=config.search.max_doc_chars,
        max_queries=config.search.max_queries,
        cache_dir=config.search.cache_dir or None,
        remote_url=config.search.remote_url or None,
        remote_deadline_s=config.search.remote_deadline_s,
        remote_max_failures=config.search.remote_max_failures,
    )


def build_environment(config, collections: Mapping[str, Collection]) -> EnvironmentRouter:
    settings = search_settings(config)
    if config.search.remote_url:  # a dead server, one without these collections, or with other ones: an error now
        indexes = {name: index_description(c, settings) for name, c in collections.items()}
        check_service(config.search.remote_url, list(collections), settings.tools, indexes=indexes)
    env_cfg = SearchEnvConfig(
        max_turns=config.env.max_turns,
        answer_fallback=config.env.answer_fallback,
        max_answer_docs=config.env.max_answer_docs,
        tool_prompt=resolve_tool_prompt(config),
        repeated_calls=config.env.repeated_calls,
    )
    return EnvironmentRouter({name: make_environment(c, settings, env_cfg) for name, c in collections.items()})


# ----------------------------------------------------------------------------- model and update


def update_config(config) -> UpdateConfig:
    """``rl.*`` as an ``UpdateConfig``; loss and estimator options pass through by name and are
    checked against the registered function (an option it does not take is an error); an option
    scoped to another entry (``grpo:scale=batch`` with ``rl.advantage=rloo``) does not apply."""
    rl = config.rl
    norm_len = config.rollout.max_len if rl.aggregation == "seq-mean-token-sum-norm" else None
    return UpdateConfig(
        objective=ObjectiveConfig(
            loss=rl.loss,
            loss_options=tuple(sorted(parse_options(rl.loss_options, "rl.loss_options", LOSSES, rl.loss).items())),
            aggregation=rl.aggregation,
            norm_len=norm_len,
            tis_cap=rl.tis_cap,
            kl_coef=rl.kl_coef,
            kl_estimator=rl.kl_estimator,
            entropy_coef=rl.entropy_coef,
        ),
        advantage=rl.advantage,
        advantage_options=tuple(
            sorted(parse_options(rl.advantage_options, "rl.advantage_options", ESTIMATORS, rl.advantage).items())
        ),
        # the sampler's convention: temperature <= 0 is greedy, and its behaviour log-probs are at temperature 1
        temperature=config.rollout.temperature if config.rollout.temperature > 0 else 1.0,
        old_logp=rl.old_logp,
        update_epochs=rl.update_epochs,
        mini_batches=rl.mini_batches,
        micro_batches=rl.micro_batches,
        logprob_chunk=rl.logprob_chunk,
        length_bucket=rl.length_bucket,
        skip_zero_advantage=rl.skip_zero_advantage,
        turn_credit=turn_credit_config(config),
    )


def turn_credit_config(config) -> Optional[TurnCreditConfig]:
    """``rl.turn_*`` as a ``TurnCreditConfig``, or None when ``rl.turn_reward`` is ``"none"``."""
    rl = config.rl
    if rl.turn_reward not in TURN_REWARDS:
        raise ValueError(f"rl.turn_reward must be one of {TURN_REWARDS}, got {rl.turn_reward!r}")
    if rl.turn_reward == "none":
        return None
    return TurnCreditConfig(config.env.max_turns, rl.turn_coef, rl.turn_gamma, rl.turn_redundancy, rl.turn_std_floor)


def collector_config(config) -> CollectorConfig:
    r = config.rollout
    if r.param_dtype not in ("", "float32", "bfloat16"):
        raise ValueError(f"rollout.param_dtype must be '', 'float32' or 'bfloat16', got {r.param_dtype!r}")
    return CollectorConfig(
        slots=config.rollout_max_concurrency,
        max_len=r.max_len,
        max_tokens_per_turn=r.max_tokens_per_turn,
        decode_chunk=r.decode_chunk,
        temperature=r.temperature,
        top_p=r.top_p,
        tool_workers=r.tool_workers,
        precompile=r.precompile,
        share_prefixes=r.share_prefixes,
        param_dtype=r.param_dtype,
    )


def run_settings(config, rows_divisor: int) -> RunSettings:
    """Checked before any data is loaded; ``total_steps`` is filled in once the task count is known."""
    if config.rl.filter_max_extra_groups and not config.rl.filter_groups:
        raise ValueError(
            "rl.filter_max_extra_groups > 0 refills the groups rl.filter_groups drops: set rl.filter_groups=True"
        )
    if config.rl.reward_baseline not in REWARD_BASELINES:
        raise ValueError(f"rl.reward_baseline must be one of {REWARD_BASELINES}, got {config.rl.reward_baseline!r}")
    if config.rl.truncation not in TRUNCATION_MODES:
        raise ValueError(f"rl.truncation must be one of {TRUNCATION_MODES}, got {config.rl.truncation!r}")
    rows = config.global_batch_size * config.rollout.group_size
    if rows % rows_divisor:
        raise ValueError(
            f"rl.mini_batches x rl.micro_batches = {rows_divisor} does not divide the {rows} trajectories of a "
            f"step (global_batch_size x rollout.group_size)"
        )
    return RunSettings(
        seed=config.seed,
        global_batch_size=config.global_batch_size,
        group_size=config.rollout.group_size,
        total_steps=0,
        asynchronous=config.rollout.asynchronous,
        max_staleness=config.rollout.max_staleness,
        batch_length=bucket(config.rollout.max_len, config.rl.length_bucket),
        checkpoint_every=config.checkpoint.every_steps,
        checkpoint_keep=config.checkpoint.keep,
        eval_every=config.eval.every_steps,
        eval_temperature=config.eval.temperature,
        log_trajectories=config.log.trajectories,
        log_progress=config.log.progress,
        max_nonfinite_steps=config.rl.max_nonfinite_steps,
        filter_groups=config.rl.filter_groups,
        filter_max_extra_groups=config.rl.filter_max_extra_groups,
        truncation=config.rl.truncation,
        eval_before_warmup=config.eval.before_warmup,
    )


def use_compilation_cache(config) -> Optional[str]:
    """Point JAX's persistent compilation cache at ``config.compilation_cache_dir`` (``~`` expanded)
    and cache every program that took at least 0.2 s to compile; a cache directory JAX already has
    (``JAX_COMPILATION_CACHE_DIR``) is left as it is. Returns the directory in use (None: off). Call
    it before anything is compiled: JAX decides once per process whether it uses the cache."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if not config.compilation_cache_dir:
        return None
    path = os.path.expanduser(config.compilation_cache_dir)
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return path


def shortest_prompt(env: Environment, chat: ChatFormat, corpora) -> int:
    """A lower bound on the prompt length of every episode of ``corpora``: each corpus's prompt of an
    empty question (a question only adds tokens to it). The update and the sampler compile no program
    for the lengths below it (``UpdateConfig.min_length``, ``CollectorConfig.min_prompt``); a bound
    that were too high would cost padding or a compile on demand, never a wrong result."""
    return min(
        len(chat.prompt(env.reset(Task(f"{corpus}/shortest-prompt", "", {}, corpus))[1])) for corpus in sorted(corpora)
    )


def check_config(config) -> tuple[UpdateConfig, CollectorConfig, Optional[ColdStartSettings], RunSettings]:
    """Every check a config's own fields allow, with no data, model or file read: ranges, the model fields, the
    update, the collector, the cold start and the run (each raises a ``ValueError`` naming its field); returns those
    settings. The entry points call it before they create anything; ``build`` starts from it."""
    ranges.check(config)
    check_model_fields(config)
    update_cfg = update_config(config)
    return (
        update_cfg,
        collector_config(config),
        coldstart_settings(config),
        run_settings(config, update_cfg.rows_per_micro_batch_divisor),
    )


def build(config, workdir: pathlib.Path, train_tokenizer_if_missing: bool = True, data=None) -> Components:
    """Every component of a run of ``config`` whose files live in ``workdir``; ``data``: ``build_data(config)``
    when the caller has it already."""
    workdir = pathlib.Path(workdir)
    update_cfg, collector_cfg, warmup, run = check_config(config)  # cheap checks first: before any data is loaded
    use_compilation_cache(config)
    collections, train_tasks, dev_tasks = build_data(config) if data is None else data
    rl_tasks = train_tasks  # the cold start demonstrates every training query; RL may take the hard ones only
    if config.data.curriculum_max_baseline > 0:  # the hard training queries only (search/curriculum.py)
        rl_tasks, counts = hard_tasks(
            collections, train_tasks, search_settings(config), config.data.curriculum_max_baseline
        )
        logging.getLogger("mtrl_jax").info("curriculum: training queries kept %s", counts)
    reward_baseline = None
    if config.rl.reward_baseline == "one_search":  # s3's gain over a fixed retrieval (docs/algorithms.md)
        reward_baseline = one_search_scores(collections, rl_tasks, search_settings(config))
    schedule = TaskSchedule(rl_tasks, config.global_batch_size)
    total = config.max_epochs * schedule.steps_per_epoch
    run = dataclasses.replace(run, total_steps=min(total, config.max_steps) if config.max_steps else total)
    env = build_environment(config, collections)
    chat = build_chat(config, workdir, collections, env, train_tokenizer_if_missing)
    shortest = shortest_prompt(env, chat, {task.corpus for task in (*train_tasks, *dev_tasks)})
    update_cfg = dataclasses.replace(update_cfg, min_length=shortest)
    collector_cfg = dataclasses.replace(collector_cfg, min_prompt=shortest)
    mesh = make_mesh(tuple(config.model.mesh_shape))
    rollout_mesh = distributed.rollout_mesh(mesh)
    rows = rollout_mesh.shape["data"] * rollout_mesh.shape["fsdp"]
    if collector_cfg.slots % rows:
        raise ValueError(
            f"rollout_max_concurrency={collector_cfg.slots} (generation rows per process) must be a multiple of "
            f"the {rows} devices the rows are split over (data x fsdp of the rollout mesh {dict(rollout_mesh.shape)})"
        )
    check_kv_cache(config, -(-collector_cfg.slots // rows))  # the rows one device holds
    model_cfg, frozen, params = build_model(config, chat.vocab_size, mesh)
    o = config.optim
    tx = make_optimizer(
        o.learning_rate,
        run.total_steps * update_cfg.update_epochs * update_cfg.mini_batches,
        o.schedule,
        o.warmup_steps,
        o.grad_clip,
        o.weight_decay,
    )
    return Components(
        collections=collections,
        train_tasks=tuple(train_tasks),
        rl_tasks=tuple(rl_tasks),
        dev_tasks=tuple(dev_tasks),
        env=env,
        chat=chat,
        mesh=mesh,
        rollout_mesh=rollout_mesh,
        model_cfg=model_cfg,
        policy=Policy(frozen, params),
        tx=tx,
        updater=Updater(model_cfg, update_cfg, tx, mesh),
        collector=collector_cfg,
        schedule=schedule,
        run=run,
        warmup=warmup,
        selector=GroupSelector(
            run.max_staleness,
            run.global_batch_size,
            update_cfg.rows_per_micro_batch_divisor,
            run.filter_groups,
            run.truncation,
            None if update_cfg.turn_credit is None else update_cfg.turn_credit.redundancy,
        ),
        reward_baseline=reward_baseline,
    )
