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

WALL_EVERY_S = 30.0  # how often a running seed's wall_seconds.txt is brought up to date


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
    wall seconds go to ``<workdir>/wall_seconds.txt``, brought up to date every ``WALL_EVERY_S`` while it
    runs: a run stopped and resumed (its checkpoints) adds its invocations' seconds up, to within that."""
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
        timed_run(cmd, workdir / "wall_seconds.txt", cwd)
    return seed_summaries(out, seeds)


def timed_run(cmd: Sequence[str], wall: pathlib.Path, cwd=None, every_s: float = WALL_EVERY_S) -> None:
    """Run ``cmd``; ``wall`` holds the seconds it has taken, written every ``every_s`` while it runs and
    at its end, added to what ``wall`` held (an earlier invocation of a run that was stopped and resumed).
    A non-zero exit raises ``CalledProcessError``, its seconds recorded."""
    before = float(wall.read_text()) if wall.exists() else 0.0
    start = time.perf_counter()
    with subprocess.Popen(list(cmd), cwd=cwd) as run:
        while True:
            try:
                run.wait(timeout=every_s)
                break
            except subprocess.TimeoutExpired:
                pass
            finally:
                wall.parent.mkdir(parents=True, exist_ok=True)
                wall.write_text(f"{before + time.perf_counter() - start:.1f}\n")
    if run.returncode:
        raise subprocess.CalledProcessError(run.returncode, list(cmd))


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
