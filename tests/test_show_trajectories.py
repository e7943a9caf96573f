"""tools/show_trajectories.py: grades next to ids, the advantage, and the HTML page (parsed back)."""

import html.parser
import pathlib

import tools.show_trajectories as show
from mtrl_jax.rollout.trajectory import Trajectory

REPO = pathlib.Path(__file__).resolve().parents[1]


def _records(path):
    ok = Trajectory("synthetic/multihop-3", 0, 0, "synthetic/multihop", query="component of project <Falcon-12>")
    ok.turns = [
        {
            "index": 0,
            "text": '<tool_call>{"name": "bm25_search"}</tool_call>',
            "stop_reason": "end_of_turn",
            "calls": [
                {"name": "bm25_search", "arguments": {"query": "Falcon-12"}, "doc_ids": ["d7", "d9"], "error": None}
            ],
        },
        {
            "index": 1,
            "text": "<tool_call>...</tool_call>",
            "stop_reason": "end_of_turn",
            "calls": [
                {"name": "bm25_search", "arguments": {"query": "KX-4821"}, "doc_ids": ["d2"], "error": None},
                {"name": "nope", "arguments": {}, "doc_ids": [], "error": "unknown_tool: unknown tool 'nope'"},
            ],
        },
        {
            "index": 2,
            "text": "<answer></answer>",
            "stop_reason": "end_of_turn",
            "calls": [],
            "answer_source": "fallback_fusion",
        },
    ]
    ok.final_ranking, ok.reward, ok.status, ok.advantage = ["d7", "d2", "d9"], 0.7956, "ok", 0.8123
    ok.grades = {"d7": 1, "d9": 0, "d2": 2}
    failed = Trajectory("synthetic/lookup-1", 0, 1, "synthetic/lookup", query="KX-1 datasheet")
    failed.turns = [{"index": 0, "text": "blah blah", "stop_reason": "token_limit", "calls": []}]
    failed.reward, failed.status = -1.0, "turn_token_limit"  # advantage None: not trained on
    path.write_text(ok.to_json(5) + "\n" + failed.to_json(5) + "\n")


class _Page(html.parser.HTMLParser):
    """Rows of the episodes table: each row's cells' text, and its documents' (id, grade, colour)."""

    def __init__(self):
        super().__init__()
        self.rows, self.cell, self.in_doc = [], None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "episode" in (attrs.get("class") or ""):
            self.rows.append({"class": attrs["class"], "cells": [], "docs": []})
        elif tag == "td" and self.rows:
            self.cell = []
        elif tag == "span" and attrs.get("class") == "doc" and self.rows and self.cell is not None:
            self.in_doc = [attrs.get("data-grade"), attrs.get("style"), ""]

    def handle_endtag(self, tag):
        if tag == "td" and self.cell is not None:
            self.rows[-1]["cells"].append("".join(self.cell))
            self.cell = None
        elif tag == "span" and self.in_doc is not None:
            self.rows[-1]["docs"].append(tuple(self.in_doc))
            self.in_doc = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)
        if self.in_doc is not None:
            self.in_doc[2] += data


def test_text_view_shows_grades_and_advantage(tmp_path, capsys):
    _records(tmp_path / "t.jsonl")
    show.main(["--file", str(tmp_path / "t.jsonl")])
    out = capsys.readouterr().out
    assert "advantage +0.8123" in out and "advantage not trained on" in out
    assert 'bm25_search({"query": "Falcon-12"}) -> [d7(1), d9(0)]' in out
    assert (
        "answer (fallback_fusion): [d7(1), d2(2), d9(0)]" in out and "question: component of project <Falcon-12>" in out
    )


def test_html_page_has_a_row_per_episode_with_graded_documents(tmp_path):
    _records(tmp_path / "t.jsonl")
    page_path = tmp_path / "page.html"
    show.main(["--file", str(tmp_path / "t.jsonl"), "--html", str(page_path)])
    text = page_path.read_text()
    assert "<script" not in text and "http" not in text.split("<body>")[1]  # self-contained
    page = _Page()
    page.feed(text)
    assert len(page.rows) == 2
    ok, failed = page.rows
    task, turns, reward, advantage, failure = ok["cells"]
    assert "synthetic/multihop-3" in task and "component of project <Falcon-12>" in task  # escaped, then parsed back
    assert reward == "0.7956" and advantage == "+0.8123" and failure == "-"
    assert (
        "turn 0" in turns
        and "turn 2" in turns
        and "unknown_tool" in turns
        and 'bm25_search({"query": "KX-4821"})' in turns
    )
    docs = [(d[2].split()[0], d[0]) for d in ok["docs"]]
    assert docs == [
        ("d7", "1"),
        ("d9", "0"),
        ("d2", "2"),
        ("d7", "1"),
        ("d2", "2"),
        ("d9", "0"),
    ]  # 2 searches, then the answer
    colour = {grade: style for grade, style, _ in ok["docs"]}
    assert len(set(colour.values())) == 3  # one colour per grade
    assert failed["class"] == "episode failed" and failed["cells"][2] == "-1.0000"
    assert failed["cells"][3] == "not trained on" and failed["cells"][4] == "turn_token_limit"
