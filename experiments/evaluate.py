"""Evaluate: ``python -m experiments.evaluate --config=configs/default.py --checkpoint=workdirs/default --out=DIR``.

Without ``--checkpoint`` the base policy is evaluated (the untrained tiny model, or the HF checkpoint of a
real config); with ``--stage=warmup`` the run's finished cold start, the policy RL started from. The dev split is
the default. ``--split=test --checkpoint=WORKDIR`` is the only way to the test split: read it once per final
config; each reading appends a line to ``WORKDIR/test_evaluations.jsonl`` and prints how many there have
been. ``--samples=k`` draws k samples per query (at the rollout temperature) for pass@k and max@k;
``--compare=OTHER_OUT`` adds a base -> fine-tuned table.
"""

if (
    __name__ == "__main__"
):  # first: the host allocator (glibc reads its tunables when the process starts; mtrl_jax/host.py)
    from mtrl_jax.host import prepare_process

    prepare_process()

import logging

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from mtrl_jax.evaluate import EVAL_SPLITS, STAGES, run_evaluation

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/default.py", "ml_collections config file", lock_config=True
)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a training work directory (its latest checkpoint is used)")
_OUT = flags.DEFINE_string("out", "workdirs/eval", "where eval.json, eval.md and the run files go")
_SAMPLES = flags.DEFINE_integer("samples", 1, "samples per query (k of pass@k and max@k)")
_TAU = flags.DEFINE_float("tau", 0.5, "nDCG@10 threshold of a success for pass@k")
_COMPARE = flags.DEFINE_string("compare", None, "another evaluation output directory to compare against")
_SPLIT = flags.DEFINE_enum(
    "split",
    "dev",
    list(EVAL_SPLITS),
    "dev (every choice is made here), or test: read once per final config, with --checkpoint; each reading "
    "appends a line to WORKDIR/test_evaluations.jsonl and says how many there have been",
)
_STAGE = flags.DEFINE_enum(
    "stage",
    "rl",
    list(STAGES),
    "with --checkpoint: RL's latest checkpoint, or the finished warm-up RL started from",
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("mtrl_jax").setLevel(logging.INFO)
    run_evaluation(
        _CONFIG.value,
        _OUT.value,
        _CHECKPOINT.value,
        _SAMPLES.value,
        _TAU.value,
        _COMPARE.value,
        _STAGE.value,
        _SPLIT.value,
    )
    from pathlib import Path

    print((Path(_OUT.value) / "eval.md").read_text())
    if _COMPARE.value:
        print((Path(_OUT.value) / "compare.md").read_text())


if __name__ == "__main__":
    app.run(main)
