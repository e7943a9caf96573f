"""Print a readable, turn-by-turn view of the trajectories of one RL step (or an evaluation).

    python scripts/show_trajectories.py --workdir workdirs/default                 # the latest step
    python scripts/show_trajectories.py --workdir workdirs/default --step 12 --limit 3
    python scripts/show_trajectories.py --file workdirs/default/trajectories/eval_after.jsonl
"""

import argparse
import json
import pathlib
import sys


def render(record: dict, max_chars: int) -> str:
    clip = lambda s: s if len(s) <= max_chars else s[:max_chars] + f"... [{len(s) - max_chars} more chars]"  # noqa: E731
    lines = [f"== {record['task_id']} (group {record['group_id']}, sample {record['sample_index']}) "
             f"reward {record['reward']:.4f} status {record['status']} turns {record['num_turns']} "
             f"sampled tokens {record['num_sampled_tokens']} versions {record['param_versions']}"]
    for turn in record["turns"]:
        lines.append(f"  -- turn {turn.get('index', '?')} ({turn.get('stop_reason')}, tools {turn.get('latency_s', 0.0) * 1000:.1f} ms)")
        lines.append("     assistant: " + clip(turn["text"]).replace("\n", "\n                "))
        for call in turn.get("calls", []):
            if call["error"]:
                lines.append(f"     tool error: {call['error']}")
            else:
                lines.append(f"     {call['name']}({json.dumps(call['arguments'])}) -> {call['doc_ids']}")
        if "answer_source" in turn:
            lines.append(f"     answer ({turn['answer_source']}): {record['final_ranking']}")
    if record.get("counters"):
        lines.append(f"  counters: {record['counters']}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir")
    parser.add_argument("--step", type=int, default=None, help="RL step (default: the latest)")
    parser.add_argument("--file", help="a trajectories JSONL file instead of --workdir/--step")
    parser.add_argument("--limit", type=int, default=0, help="show at most this many trajectories")
    parser.add_argument("--task", default=None, help="only this task id")
    parser.add_argument("--max-chars", type=int, default=400)
    args = parser.parse_args()
    if args.file:
        path = pathlib.Path(args.file)
    else:
        if not args.workdir:
            parser.error("give --workdir or --file")
        folder = pathlib.Path(args.workdir) / "trajectories"
        steps = sorted(folder.glob("step_*.jsonl"))
        if not steps:
            sys.exit(f"{folder}: no step_*.jsonl files")
        path = folder / f"step_{args.step:06d}.jsonl" if args.step is not None else steps[-1]
    if not path.exists():
        sys.exit(f"{path}: not found")
    shown = 0
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{line_no}: invalid JSON ({e.msg})")
            if args.task and record["task_id"] != args.task:
                continue
            print(render(record, args.max_chars))
            shown += 1
            if args.limit and shown >= args.limit:
                break
    print(f"({shown} trajectories from {path})")


if __name__ == "__main__":
    main()
