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
    if policy is not None:
        env["MTRL_JAX_MALLOC"] = policy
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
