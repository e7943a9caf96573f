"""Train: ``python -m experiments.run --config=configs/default.py [--workdir=DIR] [--config.rl.loss=cispo]``.

Resumes automatically when the work directory already holds a checkpoint. Several processes (hosts):
start the same command on each with ``--coordinator_address=HOST:PORT --num_processes=N --process_id=I``
(or ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``), or with ``--distributed``
under SLURM or on a TPU pod slice, and one ``--workdir`` on a file system they share.
"""

if (
    __name__ == "__main__"
):  # first: the host allocator (glibc reads its tunables when the process starts; mtrl_jax/host.py)
    from mtrl_jax.host import prepare_process

    prepare_process()

import errno
import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mtrl_jax import distributed, trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "ml_collections config file", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", "workdirs/default", "checkpoints, logs, trajectories and summary.json go here"
)
_STAGE = flags.DEFINE_enum(
    "stage",
    "all",
    ["all", "warmup"],
    "all: warm-up, RL, evaluations; warmup: the warm-up alone (experiments.ablate shares it between arms)",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "multi-process: HOST:PORT of process 0 (default: $JAX_COORDINATOR_ADDRESS)"
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "multi-process: how many (default: $JAX_NUM_PROCESSES)")
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "multi-process: this one's index (default: $JAX_PROCESS_ID)")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    False,
    "multi-process, with the rest detected by JAX (SLURM, a Cloud TPU pod slice, Open MPI, Kubernetes)",
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint step at INFO
    logging.getLogger("mtrl_jax").setLevel(logging.INFO)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s", level=logging.WARNING)
    from mtrl_jax.setup import build_data, check_config

    # a bad field or a bad data file is said in one line, before the work directory (or anything else) exists
    try:
        check_config(_CONFIG.value)
    except ValueError as e:
        logging.getLogger("mtrl_jax").error("stopped: the config: %s", e)
        sys.exit(2)
    try:
        data = build_data(_CONFIG.value)
    except (ValueError, OSError) as e:
        logging.getLogger("mtrl_jax").error("stopped: the data: %s", e)
        sys.exit(2)
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _DISTRIBUTED.value)
    try:
        trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value, _STAGE.value, data=data)
    except Exception as e:  # noqa: BLE001 - a known cause is said in one line; anything else keeps its traceback
        cause = stopping_cause(e)
        if cause is None:
            raise
        logging.getLogger("mtrl_jax").error("stopped: %s: %s", type(cause).__name__, cause)
        sys.stdout.flush()
        sys.stderr.flush()
        # not sys.exit: the checkpoint writer's threads would print their own failures again at interpreter exit
        os._exit(1)


DISK_FULL = ("No space left on device", "Disk quota exceeded", "File too large")


def stopping_cause(error: BaseException):
    """The error, or one it was raised from, that a user acts on without a traceback: the tool service
    down or missing a collection, a checkpoint or work directory that cannot be used, non-finite updates
    in a row, a full disk; ``None`` for anything else (a bug: its traceback is wanted)."""
    from mtrl_jax.checkpoint import CheckpointError, WorkdirInUse
    from mtrl_jax.rollout.interfaces import ServiceDown

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (ServiceDown, ConnectionError, CheckpointError, FloatingPointError, WorkdirInUse)):
            return error
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return error
        if any(full in str(error) for full in DISK_FULL):  # the checkpoint writer's own errors (ValueError)
            return error
        error = error.__cause__ or error.__context__
    return None


if __name__ == "__main__":
    app.run(main)
