"""The README's worked examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _section_code(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.DOTALL)
    assert blocks, f"no python block in README section {title!r}"
    return "\n".join(blocks)


def test_adding_a_loss_or_an_advantage_estimator():
    from mtrl_jax.rl import advantages, losses

    with losses.LOSSES.restoring(), advantages.ESTIMATORS.restoring():
        exec(compile(_section_code("Adding a loss or an advantage estimator"), "README.md", "exec"), {})
        assert "reinforce_with_floor" in losses.names() and "median_baseline" in advantages.names()
    # the global registries are as they were: other tests never see the README's entries
    assert "reinforce_with_floor" not in losses.names() and "median_baseline" not in advantages.names()


def test_the_readme_is_a_front_door():
    """At most 300 lines, no commit names (figures and their commits live in docs/results.md), and the
    results table, the quick start and the module map come first."""
    text = README.read_text()
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    commits = {w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search("[a-f]", w) and re.search("[0-9]", w)}
    assert not commits, f"commit-like names in the README: {sorted(commits)}"
    sections = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert sections[:3] == ["Quick start", "What a run writes", "Module map"], sections
    assert text.index("| what | result |") < text.index("## Quick start")  # the results table, before any section


def test_every_benchmark_has_its_row_in_the_results():
    docs = README.parent / "docs"
    results = (docs / "results.md").read_text()
    benchmarks = sorted(p.stem for p in (README.parent / "benchmarks").glob("bench_*.py"))
    assert benchmarks
    for name in benchmarks:
        rows = [line for line in results.splitlines() if line.startswith(f"| {name} |")]
        assert len(rows) == 1, f"docs/results.md: {len(rows)} rows for {name}"
        assert f"python -m benchmarks.{name}" in rows[0]
    decisions = (docs / "decisions.md").read_text()
    assert "| kept" in decisions and "| reverted" in decisions
    for link in re.findall(r"\]\((docs/[^)]+)\)", README.read_text()):
        assert (README.parent / link).exists(), link


def test_reported_figures_are_intervals_not_spreads():
    """The README and docs/results.md give means with 95% intervals and n (docs/ablations.md), never "±"."""
    for path in (README, README.parent / "docs" / "results.md"):
        assert "±" not in path.read_text(), f"{path.name}: a '±' figure (report a 95% interval and n)"


def _table_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        for line in text.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]


def test_the_docs_keep_the_readmes_rules():
    """Issue 70, point 6: table cells of at most 300 characters in the README and docs/results.md, at most 6
    rows in the README's results table, docs/decisions.md entries of at most 400 characters, and every link of
    the README to a page a reader can open (checked above)."""
    docs = README.parent / "docs"
    for path in (README, docs / "results.md"):
        for row in _table_rows(path.read_text()):
            long = [cell[:60] for cell in row if len(cell) > 300]
            assert not long, f"{path.name}: cells over 300 characters: {long}"
    results = README.read_text().split("| what | result |", 1)[1].split("\n\n", 1)[0]
    assert len(_table_rows(results)) <= 6, "the README's results table has more than 6 rows"
    for line in (docs / "decisions.md").read_text().splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            assert len(line) <= 400, f"docs/decisions.md: an entry of {len(line)} characters: {line[:80]}"


def test_ci_runs_exactly_the_readmes_test_command():
    quick_start = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quick_start, re.DOTALL)
    test_command = next(c for c in commands if "pytest" in c)
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test_command
