"""What every benchmark shares: the machine it ran on, both sides of a comparison alternated, their
medians and ratio, a git worktree of another commit to measure side by side, child processes that
time one side each, the model shapes of the throughput benchmarks, the optional torch side, and the
seed sweep (``experiments.sweep``, which ``experiments.ablate`` uses too).

Every benchmark prints ``machine_line()`` first: a figure belongs to the machine it was measured on
(``docs/results.md`` gives it beside each value).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Mapping, Sequence

from mtrl_jax.model import ModelConfig

REPO = pathlib.Path(__file__).resolve().parents[1]

# the embedded default's policy, and a 30M Qwen3 (4 layers, hidden 512, vocabulary 32k)
SHAPES = {
    "tiny": dict(
        vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32
    ),
    "30m": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    ),
}


def model_config(name: str, **runtime) -> ModelConfig:
    """A Qwen3 config (q/k norms, tied embeddings) of shape ``name``, with ModelConfig runtime fields."""
    return ModelConfig(
        **SHAPES[name], model_type="qwen3", qk_norm=True, tie_word_embeddings=True, rope_theta=10000.0, **runtime
    )


def cpu_model() -> str:
    """The processor's model name and the cores this process may use."""
    name = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


def matmul_peak(repeats: int = 5, n: int = 2048) -> float:
    """FLOP/s of a float32 ``n^3`` ``jnp.dot`` on the default device (median of ``repeats``): the peak a
    benchmark's share-of-peak figures are taken against."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def machine_line(peak: bool = True) -> str:
    """``machine: <CPU model>, <cores>[, <device>]; float32 matmul peak <X> GFLOP/s``: every benchmark's first line."""
    import jax

    device = jax.devices()[0]
    line = f"machine: {cpu_model()}"
    if device.platform != "cpu":
        line += f"; device {device.device_kind} x {jax.device_count()}"
    if peak:
        line += f"; float32 matmul peak {matmul_peak() / 1e9:.1f} GFLOP/s (jnp.dot 2048^3)"
    return line


def alternate(fns: Mapping[str, Callable[[], object]], repeats: int) -> tuple[dict, dict]:
    """Median seconds of each function, calls alternated ``repeats`` times after one cold start call each
    (which compiles), and each function's cold start output."""
    outputs = {name: fn() for name, fn in fns.items()}
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def ratio(new: float, baseline: float) -> str:
    """``"1.23x"``: how many times faster ``new`` seconds are than ``baseline`` seconds."""
    return f"{baseline / new:.2f}x"


@contextlib.contextmanager
def worktree(revision: str):
    """A detached git worktree of ``revision`` in a temporary folder, removed (folder and git's record) on exit."""
    with tempfile.TemporaryDirectory(prefix="bench_baseline_") as folder:
        tree = pathlib.Path(folder) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-f", str(tree), revision], cwd=REPO, check=True, capture_output=True
        )
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


def child_value(cmd: Sequence[str], cwd: pathlib.Path, key: str, env: Mapping[str, str] | None = None) -> float:
    """Run ``cmd`` in ``cwd`` (a checkout: its ``mtrl_jax`` is the one imported) and return the number its
    output gives on the last line that starts with ``key``."""
    done = subprocess.run(list(cmd), cwd=cwd, env=dict(env or os.environ), capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(key)]
    if done.returncode or not lines:
        raise RuntimeError(
            f"{' '.join(cmd)} in {cwd} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    return float(lines[-1].split()[1])


def alternate_checkouts(
    script: pathlib.Path, args: Sequence[str], key: str, revision: str, rounds: int
) -> dict[str, list[float]]:
    """``python SCRIPT ARGS`` (a child that prints ``key <value>``) with ``mtrl_jax`` imported from this
    checkout and from a worktree of ``revision``, alternated ``rounds`` times: ``{"this tree": [...],
    revision: [...]}``. The script itself is this checkout's on both sides (it may not exist there)."""
    values: dict = {"this tree": [], revision: []}
    with worktree(revision) as tree:
        for _ in range(rounds):
            for side, root in (("this tree", REPO), (revision, tree)):
                env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}"}
                values[side].append(child_value([sys.executable, str(script), *args], root, key, env))
    return values


def run_seeds(*args, **kwargs) -> dict:
    """The seed sweep, ``experiments.sweep.run_seeds`` (imported here when used: a child that imports
    this module from another checkout's ``experiments`` need not have it)."""
    from experiments.sweep import run_seeds as sweep

    return sweep(*args, **kwargs)


def read_test(config: str, workdir: pathlib.Path, target: pathlib.Path, flags: Sequence[str] = (), stage="rl") -> dict:
    """``test_scores.json`` of ``workdir``'s test split (its RL policy, or with ``stage="warmup"`` its cold start,
    and the one-search baselines on the same queries), read once through ``experiments.evaluate --split=test``
    and its ledger into ``target``; a reading already in ``target`` is loaded, not made again."""
    import json

    if not (target / "test_scores.json").exists():
        cmd = [sys.executable, "-m", "experiments.evaluate", f"--config={config}", "--split=test"]
        cmd += [f"--checkpoint={workdir}", f"--stage={stage}", f"--out={target}", *flags]
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    return json.loads((target / "test_scores.json").read_text())


def import_torch(what: str):
    """``(torch, transformers)``, or ``(None, None)`` with a message saying that ``what`` is skipped."""
    try:
        import torch
        import transformers
    except ImportError as e:
        print(
            f"torch/transformers are not installed ({e}): {what} is skipped "
            f"(pip install -r tools/requirements-fixtures.txt to measure it)"
        )
        return None, None
    return torch, transformers
