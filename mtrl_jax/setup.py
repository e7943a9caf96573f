"""From a configuration to the components of a run, used by training and evaluation alike.

``build(config, workdir)`` converts the ``ml_collections`` config once into frozen dataclasses and
builds, in order: the data (collections, train/validation split, mixture), the search environment,
the chat format (tokenizer), the mesh, the policy (an HF checkpoint or the tiny default model), the
optimizer and the jitted updater. It returns them as one frozen ``Components`` value. Invalid values
are reported here, naming the field, before anything expensive runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Mapping, Optional

import jax
import optax

from mtrl_jax import distributed, ranges, rng
from mtrl_jax.chat import ChatFormat, TemplateChat, tokenizer_seed_texts, train_tokenizer
from mtrl_jax.data.collection import Collection, SplitSizes, Task, load_beir, mixture, split
from mtrl_jax.data.schedule import TaskSchedule
from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.model import ModelConfig, init_params, load_hf_checkpoint, lora
from mtrl_jax.model.sharding import make_mesh
from mtrl_jax.model.lora import Policy
from mtrl_jax.rl.advantages import ESTIMATORS
from mtrl_jax.rl.batch import bucket
from mtrl_jax.rl.losses import LOSSES
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.registry import parse_options
from mtrl_jax.rl.train_step import UpdateConfig, Updater, make_optimizer
from mtrl_jax.rollout.collector import CollectorConfig
from mtrl_jax.rollout.interfaces import Environment, EnvironmentRouter
from mtrl_jax.rollout.selection import TRUNCATION_MODES, GroupSelector
from mtrl_jax.search.build import SearchSettings, index_description, make_environment
from mtrl_jax.search.env import SearchEnvConfig
from mtrl_jax.search.tools import check_service
from mtrl_jax.warmup import ANSWERS, HOP_QUERIES, parse_choices, parse_tool_weights, parse_top_k_weights


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


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
    eval_before_warmup: bool = False  # evaluate the base policy before the warm-up too (summary.json's "base")


@dataclasses.dataclass(frozen=True)
class WarmupSettings:
    steps: int
    batch_size: int
    learning_rate: float
    augment: int
    tools: tuple[str, ...]
    tool_probs: tuple[float, ...]  # the scripted teacher's tool choice (warmup.teacher_tools)
    top_ks: tuple[Optional[int], ...]  # and its number of results (warmup.teacher_top_k)
    top_k_probs: tuple[float, ...]
    hop: float  # probability of a second search on an identifier from the first's results (warmup.teacher_hop)
    hop_tool_probs: tuple[float, ...]  # that search's tool choice (warmup.teacher_hop_tools)
    hop_other: bool = False  # that search uses a tool the first did not (warmup.teacher_hop_tools="other")
    hop_drills: int = (
        0  # extra forced-hop demonstrations per question, the decision to hop untrained (warmup.hop_drills)
    )
    share_prefix: bool = True  # the prompt every demonstration opens with computed once per step (warmup.share_prefix)
    full_every: int = 8  # one step in this many trains on whole demonstrations (warmup.full_every)
    two_turn_every: int = (
        2  # one step in this many on the demonstrations cut after their second turn (warmup.two_turn_every)
    )
    hop_queries: tuple[str, ...] = ("identifier",)  # what the second search looks for (warmup.teacher_hop_queries)
    hop_query_probs: tuple[float, ...] = (1.0,)
    answers: tuple[str, ...] = ("empty",)  # how the teacher answers (warmup.teacher_answers)
    answer_probs: tuple[float, ...] = (1.0,)
    samples_per_task: int = 1  # demonstrations drawn per training task (warmup.samples_per_task)
    min_reward: Optional[float] = None  # rejection sampling: keep demonstrations at least this good (warmup.min_reward)
    keep_best: bool = False  # only the best of a judged task's draws, of equals the shortest answer (warmup.keep_best)
    loss_columns_only: bool = False  # the output projection at the trained columns only (warmup.loss_columns_only)
    micro_batches: int = 1  # a step's rows in this many slices, gradients accumulated (warmup.micro_batches)
    train_base: bool = False  # the warm-up trains the base weights, RL fresh adapters over them (warmup.train_base)


@dataclasses.dataclass(frozen=True)
class Components:
    collections: Mapping[str, Collection]
    train_tasks: tuple
    dev_tasks: tuple
    env: Environment
    chat: ChatFormat
    mesh: Any  # the global mesh: update, warm-up, log-prob recomputation
    rollout_mesh: Any  # this process's devices (the global mesh itself with one process): rollouts
    model_cfg: ModelConfig
    policy: Policy  # the initial policy: its base (frozen under LoRA adapters; {} without) and trainable parameters
    tx: optax.GradientTransformation
    updater: Updater
    collector: CollectorConfig
    schedule: TaskSchedule
    run: RunSettings
    warmup: Optional[WarmupSettings]  # None: no supervised warm-up (a real checkpoint, or warmup.steps=0)
    selector: GroupSelector  # which groups of an RL step train


# ----------------------------------------------------------------------------- data and environment


def build_data(config) -> tuple[dict[str, Collection], list, list]:
    """Collections by name, train tasks (mixture) and dev tasks (``split_sizes``; the test split is never
    loaded here: ``mtrl_jax.evaluate.evaluate_test`` alone reads it). With ``data.max_train_per_collection`` /
    ``max_eval_per_collection``, the first that many of each collection's training / dev tasks (the split
    itself unchanged)."""
    collections = load_collections(config)
    train, dev = {}, []
    for name, c in collections.items():
        t, d = split(c.tasks, split_sizes(config))
        kept = {task.task_id for task in (*t, *d)}  # the collection as the run sees it: no test task
        collections[name] = dataclasses.replace(c, tasks=[task for task in c.tasks if task.task_id in kept])
        train[name] = t[: config.data.max_train_per_collection or None]
        dev += d[: config.data.max_eval_per_collection or None]
    weights = csv(config.data.weights)
    if weights:
        if len(weights) != len(collections):
            raise ValueError(
                f"data.weights has {len(weights)} entries for {len(collections)} collections {list(collections)}"
            )
        try:
            weight_map = dict(zip(collections, map(float, weights)))
        except ValueError:
            raise ValueError(f"data.weights: {config.data.weights!r} must be comma-separated numbers") from None
        total = sum(len(t) for t in train.values())
        train_tasks = mixture(train, weight_map, total, seed=rng.numpy_seed(config.seed, "mixture"))
    else:
        train_tasks = [t for name in collections for t in train[name]]
    if not train_tasks:
        raise ValueError(f"no training tasks in {list(collections)}")
    if config.data.max_eval_tasks:
        dev = dev[: config.data.max_eval_tasks]
    return collections, train_tasks, dev


def split_sizes(config) -> SplitSizes:
    d = config.data
    return SplitSizes(d.dev_fraction, d.dev_min, d.test_fraction, d.test_min)


def load_collections(config) -> dict[str, Collection]:
    """The config's collections by name (``data.synthetic``, ``data.folders``), every task of each."""
    collections = {}
    if config.data.synthetic:
        c = make_synthetic_collection(config.data.synthetic_seed)
        collections[c.name] = c
    for folder in csv(config.data.folders):
        c = load_beir(folder)
        if c.name in collections:
            raise ValueError(f"data.folders: two collections are named {c.name!r}")
        collections[c.name] = c
    if not collections:
        raise ValueError("no data: set data.synthetic=True or data.folders")
    return collections


def search_settings(config) -> SearchSettings:
    return SearchSettings(
        tools=tuple(csv(config.search.tools)),
        encoder=config.search.encoder,
        tfidf_dim=config.search.tfidf_dim,
        index_type=config.search.index_type,
        top_k=config.search.top_k,
        max_doc_chars=config.search.max_doc_chars,
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


def _checkpoint_chat(config) -> Optional[TemplateChat]:
    """``model.chat_template``: "" renders the hand-written ChatML (``ChatFormat``); "checkpoint"
    renders with the checkpoint's own jinja template (``TemplateChat``)."""
    m = config.model
    if m.chat_template not in ("", "checkpoint"):
        raise ValueError(
            f"model.chat_template must be '' (hand-written ChatML) or 'checkpoint', got {m.chat_template!r}"
        )
    if m.chat_template != "checkpoint":
        return None
    if not m.checkpoint:
        raise ValueError(
            "model.chat_template='checkpoint' needs model.checkpoint (a directory with tokenizer_config.json)"
        )
    if m.assistant_prefix:
        raise ValueError(
            "model.assistant_prefix applies to the hand-written ChatML only; with model.chat_template="
            "'checkpoint' the template's generation prompt is used"
        )
    return TemplateChat.from_checkpoint(m.checkpoint)


def resolve_tool_prompt(config) -> str:
    """``env.tool_prompt``, with "auto" resolved: "template" when the checkpoint's chat template renders
    the tools, else "schemas" (the tools described in the system message)."""
    tool_prompt = config.env.tool_prompt
    chat = _checkpoint_chat(config) if tool_prompt in ("auto", "template") else None
    if tool_prompt == "auto":
        return "template" if chat is not None and chat.renders_tools else "schemas"
    if tool_prompt == "template" and (chat is None or not chat.renders_tools):
        raise ValueError(
            "env.tool_prompt='template' needs model.chat_template='checkpoint' with a chat template that renders "
            "tools" + ("" if chat is None else f" (the one in {config.model.checkpoint} does not)")
        )
    return tool_prompt


def build_chat(
    config,
    workdir: pathlib.Path,
    collections: Mapping[str, Collection],
    env: Environment,
    train_if_missing: bool = True,
) -> ChatFormat:
    """The checkpoint's tokenizer (rendered with its own chat template for ``model.chat_template=
    "checkpoint"``), ``model.tokenizer``, or (the tiny default) ``<workdir>/tokenizer.json``,
    trained on the corpus and the protocol's strings the first time and reused on resume."""
    templated = _checkpoint_chat(config)
    if templated is not None:
        return templated
    prefix = config.model.assistant_prefix
    if config.model.tokenizer:
        return ChatFormat.from_file(config.model.tokenizer, prefix)
    if config.model.checkpoint:
        path = pathlib.Path(config.model.checkpoint) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: not found; set model.tokenizer")
        return ChatFormat.from_file(path, prefix)
    saved = workdir / "tokenizer.json"
    exists = saved.exists()
    distributed.barrier("tokenizer-looked")  # every process looked before the primary may write it
    if exists:  # resume with the very same tokenizer
        return ChatFormat.from_file(saved, prefix)
    if not train_if_missing:
        raise FileNotFoundError(f"{saved}: not found (the tiny model's tokenizer is trained by experiments.run)")
    if not distributed.is_primary():  # the other processes read the primary's, through the shared work directory
        distributed.barrier("tokenizer-written")
        return ChatFormat.from_file(saved, prefix)
    texts = []
    for c in collections.values():
        texts += [f"{d.doc_id} {d.title} {d.text}" for d in c.documents]
        texts += [t.query for t in c.tasks]
        _, messages = env.reset(c.tasks[0])
        texts += [m["content"] for m in messages] * 20
    tokenizer = train_tokenizer(texts + tokenizer_seed_texts(csv(config.search.tools)), config.model.tiny_vocab)
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(saved))
    distributed.barrier("tokenizer-written")
    return ChatFormat(tokenizer, prefix)


# ----------------------------------------------------------------------------- model and update


DTYPES = ("float32", "bfloat16", "float16")
MIN_LORA_SCALE = 1e-4  # lora_alpha / lora_rank below this: the adapters' output is rounded away (a no-op)


def check_model_fields(config) -> None:
    """The model fields no range covers, refused naming the field before any data or file is touched: the
    dtypes, LoRA targets named twice (each projection has one adapter; export would fold a repeated one
    twice), a LoRA scale that makes training a no-op, and a rank above the tiny model's hidden size."""
    m = config.model
    for field in ("dtype", "param_dtype"):
        if m[field] not in DTYPES:
            raise ValueError(f"model.{field}={m[field]!r}: expected one of {DTYPES}")
    targets = csv(m.lora_targets)
    repeated = sorted({t for t in targets if targets.count(t) > 1})
    if repeated:
        raise ValueError(
            f"model.lora_targets={m.lora_targets!r} names {repeated} more than once: each projection has one adapter"
        )
    if m.lora_rank:
        if m.lora_alpha / m.lora_rank < MIN_LORA_SCALE:
            raise ValueError(
                f"model.lora_alpha={m.lora_alpha!r} with model.lora_rank={m.lora_rank} scales the adapters by "
                f"{m.lora_alpha / m.lora_rank:.3g} < {MIN_LORA_SCALE}: their output rounds away and training is a no-op"
            )
        if not m.checkpoint and m.lora_rank > m.tiny_hidden:
            raise ValueError(
                f"model.lora_rank={m.lora_rank} is above the model's hidden size model.tiny_hidden={m.tiny_hidden}: "
                "a rank past the smaller side of a projection adds nothing (a checkpoint's size is checked at load)"
            )


def build_model(config, vocab_size: int, mesh) -> tuple[ModelConfig, Any, Any]:
    """``(model config, frozen parameters, trainable parameters)``: an HF checkpoint or the tiny model; with
    ``model.lora_rank > 0`` the base is frozen and fresh adapters train (``model/lora.py``), else every
    parameter trains and the frozen tree is empty. A vocabulary that the mesh's devices do not divide is
    padded up (its extra entries masked out of every logit: ``ModelConfig.padded_vocab``)."""
    m = config.model
    if m.scan_unroll < 0:
        raise ValueError(f"model.scan_unroll must be >= 0 (0: every layer unrolled), got {m.scan_unroll}")
    runtime = dict(
        remat=m.remat,
        attention_impl=m.attention_impl or None,
        attention_chunk=m.attention_chunk,
        scan_unroll=m.scan_unroll,
    )
    adapters = dict(lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, lora_targets=tuple(csv(m.lora_targets)))
    # the vocabulary padded to a multiple of the mesh's devices, so that the axes it is split over divide it
    vocab_multiple = 1 if mesh is None else int(mesh.devices.size)
    if m.param_dtype != "float32" and not m.lora_rank:
        raise ValueError(
            f"model.param_dtype={m.param_dtype!r}: the trained parameters would be updated in {m.param_dtype}, where "
            "an optimizer step at a small learning rate rounds away; keep model.param_dtype='float32' (the master "
            "copy) with model.dtype='bfloat16' for bfloat16 compute, or train LoRA adapters (model.lora_rank > 0: "
            "the frozen base may then be bfloat16, the adapters stay float32)"
        )
    if m.checkpoint:
        model, params = load_hf_checkpoint(
            m.checkpoint, m.param_dtype, mesh, dtype=m.dtype, vocab_multiple=vocab_multiple, **runtime
        )
        if model.config.valid_vocab < vocab_size:
            raise ValueError(
                f"tokenizer has {vocab_size} tokens but the model's vocabulary is {model.config.valid_vocab}"
            )
        if not m.lora_rank:
            return model.config, {}, params
        cfg = model.config.replace(**adapters)
        return cfg, params, lora.init_adapters(cfg, rng.key(config.seed, "adapters"), mesh)
    cfg = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=m.tiny_hidden,
        intermediate_size=m.tiny_intermediate,
        num_layers=m.tiny_layers,
        num_heads=m.tiny_heads,
        num_kv_heads=m.tiny_kv_heads,
        head_dim=m.tiny_head_dim,
        model_type="qwen3",
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        **runtime,
        **adapters,
    ).padded_vocab(vocab_multiple)
    frozen, trainable = lora.split(init_params(cfg, rng.key(config.seed, "params"), mesh))
    return cfg, frozen, trainable


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
    )


def collector_config(config) -> CollectorConfig:
    r = config.rollout
    if config.rollout_max_concurrency < 1:
        raise ValueError(f"rollout_max_concurrency must be >= 1, got {config.rollout_max_concurrency}")
    if r.max_tokens_per_turn < 1:
        raise ValueError(f"rollout.max_tokens_per_turn must be >= 1, got {r.max_tokens_per_turn}")
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
    for field in ("global_batch_size", "max_epochs"):
        if config[field] < 1:
            raise ValueError(f"{field} must be >= 1, got {config[field]}")
    if config.max_steps < 0:
        raise ValueError(f"max_steps must be >= 0 (0: whole epochs), got {config.max_steps}")
    if config.checkpoint.every_steps < 1:
        raise ValueError(f"checkpoint.every_steps must be >= 1, got {config.checkpoint.every_steps}")
    if config.rollout.group_size < 2:
        raise ValueError(
            f"rollout.group_size must be >= 2: group-relative advantages of a single sample are 0, "
            f"so nothing would be learnt (got {config.rollout.group_size})"
        )
    if not config.optim.learning_rate > 0:
        raise ValueError(f"optim.learning_rate must be > 0, got {config.optim.learning_rate}")
    if config.rl.max_nonfinite_steps < 1:
        raise ValueError(f"rl.max_nonfinite_steps must be >= 1, got {config.rl.max_nonfinite_steps}")
    if config.rl.filter_max_extra_groups < 0:
        raise ValueError(f"rl.filter_max_extra_groups must be >= 0, got {config.rl.filter_max_extra_groups}")
    if config.rl.filter_max_extra_groups and not config.rl.filter_groups:
        raise ValueError(
            "rl.filter_max_extra_groups > 0 refills the groups rl.filter_groups drops: set rl.filter_groups=True"
        )
    if config.rl.truncation not in TRUNCATION_MODES:
        raise ValueError(f"rl.truncation must be one of {TRUNCATION_MODES}, got {config.rl.truncation!r}")
    if not 0 < config.data.dev_fraction < 1:
        raise ValueError(f"data.dev_fraction must be in (0, 1), got {config.data.dev_fraction}")
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


def warmup_settings(config) -> Optional[WarmupSettings]:
    w = config.warmup
    if not w.steps:
        return None
    tools = tuple(csv(config.search.tools))
    top_ks, top_k_probs = parse_top_k_weights(w.teacher_top_k, SearchSettings.max_top_k)
    if not 0.0 <= w.teacher_hop <= 1.0:
        raise ValueError(f"warmup.teacher_hop must be a probability in [0, 1], got {w.teacher_hop}")
    if w.hop_drills < 0:
        raise ValueError(f"warmup.hop_drills must be >= 0, got {w.hop_drills}")
    if w.full_every < 1:
        raise ValueError(f"warmup.full_every must be >= 1, got {w.full_every}")
    if w.two_turn_every < 0:
        raise ValueError(f"warmup.two_turn_every must be >= 0 (0: never), got {w.two_turn_every}")
    if w.micro_batches < 1 or w.batch_size % w.micro_batches:
        raise ValueError(
            f"warmup.micro_batches={w.micro_batches} must be >= 1 and divide warmup.batch_size={w.batch_size}"
        )
    if w.micro_batches > 1 and not w.loss_columns_only:
        raise ValueError("warmup.micro_batches > 1 needs warmup.loss_columns_only=True")
    if w.samples_per_task < 1:
        raise ValueError(f"warmup.samples_per_task must be >= 1, got {w.samples_per_task}")
    if not -1.0 <= w.min_reward <= 1.0:
        raise ValueError(f"warmup.min_reward must be in [-1, 1] (-1: keep every demonstration), got {w.min_reward}")
    if w.train_base and not config.model.lora_rank:
        raise ValueError(
            "warmup.train_base=True trains the base in the warm-up and LoRA adapters over it in RL; it needs "
            f"model.lora_rank > 0 (got {config.model.lora_rank}: without adapters every weight trains in both already)"
        )
    if w.train_base and config.model.param_dtype != "float32":
        raise ValueError(
            f"warmup.train_base=True with model.param_dtype={config.model.param_dtype!r}: the warm-up would update the "
            "base weights in that dtype, where a small step rounds away; use model.param_dtype='float32'"
        )
    hop_queries, hop_query_probs = parse_choices(w.teacher_hop_queries, HOP_QUERIES, "warmup.teacher_hop_queries")
    hop_other = w.teacher_hop_tools.strip() == "other"
    if hop_other and len(tools) < 2:
        raise ValueError(
            f"warmup.teacher_hop_tools='other' needs two tools or more in search.tools, got {config.search.tools!r}"
        )
    answers, answer_probs = parse_choices(w.teacher_answers, ANSWERS, "warmup.teacher_answers")
    return WarmupSettings(
        steps=w.steps,
        batch_size=w.batch_size,
        learning_rate=w.learning_rate,
        augment=w.augment,
        tools=tools,
        tool_probs=tuple(parse_tool_weights(w.teacher_tools, tools).tolist()),
        top_ks=tuple(top_ks),
        top_k_probs=tuple(top_k_probs.tolist()),
        hop=w.teacher_hop,
        hop_tool_probs=tuple(
            parse_tool_weights("" if hop_other else w.teacher_hop_tools, tools, "warmup.teacher_hop_tools").tolist()
        ),
        hop_other=hop_other,
        hop_drills=int(w.hop_drills),
        share_prefix=bool(w.share_prefix),
        full_every=int(w.full_every),
        two_turn_every=int(w.two_turn_every),
        hop_queries=hop_queries,
        hop_query_probs=tuple(hop_query_probs.tolist()),
        answers=answers,
        answer_probs=tuple(answer_probs.tolist()),
        samples_per_task=int(w.samples_per_task),
        min_reward=None if w.min_reward <= -1.0 else float(w.min_reward),
        keep_best=bool(w.keep_best),
        loss_columns_only=bool(w.loss_columns_only),
        micro_batches=int(w.micro_batches),
        train_base=bool(w.train_base),
    )


def device_memory_bytes() -> int:
    """What one device of this process can hold: its memory limit where the backend reports one (GPU, TPU),
    else the machine's physical memory (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_kv_cache(config, rows: int) -> None:
    """Refuse, with an estimate, a KV cache (``rows`` generation rows of ``rollout.max_len`` tokens) that
    cannot fit one device, before the model is loaded (rather than being killed for memory later)."""
    m = config.model
    if m.checkpoint and (pathlib.Path(m.checkpoint) / "config.json").exists():
        shape = json.loads((pathlib.Path(m.checkpoint) / "config.json").read_text())
        layers, heads = shape.get("num_hidden_layers", 1), shape.get("num_attention_heads", 1)
        kv, head_dim = (
            shape.get("num_key_value_heads") or heads,
            shape.get("head_dim") or shape.get("hidden_size", 0) // heads,
        )
    else:
        layers, kv, head_dim = m.tiny_layers, m.tiny_kv_heads, m.tiny_head_dim
    per_row = config.rollout.max_len * layers * 2 * kv * head_dim * jax.numpy.dtype(m.dtype).itemsize
    limit = device_memory_bytes()
    if rows * per_row > limit:
        raise ValueError(
            f"rollout.max_len={config.rollout.max_len}: the KV cache of {rows} generation rows "
            f"(rollout_max_concurrency) x {config.rollout.max_len} tokens would take {rows * per_row / 2**30:.1f} GiB, "
            f"more than the {limit / 2**30:.1f} GiB a device here holds"
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


def check_config(config) -> tuple[UpdateConfig, CollectorConfig, Optional[WarmupSettings], RunSettings]:
    """Every check a config's own fields allow, with no data, model or file read: ranges, the model fields, the
    update, the collector, the warm-up and the run (each raises a ``ValueError`` naming its field); returns those
    settings. The entry points call it before they create anything; ``build`` starts from it."""
    ranges.check(config)
    check_model_fields(config)
    update_cfg = update_config(config)
    return (
        update_cfg,
        collector_config(config),
        warmup_settings(config),
        run_settings(config, update_cfg.rows_per_micro_batch_divisor),
    )


def build(config, workdir: pathlib.Path, train_tokenizer_if_missing: bool = True) -> Components:
    """Every component of a run of ``config`` whose files live in ``workdir``."""
    workdir = pathlib.Path(workdir)
    update_cfg, collector_cfg, warmup, run = check_config(config)  # cheap checks first: before any data is loaded
    use_compilation_cache(config)
    collections, train_tasks, dev_tasks = build_data(config)
    schedule = TaskSchedule(train_tasks, config.global_batch_size)
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
        ),
    )
