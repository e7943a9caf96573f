"""The host allocator policy applied on import (mtrl_jax/host.py), in fresh processes."""

import os
import platform
import subprocess
import sys

import pytest

from mtrl_jax.host import huge_pages_possible

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**values):
    """This process's environment for a child, without the allocator settings (``values`` set them)."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("MTRL_JAX_MALLOC", "GLIBC_TUNABLES", "MTRL_JAX_REEXECUTED")}
    return dict(env, PYTHONPATH=ROOT, **values)


def _import(policy):
    env = _env() if policy is None else _env(MTRL_JAX_MALLOC=policy)
    return subprocess.run([sys.executable, "-c", "import mtrl_jax.host as h; print(sorted(h.applied.items()))"],
                          env=env, capture_output=True, text=True, check=False)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_import_sets_the_thresholds_unless_told_not_to():
    tuned = _import(None)
    assert tuned.returncode == 0, tuned.stderr
    assert tuned.stdout.strip() == str([("mmap_threshold", 1 << 30), ("trim_threshold", 1 << 30)])
    default = _import("default")
    assert default.returncode == 0 and default.stdout.strip() == "[]", default.stderr


def test_an_unknown_policy_is_an_error_naming_the_variable():
    bad = _import("fast")
    assert bad.returncode != 0
    assert "MTRL_JAX_MALLOC='fast'" in bad.stderr and "'tuned'" in bad.stderr


_RESTART = """
import os, sys
from mtrl_jax.host import reexec_with_tunables
print("run", os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
reexec_with_tunables()
import mtrl_jax.host as h
print("applied", sorted(h.applied))
"""


def _restart(**env_extra):
    done = subprocess.run([sys.executable, "-c", _RESTART, "an-argument"], env=_env(**env_extra), capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(not huge_pages_possible(), reason="needs glibc 2.35+ and transparent huge pages")
def test_an_entry_point_restarts_once_with_the_huge_page_tunable():
    # restarted once, same arguments, the tunable added (after any the user had), and recorded
    assert _restart() == ["run  ['an-argument']", "run glibc.malloc.hugetlb=1 ['an-argument']",
                          "applied ['hugetlb', 'mmap_threshold', 'trim_threshold']"]
    assert _restart(GLIBC_TUNABLES="glibc.malloc.tcache_count=8")[1] == \
        "run glibc.malloc.tcache_count=8:glibc.malloc.hugetlb=1 ['an-argument']"
    # no restart: the user's own setting of the tunable, or glibc's policy asked for
    assert _restart(GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == [
        "run glibc.malloc.hugetlb=0 ['an-argument']", "applied ['mmap_threshold', 'trim_threshold']"]
    assert _restart(MTRL_JAX_MALLOC="default") == ["run  ['an-argument']", "applied []"]


_FAULTS = """
import mtrl_jax, resource, statistics, jax, jax.numpy as jnp
def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) @ w.T)
step = jax.jit(jax.grad(loss))
w, x = jnp.full((256, 4096), 0.01), jnp.full((8192, 256), 0.5)
temp = step.lower(w, x).compile().memory_analysis().temp_size_in_bytes
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(step(w, x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(temp // 4096, statistics.median(faults[1:]))
"""


def _faults(hugetlb):
    env = _env(GLIBC_TUNABLES=f"glibc.malloc.hugetlb={hugetlb}", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    pages, median = done.stdout.split()
    return int(pages), float(median)


@pytest.mark.skipif(not huge_pages_possible(), reason="needs glibc 2.35+ and transparent huge pages")
def test_with_the_tunable_a_large_temporary_buffer_faults_in_by_huge_pages():
    """A jitted program whose temporaries exceed a thread arena's 64 MiB heap: XLA's thread maps them
    afresh on every call; with ``glibc.malloc.hugetlb=1`` they fault in 2 MiB at a time."""
    pages, huge = _faults(1)
    assert pages > (64 << 20) // 4096
    assert huge < 0.1 * pages, f"{huge} page faults per call with huge pages, for a {pages}-page buffer"
    _, small = _faults(0)
    if small < 0.5 * pages:
        pytest.skip(f"XLA reused this program's buffer without huge pages too ({small} faults per call)")
