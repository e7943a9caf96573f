"""The README's worked examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _section_code(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.DOTALL)
    assert blocks, f"no python block in README section {title!r}"
    return "\n".join(blocks)


def test_adding_a_loss_or_an_advantage_estimator():
    from mtrl_jax.rl import advantages, losses

    with losses.LOSSES.restoring(), advantages.ESTIMATORS.restoring():
        exec(compile(_section_code("Adding a loss or an advantage estimator"), "README.md", "exec"), {})
        assert "reinforce_with_floor" in losses.names() and "median_baseline" in advantages.names()
    # the global registries are as they were: other tests never see the README's entries
    assert "reinforce_with_floor" not in losses.names() and "median_baseline" not in advantages.names()
