"""The docs and comments describe the code as it is: no pointer to a numbered past session or "an earlier round"
(the dated log lives in bench/results/, which is exempt), PERFORMANCE.md stays a short current-state document, and
the README's layer list is in the order the imports really go."""

import re
from pathlib import Path

import pytest
from test_imports import import_graph

ROOT = Path(__file__).resolve().parent.parent
HISTORY = re.compile(r"\bsessions? \d+\b|earlier round", re.IGNORECASE)
MAX_PERFORMANCE_LINES = 400


def checked_files() -> list[Path]:
    """Every text file the rule covers: the package, the kernels, and the three current-state docs."""
    files = [ROOT / "README.md", ROOT / "docs" / "ENGINE.md", ROOT / "docs" / "PERFORMANCE.md"]
    for folder in ("tinyvllm", "cuda"):
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    return files


def history_lines(text: str) -> list[tuple[int, str]]:
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_the_pattern_catches_what_it_is_for():
    assert history_lines("a comment (session 16)\nclean\nas in sessions 8 and 11\nmeasured in an Earlier Round")
    assert [n for n, _ in history_lines("x\n# W3 1.26 ms (docs/PERFORMANCE.md, session 9)\n")] == [2]
    assert not history_lines("a session's state\nsession_id = 3\nsessions are kept\n`...-session17-j1.json`")


def test_no_comment_or_doc_narrates_past_sessions():
    found = []
    for path in checked_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a binary file: nothing to read
            continue
        found += [f"{path.relative_to(ROOT)}:{number}: {line}" for number, line in history_lines(text)]
    assert not found, "history in comments or docs (state the decision, cite docs/PERFORMANCE.md's Decisions):\n" + \
        "\n".join(found)


def test_performance_md_is_the_current_state_not_the_log():
    lines = (ROOT / "docs" / "PERFORMANCE.md").read_text().splitlines()
    assert len(lines) <= MAX_PERFORMANCE_LINES, \
        f"docs/PERFORMANCE.md has {len(lines)} lines (at most {MAX_PERFORMANCE_LINES}): dated runs go to bench/results/"
    assert any(line.startswith("## Decisions") for line in lines)
    assert (ROOT / "bench" / "results" / "PERFORMANCE-history.md").exists()


def readme_layers() -> list[list[str]]:
    """The README's Architecture list, top to bottom: each entry's modules (`cli.py` -> tinyvllm.cli, `jobs/` ->
    tinyvllm.jobs; an entry may name several, comma-separated)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Architecture"):]
    section = section[:section.index("\n## ", 1)]
    layers = []
    for line in section.splitlines():
        match = re.match(r"    (\S+(?:, \S+)*)\s", line + " ")
        if match and all(re.fullmatch(r"[a-z_]+(\.py|/)", name) for name in match.group(1).split(", ")):
            layers.append(["tinyvllm." + name.removesuffix(".py").removesuffix("/")
                           for name in match.group(1).split(", ")])
    return layers


def test_readme_layers_are_in_import_order():
    layers = readme_layers()
    assert ["tinyvllm.cli"] in layers and ["tinyvllm.config"] in layers, layers

    def layer_of(module: str) -> int | None:
        for index, names in enumerate(layers):
            if any(module == name or module.startswith(name + ".") for name in names):
                return index
        return None

    upward = []
    for module, targets in import_graph(ROOT / "tinyvllm", "tinyvllm").items():
        here = layer_of(module)
        for target, line in targets.items():
            there = layer_of(target)
            if here is not None and there is not None and there < here:
                upward.append(f"{module} (line {line}) imports {target}, listed above it")
    assert not upward, "README's Architecture list is not in import order:\n" + "\n".join(upward)


@pytest.mark.parametrize("name", ["ENGINE.md", "PERFORMANCE.md"])
def test_docs_cited_by_the_code_exist(name):
    assert (ROOT / "docs" / name).exists()
