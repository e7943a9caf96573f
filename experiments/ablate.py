"""Ablations that share their cold start and their randomness:

    python -m experiments.ablate --config=configs/default.py --grid rl.loss=ppo,cispo,is \\
        --grid rl.advantage=grpo,rloo,grpo_passk --seeds 0,1,2,3,4 --out workdirs/ablate [--config.x=y ...]

Every arm (a cell of the grid) runs once per seed as ``experiments.run`` in ``<out>/<arm>/seed_<s>``. Arms of
one seed share:

* **the cold start.** It is trained once per seed and per value of the fields it reads (``warmup_key``: the
  config without the fields only RL and the evaluations read, ``RL_ONLY``), as ``experiments.run
  --stage=warmup`` in ``<out>/warmups/<key>``; each arm starts from a copy of it (``warmup/`` and
  ``tokenizer.json``), so it is a run that resumes after its cold start. A grid field the cold start reads gives
  each of its values its own cold start.
* **their random numbers.** The run's streams are named and seeded by the seed alone (``mtrl_jax.rng``):
  the same task order, the same per-episode sampling keys, the same evaluation keys. Arms differ only in
  what the grid changes, and an arm gives the parameters of a standalone ``experiments.run`` of that seed
  and config (``tests/test_ablate.py``, with ``rollout.asynchronous=False rollout.tool_workers=0``).

A finished arm (its ``summary.json``) or cold start is not run again, so the command resumes. Then, on the dev
split's per-query nDCG@10 after RL (``trajectories/eval_after.jsonl``):

* ``results.json``: ``arms`` (per arm ``mean``, ``ci95``, ``n``, the failure rate and the dev curve),
  ``pairs`` (per pair of arms ``a``, ``b``, ``diff`` = a - b, its paired ``ci95`` over the same seeds and
  queries, ``separated`` when that interval excludes 0), ``warmups`` (trained, reused) and the seconds;
* ``results.md``: the same as tables; ``results.png``: each arm's mean with its interval bar.

``--focus TYPE`` adds the same tables on the dev queries of one task type (``synthetic/multihop``); ``--reach X``
the RL steps each run took to first reach a dev nDCG@10 of X (of the focus type), from its dev curve (give
``--eval-every``). The report: ``experiments/ablate_report.py``. Intervals: ``mtrl_jax.stats`` (a two-way
bootstrap over seeds and queries; t over seeds for steps). How to read them: docs/ablations.md.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import pathlib
import shutil
import sys
import time

from experiments.ablate_report import markdown, plot, report
from experiments.sweep import load_config, timed_run
from mtrl_jax.metrics import flatten

# Fields no part of the cold start reads (the RL objective and optimizer, the rollout's sampling and scheduling,
# the evaluations, checkpoints and logs). Every other field is part of the cold start's key: a field missing
# here costs a cold start more, never a wrong share.
RL_ONLY_PREFIXES = ("rl.", "optim.", "eval.", "checkpoint.", "log.")
RL_ONLY_FIELDS = {
    "max_steps",
    "max_epochs",
    "global_batch_size",
    "rollout_max_concurrency",
    "compilation_cache_dir",
    "rollout.group_size",
    "rollout.temperature",
    "rollout.top_p",
    "rollout.decode_chunk",
    "rollout.tool_workers",
    "rollout.precompile",
    "rollout.share_prefixes",
    "rollout.param_dtype",
    "rollout.asynchronous",
    "rollout.max_staleness",
    "data.curriculum_max_baseline",  # RL's tasks only: the cold start demonstrates every training query
}
WARMUP_READS_RL = {"rl.logprob_chunk", "rl.max_nonfinite_steps"}  # under rl., but the cold start's step reads them
SHARED_FILES = ("warmup", "tokenizer.json")  # what an arm's work directory gets from its seed's cold start


def reads_warmup(field: str) -> bool:
    """Whether the cold start may read ``field`` (a dotted config path)."""
    if field in WARMUP_READS_RL:
        return True
    return not (field in RL_ONLY_FIELDS or field.startswith(RL_ONLY_PREFIXES))


def warmup_key(config) -> str:
    """A hash of every field the cold start may read (the seed included): two configs with the same key
    cold-start to the same parameters."""
    fields = {k: v for k, v in flatten(config.to_dict(), sep=".").items() if reads_warmup(k)}
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def parse_grid(items):
    """``--grid`` items as ``[(fields, values)]``: ``field=v1,v2`` gives one field; ``f1+f2=a1+a2,b1+b2``
    varies fields together (each value names one value per field), for settings valid only jointly, such as
    ``model.lora_rank+warmup.train_base=0+False,8+True``."""
    grid = []
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--grid {item!r}: expected field=value1,value2 or field1+field2=a1+a2,b1+b2")
        spec, values = item.split("=", 1)
        fields = tuple(spec.split("+"))
        values = [tuple(v.split("+")) for v in values.split(",") if v]
        if not values:
            raise SystemExit(f"--grid {item!r}: no values")
        for value in values:
            if len(value) != len(fields):
                raise SystemExit(
                    f"--grid {item!r}: value {'+'.join(value)!r} gives {len(value)} values for "
                    f"{len(fields)} fields ({spec})"
                )
        grid.append((fields, values))
    return grid


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1,2,3,4") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds {text!r}: expected distinct seeds")
    return seeds


def grid_cells(grid) -> list[tuple]:
    """Every arm of ``grid`` (``parse_grid``'s): a tuple of ``(field, value)``, in the grid's order."""
    cells = []
    for choice in itertools.product(*[values for _, values in grid]):
        cells.append(tuple(pair for (fields, _), value in zip(grid, choice) for pair in zip(fields, value)))
    return cells


def cell_name(cell) -> str:
    return ",".join(f"{field.split('.')[-1]}={value}" for field, value in cell)


class Ablation:
    """The arms x seeds of a grid, their shared cold starts, and the runs' commands."""

    def __init__(self, config_path: str, grid, seeds, out: pathlib.Path, overrides, eval_every: int):
        self.config_path, self.seeds, self.out = config_path, seeds, pathlib.Path(out)
        self.overrides = [f"--config.eval.every_steps={eval_every}", *overrides]
        self.cells = grid_cells(grid)
        self.used: dict = {}  # (cell, seed) -> the cold start directory its arm started from
        self.trained_now = 0  # cold starts trained by this invocation (a rerun finds the others done)

    def flags(self, cell, seed: int) -> list[str]:
        return [f"--config.seed={seed}", *self.overrides, *[f"--config.{f}={v}" for f, v in cell]]

    def warmup_dir(self, cell, seed: int) -> pathlib.Path | None:
        config = load_config(self.config_path, self.flags(cell, seed))
        if not config.warmup.steps:
            return None
        return self.out / "warmups" / f"seed_{seed}-{warmup_key(config)}"

    def run(self, cmd_flags, workdir: pathlib.Path, stage: str = "all", label: str = "") -> None:
        cmd = [
            sys.executable,
            "-m",
            "experiments.run",
            f"--config={self.config_path}",
            f"--workdir={workdir}",
            f"--stage={stage}",
            "--config.log.progress=False",
            *cmd_flags,
        ]
        print(f"{label}{' '.join(cmd[2:])}", flush=True)
        timed_run(cmd, workdir / "wall_seconds.txt")

    def warm_up(self, cell, seed: int, where: pathlib.Path) -> None:
        """The seed's cold start for ``cell`` in ``where`` (trained now unless an earlier arm or invocation has it)."""
        if not (where / "warmup_done").exists():
            self.run(self.flags(cell, seed), where, "warmup", f"[warm-up seed {seed}] ")
            (where / "warmup_done").write_text(f"{cell_name(cell)}\n")
            self.trained_now += 1

    def warmup_counts(self) -> dict:
        """``trained``: the cold starts the arms started from (each trained once); ``reused``: the arm runs that
        started from one trained for another arm; ``trained_now``: those this invocation trained."""
        arms = len(self.cells) * len(self.seeds)
        trained = len(set(self.used.values()))
        return {"trained": trained, "reused": arms - trained, "trained_now": self.trained_now}

    def arm(self, cell, seed: int) -> pathlib.Path:
        workdir = self.out / cell_name(cell) / f"seed_{seed}"
        shared = self.warmup_dir(cell, seed)
        if shared is not None:
            self.used[(cell, seed)] = shared
        if (workdir / "summary.json").exists():
            print(f"[{cell_name(cell)}] [seed {seed}] done already", flush=True)
            return workdir
        if shared is not None:
            self.warm_up(cell, seed, shared)
        if shared is not None and not (workdir / "checkpoints").exists():
            workdir.mkdir(parents=True, exist_ok=True)
            for name in SHARED_FILES:
                source, target = shared / name, workdir / name
                if target.exists():
                    shutil.rmtree(target) if target.is_dir() else target.unlink()
                if source.is_dir():
                    shutil.copytree(source, target)
                elif source.exists():
                    shutil.copy2(source, target)
        self.run(self.flags(cell, seed), workdir, label=f"[{cell_name(cell)}] [seed {seed}] ")
        return workdir

    def arm_wall_seconds(self, cell) -> float:
        return sum(wall_seconds(self.out / cell_name(cell) / f"seed_{s}") for s in self.seeds)

    def warmup_wall_seconds(self) -> float:
        return sum(wall_seconds(p) for p in (self.out / "warmups").glob("seed_*"))


def wall_seconds(workdir: pathlib.Path, missing: float = 0.0) -> float:
    """The seconds a run (or a cold start) took, as ``experiments.sweep.timed_run`` records them."""
    wall = workdir / "wall_seconds.txt"
    return float(wall.read_text()) if wall.exists() else missing


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.py")
    parser.add_argument(
        "--grid", action="append", default=[], help="field=value1,value2 or f1+f2=a1+a2,b1+b2 (repeatable)"
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, e.g. 0,1,2,3,4")
    parser.add_argument("--out", default="workdirs/ablate")
    parser.add_argument("--eval-every", type=int, default=0, help="dev evaluation every N RL steps (0: before/after)")
    parser.add_argument("--focus", default=None, help="also report the dev queries of this task type alone")
    parser.add_argument(
        "--reach", type=float, default=None, help="also report the RL steps to reach this dev nDCG@10 (of --focus)"
    )
    args, overrides = parser.parse_known_args(argv)
    for o in overrides:
        if not o.startswith("--config."):
            raise SystemExit(f"unknown argument {o!r}")
        if o.startswith("--config.seed="):
            raise SystemExit("--config.seed: give the seeds with --seeds")
    grid = parse_grid(args.grid)
    if not grid:
        raise SystemExit("give at least one --grid field=values")
    started = time.perf_counter()
    ablation = Ablation(args.config, grid, parse_seeds(args.seeds), pathlib.Path(args.out), overrides, args.eval_every)
    for seed in ablation.seeds:  # seed by seed: a seed's cold start is trained once, then its arms run
        for cell in ablation.cells:
            ablation.arm(cell, seed)
    results = report(ablation, started, args.focus, args.reach)
    out = ablation.out
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    plot(results, out / "results.png")
    print(markdown(results))
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and {out / 'results.png'}")


if __name__ == "__main__":
    main()
