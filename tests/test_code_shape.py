"""No function or method in tinyvllm/ is longer than MAX_FUNCTION_LINES, counted from its `def` (decorators
excluded) to its last line, docstring and comments included: a longer one is split into named steps."""

import ast
from pathlib import Path

import tinyvllm

MAX_FUNCTION_LINES = 60


def long_functions(root: Path, limit: int) -> list[str]:
    """`path:line name (n lines)` for every function or method under root longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_the_limit():
    too_long = long_functions(Path(tinyvllm.__file__).parent, MAX_FUNCTION_LINES)
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)


def test_the_check_sees_a_long_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (package / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_functions(package, MAX_FUNCTION_LINES) == ["pkg/m.py:6 long (61 lines)"]
    assert long_functions(package, 61) == []
