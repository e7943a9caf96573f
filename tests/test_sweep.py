"""The seed sweep's bookkeeping: a run's wall time adds up over a stop and a resume."""

import subprocess
import sys

import pytest

from experiments.sweep import timed_run


def test_a_stopped_and_resumed_run_adds_its_invocations_seconds(tmp_path):
    wall = tmp_path / "seed_0" / "wall_seconds.txt"
    sleep = [sys.executable, "-c", "import time; time.sleep(0.6)"]
    timed_run(sleep, wall, every_s=0.1)
    first = float(wall.read_text())
    assert 0.6 <= first < 10
    with pytest.raises(subprocess.CalledProcessError):  # a stopped invocation: its seconds still count
        timed_run([sys.executable, "-c", "import time, sys; time.sleep(0.6); sys.exit(3)"], wall, every_s=0.1)
    second = float(wall.read_text())
    assert second >= first + 0.6
    timed_run(sleep, wall, every_s=10.0)  # the end is recorded even between two updates
    assert float(wall.read_text()) >= second + 0.6
