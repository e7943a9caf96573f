"""Every tool and benchmark answers --help (imported as a module, no network, nothing written)."""

import importlib
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(
    f"{folder}.{p.stem}"
    for folder in ("tools", "benchmarks")
    for p in (REPO / folder).glob("*.py")
    if p.stem not in ("__init__", "common")
)


def test_the_tools_and_benchmarks_are_the_expected_ones():
    assert {
        "tools.fetch_models",
        "tools.serve_tools",
        "tools.show_trajectories",
        "tools.fault_drill",
        "tools.plan_scale",
        "benchmarks.bench_learning",
    } <= set(MODULES)
    assert not (REPO / "scripts").exists()


@pytest.mark.parametrize("module", MODULES)
def test_help(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out


@pytest.mark.parametrize("folder", ["tools", "benchmarks"])
def test_nothing_patches_sys_path(folder):
    for path in (REPO / folder).glob("*.py"):
        assert "sys.path" not in path.read_text(), path
