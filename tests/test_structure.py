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
    ("mtrl_jax.setup", "mtrl_jax.chat_build"),  # config -> components
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


# The house's size rules (issue 70): a newcomer can hold a module, a function and its parameter list.
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS = 400, 80, 10
EXEMPT_MODULES = {"mtrl_jax/model/transformer.py"}  # the model's transformer
EXEMPT_FUNCTIONS = {("mtrl_jax/model/transformer.py", "__call__")}  # the model's forward


def _parameters(node: ast.FunctionDef) -> int:
    a = node.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return count - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def size_violations(package: pathlib.Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package.parent).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES and name not in EXEMPT_MODULES:
            found.append(f"{name}: {len(text.splitlines())} lines > {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and (name, node.name) not in EXEMPT_FUNCTIONS:
                found.append(f"{name}:{node.lineno} {node.name}: {lines} lines > {MAX_FUNCTION_LINES}")
            if _parameters(node) > MAX_PARAMETERS:
                found.append(f"{name}:{node.lineno} {node.name}: {_parameters(node)} parameters > {MAX_PARAMETERS}")
    return found


def test_modules_functions_and_parameter_lists_stay_small():
    assert not size_violations(), "\n".join(size_violations())


def test_the_size_check_sees_a_long_module_and_a_long_parameter_list(tmp_path):
    package = tmp_path / "mtrl_jax"
    package.mkdir()
    (package / "big.py").write_text("x = 1\n" * 401 + "def f(a, b, c, d, e, f, g, h, i, j, k):\n    return a\n")
    assert [v.split(":")[0] for v in size_violations(package)] == ["mtrl_jax/big.py", "mtrl_jax/big.py"]


def test_nothing_assigns_the_updaters_frozen_tree():
    hits = [p for p in PACKAGE.rglob("*.py") if "updater.frozen =" in p.read_text()]
    assert not hits, hits
