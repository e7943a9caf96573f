"""Test setup: 8 fake CPU devices for sharding tests (must happen before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] += (
    "" if "device_count" in os.environ["XLA_FLAGS"] else " --xla_force_host_platform_device_count=8"
)
import envs  # noqa: E402
from envs import FAST_COMPILE  # noqa: E402 - optimisation level 0: see envs.py

if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One XLA compilation cache for the whole test session, shared with the subprocesses the tests start
# (the trainer tests run `experiments.run` two or three times on the same config). It starts empty in a
# fresh temporary folder, so every program is still compiled once per session; later compiles of the
# same program load it instead. MTRL_TEST_COMPILE_CACHE=0 turns it off; a JAX_COMPILATION_CACHE_DIR set
# by the user is left alone.
if os.environ.get("MTRL_TEST_COMPILE_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="mtrl_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds; deselect with -m 'not slow'")
    config.addinivalue_line("markers", "background(name): reads the run ``name`` started ahead (envs.background)")


def pytest_collection_finish(session):
    """The selected tests' background runs (``envs.background``) start now, in the order of their tests."""
    if session.config.option.collectonly:
        return
    names = [m.args[0] for item in session.items for m in item.iter_markers("background")]
    envs.start_background(list(dict.fromkeys(names)))


@pytest.fixture
def shared_data():
    """Path to ../shared/data; skips the test when the collections are absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared IR collections not found at {SHARED_DATA}")
    return SHARED_DATA
