"""The package's modules import each other without a circle, counting imports inside functions too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "gpuexp"


def imports_of(path, modules):
    """The package's modules that `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and (node.module or "").split(".")[0] != "gpuexp":
                continue
            base = (node.module or "").split(".")
            base = base[1:] if node.level == 0 else base
            if base and base[0]:
                found.add(base[0])
            else:  # `from . import ipython`
                found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "gpuexp" and len(parts) > 1:
                    found.add(parts[1])
    return found & modules


def import_graph():
    modules = {p.stem for p in PACKAGE.glob("*.py")} | {"_core"}
    return {p.stem: imports_of(p, modules) - {p.stem} for p in PACKAGE.glob("*.py")}


def circles(graph):
    """Every import circle, each as the path that closes it."""
    found, done = [], set()

    def visit(module, path):
        if module in path:
            found.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert {"_core", "ipython"} <= graph["experiment"]
    assert "experiment" in graph["extension"]  # the %%gpuexp magic


def test_no_module_imports_itself_back():
    found = circles(import_graph())
    assert found == [], "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
