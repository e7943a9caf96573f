"""What the benchmarks share: the two model shapes the throughput issue measures, the optional
import of torch + transformers, and a git worktree of another commit to measure side by side."""

from __future__ import annotations

import contextlib
import pathlib
import subprocess
import tempfile

from mtrl_jax.model import ModelConfig

REPO = pathlib.Path(__file__).resolve().parents[1]

# the embedded default's policy, and a 30M Qwen3 (4 layers, hidden 512, vocabulary 32k)
SHAPES = {
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32),
    "30m": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=4,
                head_dim=64),
}


def model_config(name: str, **runtime) -> ModelConfig:
    """A Qwen3 config (q/k norms, tied embeddings) of shape ``name``, with ModelConfig runtime fields."""
    return ModelConfig(**SHAPES[name], model_type="qwen3", qk_norm=True, tie_word_embeddings=True, rope_theta=10000.0,
                       **runtime)


def import_torch(what: str):
    """``(torch, transformers)``, or ``(None, None)`` with a message saying that ``what`` is skipped."""
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"torch/transformers are not installed ({e}): {what} is skipped "
              f"(pip install -r scripts/requirements-fixtures.txt to measure it)")
        return None, None
    return torch, transformers


@contextlib.contextmanager
def worktree(revision: str):
    """A detached git worktree of ``revision`` in a temporary folder, removed (folder and git's record) on exit."""
    with tempfile.TemporaryDirectory(prefix="bench_baseline_") as folder:
        tree = pathlib.Path(folder) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), revision], cwd=REPO, check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
