"""Show what the agent saw: the trajectories of one RL step (or an evaluation), turn by turn, with
the relevance grade of every returned document next to its id and each trajectory's advantage.

    python -m tools.show_trajectories --workdir workdirs/default                 # the latest step
    python -m tools.show_trajectories --workdir workdirs/default --step 12 --limit 3
    python -m tools.show_trajectories --file workdirs/default/trajectories/eval_after.jsonl
    python -m tools.show_trajectories --workdir workdirs/default --step 12 --html step12.html

``--html`` writes one self-contained page (no scripts, no external files): one row per episode,
with its turns, tool calls, the returned documents coloured by grade, the final ranking, the
reward, the advantage and the failure reason. Documents show ``id(grade)``; a grade is that of the
task's relevance judgments (0: judged irrelevant or not judged).
"""

import argparse
import html
import json
import pathlib
import sys

GRADE_COLOURS = ["#e9e9e9", "#cfe8cf", "#8fd18f", "#4caf50", "#2e7d32"]  # 0, 1, 2, 3, 4+


def _grade(record: dict, doc_id: str):
    return record.get("grades", {}).get(doc_id)


def _docs_text(record: dict, doc_ids) -> str:
    return "[" + ", ".join(f"{d}({_grade(record, d)})" if _grade(record, d) is not None else d for d in doc_ids) + "]"


def _advantage(record: dict) -> str:
    return "not trained on" if record.get("advantage") is None else f"{record['advantage']:+.4f}"


def render(record: dict, max_chars: int) -> str:
    clip = lambda s: s if len(s) <= max_chars else s[:max_chars] + f"... [{len(s) - max_chars} more chars]"  # noqa: E731
    lines = [
        f"== {record['task_id']} [{record.get('type', '')}] (group {record['group_id']}, sample "
        f"{record['sample_index']}) "
        f"reward {record['reward']:.4f} advantage {_advantage(record)} status {record['status']} turns "
        f"{record['num_turns']} "
        f"sampled tokens {record['num_sampled_tokens']} versions {record['param_versions']}"
    ]
    if record.get("query"):
        lines.append(f"  question: {clip(record['query'])}")
    for turn in record["turns"]:
        lines.append(
            f"  -- turn {turn.get('index', '?')} ({turn.get('stop_reason')}, "
            f"tools {turn.get('latency_s', 0.0) * 1000:.1f} ms)"
        )
        lines.append("     assistant: " + clip(turn["text"]).replace("\n", "\n                "))
        for call in turn.get("calls", []):
            if call["error"]:
                lines.append(f"     tool error: {call['error']}")
            else:
                lines.append(
                    f"     {call['name']}({json.dumps(call['arguments'])}) -> {_docs_text(record, call['doc_ids'])}"
                )
        if "answer_source" in turn:
            lines.append(f"     answer ({turn['answer_source']}): {_docs_text(record, record['final_ranking'])}")
    if record.get("counters"):
        lines.append(f"  counters: {record['counters']}")
    return "\n".join(lines)


def _doc_chips(record: dict, doc_ids) -> str:
    chips = []
    for d in doc_ids:
        grade = _grade(record, d)
        colour = GRADE_COLOURS[min(grade, len(GRADE_COLOURS) - 1)] if grade is not None else "#ffffff"
        chips.append(
            f'<span class="doc" data-grade="{"" if grade is None else grade}" style="background:{colour}">'
            f'{html.escape(d)} <b>{"?" if grade is None else grade}</b></span>'
        )
    return " ".join(chips) or '<span class="none">no documents</span>'


def html_row(record: dict, max_chars: int) -> str:
    e = html.escape
    turns = []
    for turn in record["turns"]:
        text = turn["text"] if len(turn["text"]) <= max_chars else turn["text"][:max_chars] + "..."
        parts = [
            f'<div class="turn"><div class="meta">turn {turn.get("index", "?")} · '
            f'{e(str(turn.get("stop_reason")))}</div>',
            f"<pre>{e(text)}</pre>",
        ]
        for call in turn.get("calls", []):
            if call["error"]:
                parts.append(f'<div class="call error">tool error: {e(call["error"])}</div>')
            else:
                parts.append(
                    f'<div class="call">{e(str(call["name"]))}({e(json.dumps(call["arguments"]))}) → '
                    f'{_doc_chips(record, call["doc_ids"])}</div>'
                )
        if "answer_source" in turn:
            parts.append(
                f'<div class="answer">answer ({e(turn["answer_source"])}): '
                f'{_doc_chips(record, record["final_ranking"])}</div>'
            )
        parts.append("</div>")
        turns.append("".join(parts))
    failure = "" if record["status"] == "ok" else record["status"]
    advantage = _advantage(record)
    return (
        f'<tr class="episode{" failed" if failure else ""}">'
        f'<td class="task">{e(record["task_id"])}<br><small>{e(record.get("type", ""))} · group {record["group_id"]} · '
        f'sample {record["sample_index"]}</small><div class="query">{e(record.get("query", ""))}</div></td>'
        f'<td class="turns">{"".join(turns)}</td>'
        f'<td class="reward">{record["reward"]:.4f}</td><td class="advantage">{e(advantage)}</td>'
        f'<td class="failure">{e(failure) or "-"}</td></tr>'
    )


def html_page(records: list, title: str, max_chars: int = 2000) -> str:
    legend = " ".join(
        f'<span class="doc" style="background:{c}">grade {i}{"+" if i == len(GRADE_COLOURS) - 1 else ""}</span>'
        for i, c in enumerate(GRADE_COLOURS)
    )
    rows = "\n".join(html_row(r, max_chars) for r in records)
    rewards = [r["reward"] for r in records]
    failed = sum(r["status"] != "ok" for r in records)
    summary = (
        (f"{len(records)} episodes · mean reward {sum(rewards) / max(len(rewards), 1):.4f} · failed {failed}")
        if records
        else "no episodes"
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; font-size: 13px; margin: 1em; }}
table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border: 1px solid #ccc; padding: 4px; vertical-align: top; text-align: left; }}
tr.failed {{ background: #fff3f3; }}
pre {{ white-space: pre-wrap; margin: 2px 0; background: #f7f7f7; }}
.doc {{ display: inline-block; padding: 0 4px; margin: 1px; border-radius: 3px; font-family: monospace; }}
.meta, small {{ color: #666; }}
.query {{ margin-top: 4px; font-style: italic; }}
.error {{ color: #b00020; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="summary">{summary}</p>
<p class="legend">{legend}</p>
<table>
<thead><tr><th>episode</th><th>turns</th><th>reward</th><th>advantage</th><th>failure</th></tr></thead>
<tbody>
{rows}
</tbody></table></body></html>
"""


def read_records(path: pathlib.Path, task=None) -> list:
    records = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{line_no}: invalid JSON ({e.msg})")
            if task is None or record["task_id"] == task:
                records.append(record)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir")
    parser.add_argument("--step", type=int, default=None, help="RL step (default: the latest)")
    parser.add_argument("--file", help="a trajectories JSONL file instead of --workdir/--step")
    parser.add_argument("--limit", type=int, default=0, help="show at most this many trajectories")
    parser.add_argument("--task", default=None, help="only this task id")
    parser.add_argument("--max-chars", type=int, default=400)
    parser.add_argument("--html", default=None, help="write a self-contained HTML page of the trajectories here")
    args = parser.parse_args(argv)
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
    records = read_records(path, args.task)
    if args.limit:
        records = records[: args.limit]
    if args.html:
        pathlib.Path(args.html).write_text(html_page(records, f"trajectories of {path}", max(args.max_chars, 2000)))
        print(f"wrote {args.html} ({len(records)} trajectories from {path})")
        return
    for record in records:
        print(render(record, args.max_chars))
    print(f"({len(records)} trajectories from {path})")


if __name__ == "__main__":
    main()
