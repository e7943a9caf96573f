"""Train: ``python -m experiments.run --config=configs/default.py [--workdir=DIR] [--config.rl.loss=cispo]``.

Resumes automatically when the work directory already holds a checkpoint.
"""

import logging

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mtrl_jax import trainer

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "ml_collections config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/default", "checkpoints, logs, trajectories and summary.json go here")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint step at INFO
    logging.getLogger("mtrl_jax").setLevel(logging.INFO)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s", level=logging.WARNING)
    trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
