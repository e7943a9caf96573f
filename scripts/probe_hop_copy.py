"""Does a policy copy an identifier out of search results? The step a second search (the hop) needs.

    python scripts/probe_hop_copy.py --workdir workdirs/default --config=configs/default.py [--config.x=y ...]

Pass the run's own config and overrides (the held-out tasks, the tokenizer in the work directory
and the scripted teacher come from them). It probes the run's warmed-up policy (the KL reference
RL started from) and its latest checkpoint, on hop cases of the held-out tasks: the scripted
teacher's episode with its hop forced, cut after the second search's call (``mtrl_jax/probes.py``).
Per task type it prints the teacher-forced accuracy on the identifier's tokens after its first and
the share copied whole (and, over all cases, that accuracy by token position), and what the policy itself writes after the first search's results (greedy):
a call, a call on an identifier shown, an answer. ``--out FILE`` writes the figures as JSON.
``--split=train`` probes as many training questions (a seeded sample) instead: a policy that copies
better there than on held-out questions memorises rather than copies.
"""

import json
import pathlib

import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mtrl_jax.checkpoint import Checkpoints
from mtrl_jax.evaluate import restore_params
from mtrl_jax.probes import ModelPolicy, forced_hop_teacher, hop_cases, probe_hop_copy
from mtrl_jax.rollout.interfaces import EpisodeDriver
from mtrl_jax.setup import build

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "the run's ml_collections config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "the training work directory", required=True)
_PER_TASK = flags.DEFINE_integer("per_task", 2, "hop cases drawn per held-out task")
_OUT = flags.DEFINE_string("out", None, "write the figures here as JSON")
_SPLIT = flags.DEFINE_enum("split", "validation", ["validation", "train"],
                           "probe the held-out tasks, or a seeded sample of as many training tasks")

COLUMNS = ("cases", "id_token_accuracy", "id_exact", "greedy_call", "greedy_shown", "greedy_answer")


def policies(workdir: pathlib.Path, components) -> dict:
    """``{"warmed-up": params, "trained": params}``, each when the work directory has it."""
    out = {}
    checkpoints = Checkpoints(workdir)
    try:
        if checkpoints.reference_path.exists():
            out["warmed-up"] = checkpoints.restore_reference(components.params)
        trained = checkpoints.latest_step() is not None
    finally:
        checkpoints.close()
    if trained:
        out["trained"] = restore_params(workdir, components)
    if not out:
        raise FileNotFoundError(f"{workdir}: neither a warmed-up policy ({workdir / 'reference'}, saved when rl.kl_coef > 0) "
                                f"nor a checkpoint ({workdir / 'checkpoints'})")
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    workdir = pathlib.Path(_WORKDIR.value)
    components = build(_CONFIG.value, workdir, train_tokenizer_if_missing=False)
    driver = EpisodeDriver(components.env, components.chat, components.collector.max_len)
    rng = np.random.default_rng(_CONFIG.value.seed + 5)
    tasks = list(components.val_tasks)
    if _SPLIT.value == "train":
        sample = np.random.default_rng(_CONFIG.value.seed + 6).choice(len(components.train_tasks), len(tasks), replace=False)
        tasks = [components.train_tasks[i] for i in sorted(sample)]
    cases = hop_cases(driver, tasks, forced_hop_teacher(components.warmup, rng), _PER_TASK.value)
    print(f"{len(cases)} hop cases from {len(tasks)} {'held-out' if _SPLIT.value == 'validation' else 'training'} tasks")
    results = {}
    for name, params in policies(workdir, components).items():
        max_len = components.collector.max_len
        results[name] = probe_hop_copy(cases, ModelPolicy(components.model_cfg, params, max_len), components.chat, max_len,
                                       components.collector.max_tokens_per_turn)
        print(f"\n{name} policy\n| task type | " + " | ".join(COLUMNS) + " |\n" + "|---" * (len(COLUMNS) + 1) + "|")
        for kind, m in results[name].items():
            print(f"| {kind} | {m['cases']} | " + " | ".join(f"{m[c]:.3f}" for c in COLUMNS[1:]) + " |")
        by_position = results[name]["all"]["id_token_accuracy_by_position"]
        print("identifier token accuracy by position (2nd, 3rd, ... token), all cases: "
              + " ".join(f"{a:.3f}" for a in by_position))
    if _OUT.value:
        pathlib.Path(_OUT.value).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    app.run(main)
