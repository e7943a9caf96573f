"""The search tools' rendered results, ``[rank] doc_id | title | text`` a line, and the parsers that read them
back (the cold start's teacher follows what a search showed: ``mtrl_jax.coldstart.teacher``)."""

from __future__ import annotations

import re

from mtrl_jax.search.text import STOPWORDS

RESULT_LINE = re.compile(r"^\[\d+\] (\S+) \| (.*)$")  # a line of render_results: "[rank] doc_id | title | text"
PUNCTUATION = ".,;:!?'\"()[]|"


def render_results(tool: str, query, hits: list[dict], max_doc_chars: int) -> str:
    """A tool reply: its results under a line naming the query (a string, or the list of queries fused)."""
    if not hits:
        return f"{tool} found no documents for {query!r}."
    lines = [f"{tool} results for {query!r}:"]
    for rank, h in enumerate(hits, start=1):
        text = " ".join(h["text"].split())
        if len(text) > max_doc_chars:
            text = text[:max_doc_chars].rstrip() + "..."
        title = f" | {h['title']}" if h.get("title") else ""
        lines.append(f"[{rank}] {h['doc_id']}{title} | {text}")
    return "\n".join(lines)


def has_digit(text: str) -> bool:
    return any(ch.isdigit() for ch in text)


def result_identifiers(tool_output: str, question: str) -> list[str]:
    """The identifiers a search result shows: the distinct words with a digit in the results' titles
    and texts (not their document ids), punctuation stripped, that are not words of ``question``;
    in order of appearance."""
    asked = {w.strip(PUNCTUATION) for w in question.split()}
    found = []
    for line in tool_output.splitlines():
        match = RESULT_LINE.match(line)
        if match is None:
            continue
        for word in match.group(2).split():
            word = word.strip(PUNCTUATION)
            if has_digit(word) and word not in asked and word not in found:
                found.append(word)
    return found


def result_titles(tool_output: str, question: str) -> list[str]:
    """The distinct titles of the results a search showed (``[rank] id | title | text``), in order, but
    the question itself: the entities a second search can follow (a multi-hop question's bridge)."""
    found = []
    for line in tool_output.splitlines():
        match = RESULT_LINE.match(line)
        if match is None or " | " not in match.group(2):
            continue
        title = match.group(2).split(" | ", 1)[0].strip()
        if title and title.lower() != question.strip().lower() and title not in found:
            found.append(title)
    return found


def result_ids(tool_output: str) -> list[str]:
    """The document ids the searches showed, in order of appearance, each once."""
    found = []
    for line in tool_output.splitlines():
        match = RESULT_LINE.match(line)
        if match is not None and match.group(1) not in found:
            found.append(match.group(1))
    return found


def question_keywords(question: str) -> list[str]:
    """The question rewritten as its content words (stop words and punctuation dropped), or nothing when
    that changes nothing."""
    words = [w.strip(PUNCTUATION) for w in question.split()]
    kept = " ".join(w for w in words if w and w.lower() not in STOPWORDS)
    return [kept] if kept and kept != question.strip() else []
