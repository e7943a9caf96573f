"""The host allocator policy applied on import (mtrl_jax/host.py), in fresh processes."""

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import(policy):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("MTRL_JAX_MALLOC", None)
    env.pop("MALLOC_ARENA_MAX", None)
    if policy is not None:
        env["MTRL_JAX_MALLOC"] = policy
    return subprocess.run([sys.executable, "-c", "import mtrl_jax.host as h; print(sorted(h.applied.items()))"],
                          env=env, capture_output=True, text=True, check=False)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_import_sets_the_thresholds_unless_told_not_to():
    tuned = _import(None)
    assert tuned.returncode == 0, tuned.stderr
    assert tuned.stdout.strip() == str([("arena_max", 1), ("mmap_threshold", 1 << 30), ("trim_threshold", -1)])
    thresholds = _import("thresholds")
    assert thresholds.returncode == 0, thresholds.stderr
    assert thresholds.stdout.strip() == str([("mmap_threshold", 1 << 30), ("trim_threshold", -1)])
    default = _import("default")
    assert default.returncode == 0 and default.stdout.strip() == "[]", default.stderr


def test_an_unknown_policy_is_an_error_naming_the_variable():
    bad = _import("fast")
    assert bad.returncode != 0
    assert "MTRL_JAX_MALLOC='fast'" in bad.stderr and "'tuned'" in bad.stderr


_FAULTS = """
import mtrl_jax, resource, statistics, jax, jax.numpy as jnp
def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) @ w.T)
step = jax.jit(jax.grad(loss))
w, x = jnp.full((256, 4096), 0.01), jnp.full((8192, 256), 0.5)
temp = step.lower(w, x).compile().memory_analysis().temp_size_in_bytes
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(step(w, x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(temp // 4096, statistics.median(faults[1:]))
"""


def _faults(policy):
    env = dict(os.environ, PYTHONPATH=ROOT, MTRL_JAX_MALLOC=policy, JAX_PLATFORMS="cpu")
    env.pop("MALLOC_ARENA_MAX", None)  # the parent (this test process) put it there
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    pages, median = done.stdout.split()
    return int(pages), float(median)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_a_large_temporary_buffer_is_not_page_faulted_in_on_every_call():
    """A jitted program whose temporaries exceed 64 MiB (a non-main arena's heap): with the arena
    limit its buffer is reused from one call to the next; with the thresholds alone, when XLA runs
    the program on a thread of its own, every call faults all of its pages in again."""
    pages, tuned = _faults("tuned")
    assert pages > (64 << 20) // 4096
    assert tuned < 0.1 * pages, f"{tuned} page faults per call with the arena limit, for a {pages}-page buffer"
    _, thresholds = _faults("thresholds")
    if thresholds < 0.5 * pages:
        pytest.skip(f"XLA ran the program where the thresholds alone suffice ({thresholds} faults per call)")
