"""Two work directories compared bit for bit: the checkpoint of one RL step (parameters, optimizer state, step,
random key) and every step's metrics, times and throughput aside. What a behaviour-preserving change is checked
with: the same command (``--config.rollout.asynchronous=False --config.rollout.tool_workers=0``, so that a run
is bitwise reproducible) at the commit before and after it.

    python -m tools.compare_runs workdirs/before workdirs/after [--step 2]

Prints the differing tensors and metrics; exits 1 when anything differs (or a checkpoint is missing), 0 when
both runs are the same to the last bit.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

VOLATILE = ("time/", "throughput/", "memory/")  # a run's speed, not its result


def differences(a: pathlib.Path, b: pathlib.Path, step: int) -> list[str]:
    """What differs between the two runs' checkpoint ``step`` and their step metrics."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    def state(workdir):
        path = pathlib.Path(workdir).absolute() / "checkpoints"
        if not (path / str(step)).is_dir():
            raise FileNotFoundError(f"{path / str(step)}: no checkpoint of RL step {step}")
        manager = ocp.CheckpointManager(path)
        try:
            return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
        finally:
            manager.close()

    def metrics(workdir):
        rows = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and "compile" not in k} for r in rows]

    out = []
    left, right = jax.tree_util.tree_leaves_with_path(state(a)), jax.tree.leaves(state(b))
    if len(left) != len(right):
        return [f"the checkpoints hold {len(left)} and {len(right)} tensors"]
    for (path, x), y in zip(left, right):
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            out.append(f"state{jax.tree_util.keystr(path)}")
    ma, mb = metrics(a), metrics(b)
    if len(ma) != len(mb):
        out.append(f"metrics.jsonl: {len(ma)} and {len(mb)} steps")
    for x, y in zip(ma, mb):
        out += [f"metrics step {x.get('step')}: {k} {x[k]!r} vs {y.get(k)!r}" for k in sorted(x) if x[k] != y.get(k)]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=pathlib.Path, help="a work directory")
    parser.add_argument("b", type=pathlib.Path, help="the other work directory")
    parser.add_argument("--step", type=int, default=2, help="the RL step whose checkpoint is compared")
    args = parser.parse_args(argv)
    try:
        found = differences(args.a, args.b, args.step)
    except FileNotFoundError as e:
        sys.exit(f"compare_runs: {e}")
    for line in found[:50]:
        print(line)
    print(f"{len(found)} differences" if found else "bitwise the same: checkpoint and step metrics")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
