"""The package's import graph keeps its layers: no cycle, and no module imports from a layer above its
own (function-local imports included)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mtrl_jax"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of mtrl_jax it imports`` (anywhere in its body, not only at the top)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                # "from pkg import sub" imports the submodule pkg.sub when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert {
        "mtrl_jax.trainer",
        "mtrl_jax.evaluate",
        "mtrl_jax.setup",
        "mtrl_jax.checkpoint",
        "mtrl_jax.metrics",
    } <= set(graph)
    assert "mtrl_jax.trainer" not in graph["mtrl_jax.evaluate"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


# Bottom to top; a module may import from its own layer and the ones below. A module is in the layer of the
# longest prefix of its name listed here.
LAYERS = (
    (
        "mtrl_jax",
        "mtrl_jax.rng",
        "mtrl_jax.host",
        "mtrl_jax.chat",
        "mtrl_jax.chat_template",
        "mtrl_jax.ranges",
        "mtrl_jax.compile_ahead",
    ),  # foundations
    ("mtrl_jax.model", "mtrl_jax.distributed", "mtrl_jax.data"),  # the policy, the mesh, the data
    ("mtrl_jax.rl",),  # the RL math and the jitted update
    ("mtrl_jax.rollout", "mtrl_jax.search"),  # episodes: sampler, environment, tools, collection
    ("mtrl_jax.checkpoint", "mtrl_jax.metrics"),  # around the update
    ("mtrl_jax.coldstart",),  # the cold start: teacher, demonstrations, supervised step, its stage
    ("mtrl_jax.setup",),  # config -> components
    ("mtrl_jax.evaluate",),  # the evaluation job
    ("mtrl_jax.trainer",),  # the loop
)


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, names in enumerate(LAYERS)
        for prefix in names
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer of tests/test_structure.py: place it"
    return max(matches)[1]


def test_no_module_imports_from_a_layer_above_its_own():
    graph = import_graph()
    upward = [
        f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})"
        for a, edges in sorted(graph.items())
        for b in sorted(edges)
        if layer_of(b) > layer_of(a)
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("mtrl_jax.rl.train_step") < layer_of("mtrl_jax.trainer")
    assert layer_of("mtrl_jax") == 0 and layer_of("mtrl_jax.rollout.selection") == layer_of("mtrl_jax.search.env")


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
