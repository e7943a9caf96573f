"""The range of every numeric configuration field, checked before any work (``check``): a value outside it
is an error naming the field, its value and the range. ``tests/test_reliability.py`` holds that every
numeric field of the configs has one here."""

from __future__ import annotations

BIG = 10**9
# field -> (lowest, highest, whether the lowest itself is allowed)
RANGES: dict[str, tuple[float, float, bool]] = {
    "seed": (0, 2**31 - 1, True),
    "max_epochs": (1, BIG, True),
    "global_batch_size": (1, 10**6, True),
    "rollout_max_concurrency": (1, 10**6, True),
    "max_steps": (0, BIG, True),
    "model.tiny_vocab": (64, 10**7, True),
    "model.tiny_hidden": (8, 2**17, True),
    "model.tiny_layers": (1, 1024, True),
    "model.tiny_heads": (1, 1024, True),
    "model.tiny_kv_heads": (1, 1024, True),
    "model.tiny_head_dim": (2, 4096, True),
    "model.tiny_intermediate": (8, 2**20, True),
    "model.scan_unroll": (0, 1024, True),
    "model.attention_chunk": (1, 10**7, True),
    "model.lora_rank": (0, 65536, True),
    "model.lora_alpha": (0, 10**6, False),
    "data.synthetic_seed": (0, 2**31 - 1, True),
    "data.dev_fraction": (0, 1, False),
    "data.dev_min": (0, 10**7, True),
    "data.test_fraction": (0, 1, True),
    "data.test_min": (0, 10**7, True),
    "data.max_eval_tasks": (0, 10**8, True),
    "data.max_eval_per_collection": (0, 10**8, True),
    "data.max_train_per_collection": (0, 10**8, True),
    "data.curriculum_max_baseline": (0, 1, True),
    "search.tfidf_dim": (1, 65536, True),
    "search.top_k": (1, 20, True),  # the tools' max_top_k
    "search.max_doc_chars": (0, 10**6, True),
    "search.max_queries": (1, 16, True),
    "search.remote_deadline_s": (0, 86400, False),
    "search.remote_max_failures": (1, 10**6, True),
    "env.max_turns": (1, 10**4, True),
    "env.max_answer_docs": (1, 10**4, True),
    "rollout.group_size": (2, 10**5, True),
    "rollout.temperature": (0, 100, True),
    "rollout.top_p": (0, 1, False),
    "rollout.max_len": (16, 10**8, True),  # and the KV cache must fit the machine (model.build.check_kv_cache)
    "rollout.max_tokens_per_turn": (1, 10**8, True),
    "rollout.decode_chunk": (1, 10**6, True),
    "rollout.tool_workers": (0, 4096, True),
    "rollout.max_staleness": (0, 10**4, True),
    "rl.tis_cap": (0, 10**6, False),
    "rl.kl_coef": (0, 10**3, True),
    "rl.entropy_coef": (0, 10**3, True),
    "rl.update_epochs": (1, 10**4, True),
    "rl.mini_batches": (1, 10**6, True),
    "rl.micro_batches": (1, 10**6, True),
    "rl.length_bucket": (1, 10**8, True),
    "rl.logprob_chunk": (1, 10**9, True),
    "rl.filter_max_extra_groups": (0, 10**6, True),
    "rl.max_nonfinite_steps": (1, 10**6, True),
    "rl.turn_coef": (0, 10**3, True),
    "rl.turn_gamma": (0, 1, True),
    "rl.turn_redundancy": (0, 10**3, True),
    "rl.turn_std_floor": (0, 10**3, True),
    "optim.learning_rate": (0, 1, False),
    "optim.warmup_steps": (0, BIG, True),
    "optim.grad_clip": (0, 10**6, True),  # 0: no clipping; a negative norm would flip the gradient
    "optim.weight_decay": (0, 10, True),
    "warmup.steps": (0, BIG, True),
    "warmup.batch_size": (1, 10**6, True),
    "warmup.learning_rate": (0, 1, False),
    "warmup.augment": (0, 1000, True),
    "warmup.special_copies": (0, 1000, True),
    "warmup.teacher_multi_query": (0, 1, True),
    "warmup.teacher_hop": (0, 1, True),
    "warmup.hop_drills": (0, 1000, True),
    "warmup.full_every": (1, BIG, True),
    "warmup.two_turn_every": (0, BIG, True),
    "warmup.samples_per_task": (1, 10**4, True),
    "warmup.min_reward": (-1, 1, True),
    "warmup.micro_batches": (1, 10**6, True),
    "eval.every_steps": (0, BIG, True),
    "eval.temperature": (0, 100, True),
    "checkpoint.every_steps": (1, BIG, True),
    "checkpoint.keep": (1, 10**6, True),  # 0 would delete every checkpoint, the trained policy's too
}


# why a bound is where it is, said with the error where the range alone does not say it
REASONS = {
    "max_steps": "0: whole epochs (max_epochs)",
    "model.scan_unroll": "0: every layer unrolled",
    "rollout.group_size": "group-relative advantages of a single sample are 0, so nothing would be learnt",
    "rollout.max_staleness": "0: on-policy",
    "optim.learning_rate": "a step of 0 trains nothing",
    "warmup.two_turn_every": "0: never",
    "warmup.min_reward": "-1: keep every demonstration",
    "data.dev_fraction": "every run selects on its dev split",
    "data.curriculum_max_baseline": "0: off; above 1 every query would be kept",
    "checkpoint.keep": "0 would delete every checkpoint, the trained policy's too",
    "optim.grad_clip": "0: no clipping; a negative norm would flip the gradient",
    "rl.turn_gamma": "a discount: above 1 a later search would weigh more than the turn's own",
}


def numeric_fields(config, prefix: str = ""):
    """``(dotted field, value)`` of every int or float field of an ``ml_collections`` config (not bools)."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if hasattr(value, "items"):
            yield from numeric_fields(value, path + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield path, value


def check(config) -> None:
    """Every numeric field within its range (a NaN or an infinity never is); a field without a range is an
    error too, so that a new field gets one."""
    for field, value in numeric_fields(config):
        if field not in RANGES:
            raise ValueError(f"{field}: no range is defined for this numeric field (mtrl_jax/ranges.py)")
        lo, hi, low_ok = RANGES[field]
        if not ((lo <= value if low_ok else lo < value) and value <= hi):
            reason = f" ({REASONS[field]})" if field in REASONS else ""
            raise ValueError(
                f"{field}={value!r} is out of range: expected {lo} {'<=' if low_ok else '<'} {field} <= {hi}{reason}"
            )
