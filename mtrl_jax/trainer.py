"""The training loop: build everything from a config, warm up, run MTRL, checkpoint, resume.

``train_and_evaluate(config, workdir)`` is what ``python -m experiments.run`` calls. When
``workdir`` holds a checkpoint the run resumes from it (parameters, optimizer state, step, RNG,
data cursor, staleness counters); SIGTERM writes a checkpoint before the process exits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import signal
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from mtrl_jax.chat import ChatFormat, train_tokenizer
from mtrl_jax.data.collection import Collection, load_beir, mixture, split
from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.evaluate import summarize
from mtrl_jax.model import ModelConfig, init_params, load_hf_checkpoint
from mtrl_jax.model.sharding import make_mesh
from mtrl_jax.rl.batch import make_batch
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.train_step import TrainState, UpdateConfig, Updater, make_optimizer
from mtrl_jax.rollout.collector import AsyncRollouts, Collector, CollectorConfig, EpisodeRequest, filter_stale
from mtrl_jax.search.build import SearchSettings, make_environment
from mtrl_jax.search.env import EnvironmentRouter, SearchEnvConfig
from mtrl_jax.warmup import (augmented_tasks, demonstration_tokens, parse_tool_weights, parse_top_k_weights, question_vocabulary,
                             supervised_warmup, teacher_turns)

log = logging.getLogger("mtrl_jax")


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------------- building blocks


def build_data(config) -> tuple[dict[str, Collection], list, list]:
    """Collections by name, train tasks (mixture) and validation tasks (5% per dataset)."""
    collections = {}
    if config.data.synthetic:
        c = make_synthetic_collection(config.data.synthetic_seed)
        collections[c.name] = c
    for folder in _csv(config.data.folders):
        c = load_beir(folder)
        if c.name in collections:
            raise ValueError(f"data.folders: two collections are named {c.name!r}")
        collections[c.name] = c
    if not collections:
        raise ValueError("no data: set data.synthetic=True or data.folders")
    train, val = {}, []
    for name, c in collections.items():
        t, v = split(c.tasks, config.data.validation_fraction)
        train[name] = t
        val += v
    weights = _csv(config.data.weights)
    if weights:
        if len(weights) != len(collections):
            raise ValueError(f"data.weights has {len(weights)} entries for {len(collections)} collections {list(collections)}")
        weight_map = dict(zip(collections, map(float, weights)))
        total = sum(len(t) for t in train.values())
        train_tasks = mixture(train, weight_map, total, seed=config.seed)
    else:
        train_tasks = [t for name in collections for t in train[name]]
    if config.data.max_eval_tasks:
        val = val[: config.data.max_eval_tasks]
    return collections, train_tasks, val


def build_environment(config, collections):
    settings = SearchSettings(
        tools=tuple(_csv(config.search.tools)), encoder=config.search.encoder, tfidf_dim=config.search.tfidf_dim,
        index_type=config.search.index_type, top_k=config.search.top_k, max_doc_chars=config.search.max_doc_chars,
        cache_dir=config.search.cache_dir or None, remote_url=config.search.remote_url or None)
    env_cfg = SearchEnvConfig(max_turns=config.env.max_turns, answer_fallback=config.env.answer_fallback,
                              max_answer_docs=config.env.max_answer_docs, tool_prompt=config.env.tool_prompt)
    return EnvironmentRouter({name: make_environment(c, settings, env_cfg) for name, c in collections.items()})


def build_chat(config, workdir: pathlib.Path, collections, env) -> ChatFormat:
    prefix = config.model.assistant_prefix
    if config.model.tokenizer:
        return ChatFormat.from_file(config.model.tokenizer, prefix)
    if config.model.checkpoint:
        path = pathlib.Path(config.model.checkpoint) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: not found; set model.tokenizer")
        return ChatFormat.from_file(path, prefix)
    saved = workdir / "tokenizer.json"
    if saved.exists():  # resume with the very same tokenizer
        return ChatFormat.from_file(saved, prefix)
    texts = []
    for name, c in collections.items():
        texts += [f"{d.doc_id} {d.title} {d.text}" for d in c.documents]
        texts += [t.query for t in c.tasks]
        probe = c.tasks[0]
        _, messages = env.reset(probe)
        texts += [m["content"] for m in messages] * 20
    texts += ['<tool_call>\n{"name": "bm25_search", "arguments": {"query": "x"}}\n</tool_call>',
              '<tool_call>\n{"name": "vector_search", "arguments": {"query": "x"}}\n</tool_call>',
              "<answer></answer>", "<tool_response>\n</tool_response>", "Error: "] * 50
    tokenizer = train_tokenizer(texts, config.model.tiny_vocab)
    tokenizer.save(str(saved))
    return ChatFormat(tokenizer, prefix)


def build_model(config, vocab_size: int, mesh):
    runtime = dict(remat=config.model.remat)
    if config.model.checkpoint:
        model, params = load_hf_checkpoint(config.model.checkpoint, config.model.dtype, mesh,
                                           compute_dtype=config.model.compute_dtype, **runtime)
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"tokenizer has {vocab_size} tokens but the model's vocabulary is {model.config.vocab_size}")
        return model.config, params
    m = config.model
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=m.tiny_hidden, intermediate_size=m.tiny_intermediate,
                      num_layers=m.tiny_layers, num_heads=m.tiny_heads, num_kv_heads=m.tiny_kv_heads,
                      head_dim=m.tiny_head_dim, model_type="qwen3", qk_norm=True, tie_word_embeddings=True,
                      rope_theta=10000.0, dtype=m.compute_dtype, param_dtype=m.dtype, **runtime)
    return cfg, init_params(cfg, jax.random.PRNGKey(config.seed), mesh)


def update_config(config) -> UpdateConfig:
    rl = config.rl
    options = {k: rl[k] for k in ("clip_low", "clip_high", "clip_dual", "is_cap") if rl[k] is not None}
    if rl.loss != "is":
        options.pop("is_cap", None)
    adv_options = {}
    if rl.advantage == "grpo":
        adv_options["scale"] = rl.grpo_scale
    elif rl.advantage == "grpo_passk":
        adv_options["k"] = rl.passk_k
    norm_len = config.rollout.max_len if rl.aggregation == "seq-mean-token-sum-norm" else None
    return UpdateConfig(
        objective=ObjectiveConfig(loss=rl.loss, loss_options=tuple(sorted(options.items())), aggregation=rl.aggregation,
                                  norm_len=norm_len, tis_cap=rl.tis_cap, kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator,
                                  entropy_coef=rl.entropy_coef),
        advantage=rl.advantage, advantage_options=tuple(sorted(adv_options.items())), temperature=config.rollout.temperature,
        old_logp=rl.old_logp, update_epochs=rl.update_epochs, mini_batches=rl.mini_batches, micro_batches=rl.micro_batches,
        logprob_chunk=rl.logprob_chunk)


class ParamsHolder:
    """The latest published ``(params, version)``, read by the collector before each device call."""

    def __init__(self, params, version: int):
        self.value = (params, version)

    def __call__(self):
        return self.value

    def publish(self, params, version: int):
        self.value = (params, version)


# ----------------------------------------------------------------------------- the run


class Run:
    def __init__(self, config, workdir: os.PathLike):
        self.config = config
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.collections, self.train_tasks, self.val_tasks = build_data(config)
        if not self.train_tasks:
            raise ValueError("no training tasks")
        self.env = build_environment(config, self.collections)
        self.chat = build_chat(config, self.workdir, self.collections, self.env)
        self.mesh = make_mesh(tuple(config.model.mesh_shape))
        self.model_cfg, params = build_model(config, self.chat.vocab_size, self.mesh)
        P = config.global_batch_size
        self.steps_per_epoch = max(1, len(self.train_tasks) // P)
        self.total_steps = config.max_steps or config.max_epochs * self.steps_per_epoch
        self.total_steps = min(self.total_steps, config.max_epochs * self.steps_per_epoch)
        o = config.optim
        self.tx = make_optimizer(o.learning_rate, self.total_steps * config.rl.update_epochs * config.rl.mini_batches,
                                 o.schedule, o.warmup_steps, o.grad_clip, o.weight_decay)
        self.updater = Updater(self.model_cfg, update_config(config), self.tx)
        self.state = self.updater.init_state(params, jax.random.PRNGKey(config.seed))
        self.ref_params = None
        r = config.rollout
        self.collector_cfg = CollectorConfig(slots=config.rollout_max_concurrency, max_len=r.max_len,
                                             max_tokens_per_turn=r.max_tokens_per_turn, decode_chunk=r.decode_chunk,
                                             temperature=r.temperature, top_p=r.top_p, tool_workers=r.tool_workers)
        self.holder = ParamsHolder(self.state.params, 0)
        self.collector = Collector(self.model_cfg, self.chat, self.env, self.collector_cfg, self.holder)
        self.eval_collector = Collector(self.model_cfg, self.chat, self.env,
                                        dataclasses.replace(self.collector_cfg, temperature=max(config.eval.temperature, 0.0)),
                                        self.holder)
        self.ckpt = ocp.CheckpointManager(
            (self.workdir / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=config.checkpoint.keep, create=True))
        self.meta = {"rl_step": 0, "before": None, "staleness": {"dropped_groups": 0, "max_seen": 0}}
        self.writer = None
        self.stop_requested = False
        self.last_collect_seconds = 0.0

    # -------------------------------------------------------------- checkpoints

    def save(self):
        step = self.meta["rl_step"]
        P = self.config.global_batch_size
        self.meta["cursor"] = {"epoch": step // self.steps_per_epoch, "index": (step % self.steps_per_epoch) * P,
                               "shuffle_seed": self.config.seed}
        state = {"params": self.state.params, "opt_state": self.state.opt_state, "step": self.state.step,
                 "rng": self.state.rng}
        self.ckpt.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(self.meta)),
                       force=True)
        self.ckpt.wait_until_finished()

    def try_restore(self) -> bool:
        latest = self.ckpt.latest_step()
        if latest is None:
            return False
        abstract = {"params": self.state.params, "opt_state": self.state.opt_state, "step": self.state.step, "rng": self.state.rng}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract)
        restored = self.ckpt.restore(latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                     meta=ocp.args.JsonRestore()))
        s = restored["state"]
        self.state = TrainState(s["params"], s["opt_state"], s["step"], s["rng"])
        self.meta = restored["meta"]
        self.holder.publish(self.state.params, self.meta["rl_step"])
        return True

    def save_reference(self):
        """The KL reference (the policy RL starts from), written once, before the first checkpoint."""
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save((self.workdir / "reference").absolute(), self.state.params, force=True)
        checkpointer.wait_until_finished()

    def restore_reference(self):
        path = (self.workdir / "reference").absolute()
        if not path.exists():
            raise FileNotFoundError(f"{path}: rl.kl_coef is set but this run has no KL reference policy "
                                    "(it started with rl.kl_coef=0); resume it with rl.kl_coef=0 or use a new workdir")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state.params)
        return ocp.StandardCheckpointer().restore(path, abstract)

    # -------------------------------------------------------------- pieces of the loop

    def step_tasks(self, step: int) -> list:
        """The prompts of RL step ``step``: a seeded shuffle per epoch, consumed in order."""
        P = self.config.global_batch_size
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.config.seed, epoch]).permutation(len(self.train_tasks))
        return [self.train_tasks[i] for i in order[index * P:(index + 1) * P]]

    def requests(self, step: int) -> list[EpisodeRequest]:
        G = self.config.rollout.group_size
        base = jax.random.fold_in(jax.random.PRNGKey(self.config.seed + 1), step)
        return [EpisodeRequest(task, p, g, jax.random.fold_in(base, p * G + g))
                for p, task in enumerate(self.step_tasks(step)) for g in range(G)]

    def collect(self, step: int):
        start = time.perf_counter()
        trajectories = self.collector.run(self.requests(step))
        self.last_collect_seconds = time.perf_counter() - start
        G = self.config.rollout.group_size
        return [trajectories[i:i + G] for i in range(0, len(trajectories), G)]

    def evaluate(self, tasks, label: str) -> dict:
        key = jax.random.PRNGKey(self.config.seed + 2)
        requests = [EpisodeRequest(t, i, 0, jax.random.fold_in(key, i)) for i, t in enumerate(tasks)]
        start = time.perf_counter()
        trajectories = self.eval_collector.run(requests)
        metrics = summarize(trajectories)
        metrics["seconds"] = time.perf_counter() - start
        self.write_trajectories(trajectories, f"eval_{label}")
        return metrics

    def write_trajectories(self, trajectories, name: str, step: Optional[int] = None):
        if not self.config.log.trajectories:
            return
        folder = self.workdir / "trajectories"
        folder.mkdir(exist_ok=True)
        with open(folder / f"{name}.jsonl", "w") as f:
            for t in trajectories:
                f.write(t.to_json(step) + "\n")

    def warmup(self):
        cfg = self.config.warmup
        rng = np.random.default_rng(self.config.seed)
        tools = _csv(self.config.search.tools)
        probs = parse_tool_weights(cfg.teacher_tools, tools)
        top_ks, top_k_probs = parse_top_k_weights(cfg.teacher_top_k, SearchSettings.max_top_k)
        demos = []
        vocabulary = question_vocabulary(self.train_tasks)
        for task in self.train_tasks:
            for variant in [task] + augmented_tasks(task, cfg.augment, rng, vocabulary):
                policy = teacher_turns(rng, tools, probs, top_ks, top_k_probs)
                demos.append(demonstration_tokens(self.chat, self.env, variant, policy))
        log.info("warm-up on %d scripted demonstrations for %d steps", len(demos), cfg.steps)
        params, losses = supervised_warmup(self.model_cfg, self.state.params, demos, cfg.steps, cfg.batch_size,
                                           cfg.learning_rate, seed=self.config.seed, log=log.info)
        self.state = self.updater.init_state(params, self.state.rng)
        self.holder.publish(params, 0)
        return losses

    # -------------------------------------------------------------- main

    def train(self) -> dict:
        from tensorboardX import SummaryWriter

        config = self.config
        resumed = self.try_restore()
        if resumed:
            log.info("resumed from %s at RL step %d", self.workdir / "checkpoints", self.meta["rl_step"])
        else:
            if config.warmup.steps and not config.model.checkpoint:
                self.warmup()
            self.meta["before"] = self.evaluate(self.val_tasks, "before")
            _print_metrics("before RL", self.meta["before"])
            if config.rl.kl_coef:
                self.save_reference()
            self.save()
        if config.rl.kl_coef:  # the policy RL started from
            self.ref_params = self.restore_reference() if resumed else jax.tree.map(jnp.copy, self.state.params)
        self.writer = SummaryWriter(str(self.workdir / "tensorboard"))
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        rollouts = None
        try:
            start = self.meta["rl_step"]
            if config.rollout.asynchronous and start < self.total_steps:
                rollouts = AsyncRollouts(self.collect, start, config.rollout.max_staleness, start)
            progress = _progress(config.log.progress, start, self.total_steps)
            for step in range(start, self.total_steps):
                t0 = time.perf_counter()
                if rollouts is not None:
                    got_step, groups = rollouts.get()
                    assert got_step == step, (got_step, step)
                else:
                    groups = self.collect(step)
                t_collect = time.perf_counter() - t0
                metrics = self.train_on(step, groups)
                self.meta["rl_step"] = step + 1
                self.holder.publish(self.state.params, step + 1)
                if rollouts is not None:
                    rollouts.publish(step + 1)
                metrics["time/collect_wait_s"] = t_collect
                metrics["throughput/sampled_tokens_per_s"] = metrics.get("throughput/sampled_tokens", 0.0) / max(
                    self.last_collect_seconds, 1e-9)
                metrics["time/step_s"] = time.perf_counter() - t0
                if config.eval.every_steps and (step + 1) % config.eval.every_steps == 0 and step + 1 < self.total_steps:
                    for k, v in _flatten(self.evaluate(self.val_tasks, f"step_{step + 1:06d}"), "eval").items():
                        metrics[k] = v
                self.log_scalars(step + 1, metrics)
                progress.update(1)
                progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", ndcg=f"{metrics['reward/ndcg@10']:.3f}")
                if (step + 1) % config.checkpoint.every_steps == 0 or step + 1 == self.total_steps or self.stop_requested:
                    self.save()
                if self.stop_requested:
                    log.warning("SIGTERM: checkpoint written at RL step %d, exiting", step + 1)
                    raise SystemExit(143)
            progress.close()
        finally:
            if rollouts is not None:
                rollouts.stop()
            signal.signal(signal.SIGTERM, previous)
            self.writer.close()
        after = self.evaluate(self.val_tasks, "after")
        _print_metrics("after RL", after)
        summary = {"before": self.meta["before"], "after": after, "rl_steps": self.total_steps,
                   "staleness": self.meta["staleness"]}
        (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.collector.close()
        self.eval_collector.close()
        return summary

    def _on_sigterm(self, signum, frame):
        self.stop_requested = True

    def train_on(self, step: int, groups) -> dict:
        G = self.config.rollout.group_size
        fresh, stale = filter_stale(groups, step, self.config.rollout.max_staleness)
        self.meta["staleness"]["dropped_groups"] += len(stale)
        lag = [step - t.min_version() for g in fresh for t in g if t.min_version() is not None]
        self.meta["staleness"]["max_seen"] = max([self.meta["staleness"]["max_seen"]] + lag)
        trajectories = [t for g in fresh for t in g]
        metrics = _rollout_metrics(trajectories)
        metrics["staleness/dropped_groups"] = len(stale)
        metrics["staleness/mean"] = float(np.mean(lag)) if lag else 0.0
        self.write_trajectories(trajectories, f"step_{step + 1:06d}", step + 1)
        divisor = self.updater.config.mini_batches * self.updater.config.micro_batches
        usable = (len(fresh) * G // divisor) * divisor // G * G
        if usable == 0:
            log.warning("RL step %d: no trainable groups (%d stale)", step + 1, len(stale))
            return metrics
        batch = make_batch(trajectories[:usable], G, self.config.rl.length_bucket, self.chat.pad_id)
        t0 = time.perf_counter()
        self.state, update_metrics = self.updater.update(self.state, batch, self.ref_params, seed=step)
        seconds = time.perf_counter() - t0
        metrics.update({f"train/{k}": v for k, v in update_metrics.items()})
        metrics["throughput/trained_tokens_per_s"] = float(batch.loss_mask.sum()) / seconds
        metrics["throughput/sampled_tokens"] = float(sum(t.num_sampled for t in trajectories))
        return metrics

    def log_scalars(self, step: int, metrics: dict):
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and np.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()
        with open(self.workdir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}) + "\n")


def _rollout_metrics(trajectories) -> dict:
    s = summarize(trajectories)
    out = {"reward/mean": float(np.mean([t.reward for t in trajectories])), "reward/ndcg@10": s["ndcg@10"],
           "episodes/failure_rate": s["failure_rate"], "episodes/mean_turns": s["mean_turns"],
           "episodes/tool_errors_per_episode": s["tool_errors_per_query"]}
    out.update({f"episodes/failure_rate/{k}": v for k, v in s["failure_rate_by_reason"].items()})
    out.update({f"tools/calls_per_episode/{k}": v for k, v in s["tool_calls_per_query"].items()})
    return out


def _flatten(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}/{k}"))
        else:
            out[f"{prefix}/{k}"] = v
    return out


def _print_metrics(label: str, m: dict):
    print(f"[{label}] validation: nDCG@10 {m['ndcg@10']:.4f} (failures count 0), failure rate {m['failure_rate']:.3f}, "
          f"mean turns {m['mean_turns']:.2f}, tool calls {m['tool_calls_per_query']}, queries {m['queries']}", flush=True)


def _progress(enabled: bool, start: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="MTRL", unit="step", disable=not enabled, file=sys.stdout)


def train_and_evaluate(config, workdir: os.PathLike) -> dict:
    return Run(config, workdir).train()
