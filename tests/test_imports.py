"""Imports point down: the graph of tinyvllm's own imports has no cycle, counting every import statement (top
level, inside functions, under TYPE_CHECKING) and a package's __init__ like any module."""

import ast
from pathlib import Path

import tinyvllm

def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root (the directory of `package`)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}.

    `from pkg import name` depends on pkg (its __init__ runs and is searched for name) and, if name is a submodule,
    on that too; `import a.b.c` and `from a.b.c import x` on a.b.c alone (the parents' __init__ running first is
    Python's doing, not a dependency this module chose)."""
    modules = module_names(root, package)

    def known(name: str) -> str | None:
        while name and name not in modules:  # `import pkg.mod.attr` is not valid, but a prefix is the module
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        edges = graph[name] = {}
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.rsplit(".", node.level - 1)[0]  # level 1: this package, 2: its parent...
                    base = f"{anchor}.{base}" if base else anchor
                targets = [known(base)] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            for target in targets:
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    return "; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in component for b in graph[a] if b in component)


def test_tinyvllm_has_no_import_cycle():
    root = Path(tinyvllm.__file__).parent
    graph = import_graph(root, "tinyvllm")
    assert "tinyvllm.engine.llm_engine" in graph["tinyvllm.llm"], "the graph misses a plain import"
    assert "tinyvllm.llm" in graph["tinyvllm"], "the graph misses a function-level import"
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(graph, c) for c in found)


def test_the_cycle_finder_sees_lazy_and_package_init_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg.b import g\n",  # lazy import
        "b.py": "import pkg.a\n",
        "c.py": "",
        "sub/__init__.py": "from pkg.sub.d import h\n",
        "sub/d.py": "from pkg.sub import e\n",  # through the package's __init__
        "sub/e.py": "from . import d\nfrom ..c import x\n",  # relative
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.sub.e"] == {"pkg.sub": 1, "pkg.sub.d": 1, "pkg.c": 2}
    assert sorted(cycles(graph)) == [["pkg.a", "pkg.b"], ["pkg.sub", "pkg.sub.d", "pkg.sub.e"]]
