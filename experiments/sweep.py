"""The seed sweep: one ``experiments.run`` per seed of a config, each in its own work directory, a run
whose ``summary.json`` exists left as it is (so a sweep resumes), its wall time recorded.

``experiments.ablate`` runs one sweep per cell of its grid; the benchmarks run one per config
(``benchmarks/common.py``).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from typing import Sequence


def run_seeds(
    config: str,
    seeds: Sequence[int],
    out: pathlib.Path,
    overrides: Sequence[str] = (),
    per_seed: Sequence[str] = ("--config.seed={seed}",),
    cwd: pathlib.Path | None = None,
    label: str = "",
) -> dict:
    """Run ``python -m experiments.run --config=CONFIG`` for each seed in ``<out>/seed_<s>`` (``per_seed``
    flags formatted with the seed, then ``overrides``); returns ``{seed: summary.json}``. Each run's
    wall seconds go to ``<workdir>/wall_seconds.txt``."""
    out = pathlib.Path(out)
    for seed in seeds:
        workdir = out / f"seed_{seed}"
        if (workdir / "summary.json").exists():
            print(f"{label}[seed {seed}] done already", flush=True)
            continue
        cmd = [
            sys.executable,
            "-m",
            "experiments.run",
            f"--config={config}",
            f"--workdir={workdir}",
            *[flag.format(seed=seed) for flag in per_seed],
            "--config.log.progress=False",
            *overrides,
        ]
        print(f"{label}[seed {seed}] " + " ".join(cmd[2:]), flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=cwd)
        (workdir / "wall_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
    return seed_summaries(out, seeds)


def seed_summaries(out: pathlib.Path, seeds: Sequence[int]) -> dict:
    """``{seed: summary.json}`` of a sweep's finished runs, with ``"wall_seconds"`` where it was recorded."""
    summaries = {}
    for seed in seeds:
        workdir = pathlib.Path(out) / f"seed_{seed}"
        summary = json.loads((workdir / "summary.json").read_text())
        wall = workdir / "wall_seconds.txt"
        if wall.exists():
            summary["wall_seconds"] = float(wall.read_text())
        summaries[seed] = summary
    return summaries


def load_config(path: str, overrides: Sequence[str] = ()):
    """The config file at ``path`` with ``--config.<field>=<value>`` overrides, parsed exactly as
    ``experiments.run`` parses them (absl flags over ``ml_collections``), locked."""
    from absl import flags
    from ml_collections import config_flags

    argv = ["sweep", f"--config={path}", *overrides]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", path, flag_values=values, lock_config=True, sys_argv=argv)
    values(argv, known_only=True)
    return values.config
