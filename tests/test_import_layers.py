"""The package layers, lowest first: core (pipeline.errors, pipeline.outputs, pipeline.commands,
pipeline.config_files) -> data (pipeline.data, data_prep) ->
models -> objectives -> families, tasks -> config (pipeline.config, pipeline.ds_config) -> train, checkpoint, tracking
(the rest of pipeline) -> launchers, tools, bench. No module imports a higher layer and no modules import each other
in a circle. The graph is read from the AST, module-level and function-local imports alike: a function-local import
hides a circle from Python, not from this test."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("pipeline", "data_prep", "launchers", "tools", "bench")
LAYERS = [("pipeline.errors", 0), ("pipeline.outputs", 0), ("pipeline.commands", 0), ("pipeline.config_files", 0),
          ("pipeline.data", 1), ("data_prep", 1),
          ("pipeline.models", 2), ("pipeline.objectives", 3), ("pipeline.families", 4), ("pipeline.tasks", 4),
          ("pipeline.config", 5),
          ("pipeline.ds_config", 5), ("pipeline", 6), ("launchers", 7), ("tools", 7), ("bench", 7)]


def modules() -> dict:
    """'pipeline.data.loader' -> its file, for every first-party module."""
    out = {}
    for root in ROOTS:
        for p in (REPO / root).rglob("*.py"):
            parts = p.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path: Path, mods: dict) -> list[tuple[str, int]]:
    """(first-party module imported, line) for every import statement anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:  # a name inside a module -> the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.append((t, node.lineno))
    return found


def layer(name: str) -> int:
    return next(n for prefix, n in LAYERS if name == prefix or name.startswith(prefix + "."))


def graph() -> dict:
    mods = modules()
    return {m: imports(m, p, mods) for m, p in mods.items()}


def cycles(g: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(graph()) == []


def test_no_module_imports_a_higher_layer():
    g = graph()
    mods = modules()
    up = [f"{mods[m].relative_to(REPO)}:{line} imports {t} (layer {layer(t)} above {layer(m)})"
          for m, targets in g.items() for t, line in targets if layer(t) > layer(m)]
    assert up == []


def test_the_checks_see_circles_and_upward_imports():
    """The graph reader itself: a function-local upward import and a two-module circle are found."""
    g = {"pipeline.data.loader": [("pipeline.config", 1)], "pipeline.config": [("pipeline.data.loader", 2)]}
    assert cycles(g) == [["pipeline.config", "pipeline.data.loader"]]
    assert layer("pipeline.config") > layer("pipeline.data.loader")
    src = REPO / "pipeline" / "data" / "compat.py"
    local = imports("pipeline.data.compat", src, modules())
    assert any(t == "pipeline.data.streams" for t, _ in local)  # compat.py's function-local import is read too
