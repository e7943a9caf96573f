"""Test setup: 8 fake CPU devices for sharding tests (must happen before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] += "" if "device_count" in os.environ["XLA_FLAGS"] else " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds; deselect with -m 'not slow'")


@pytest.fixture
def shared_data():
    """Path to ../shared/data; skips the test when the collections are absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared IR collections not found at {SHARED_DATA}")
    return SHARED_DATA
