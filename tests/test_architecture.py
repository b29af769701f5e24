"""The package layering of docs/architecture.md, checked on the source: no module imports a
package above it (lazy imports inside functions included), no import cycle between modules, every
package and module in the doc's table, and the size limits that keep each room one job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "mixprec"
DOC = SRC.parents[1] / "docs" / "architecture.md"
MAX_MODULE_LINES, MAX_CLASS_LINES = 800, 400

# Lower number = lower layer. A module may import its own layer and the layers below.
LAYERS = {
    "errors": 0,
    "state": 0,
    "status": 0,
    "schema": 0,
    "files": 0,
    "quiet": 0,
    "process": 0,
    "clock": 0,
    "budget": 0,
    "events": 0,
    "findings": 0,
    "validation": 0,
    "version": 0,
    "lazy": 0,
    "hardware": 1,
    "policy": 2,
    "workload": 3,
    "distributed": 3,
    "exports": 3,
    "demo": 3,
    "numerics": 4,
    "linting": 4,
    "frameworks": 5,
    "measure": 6,
    "checking": 6,
    "monitor": 6,
    "tuning": 7,
    "report": 8,
    "cli": 9,
    "__init__": 10,
    "__main__": 10,
    "keras": 10,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = SRC.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "mixprec":
            # `from mixprec import state` imports mixprec.state only; `from mixprec import
            # __version__` (or any other name of the top package) imports the top package
            for alias in node.names:
                name = f"mixprec.{alias.name}"
                found.add(name if _is_module(name) else "mixprec")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mixprec"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mixprec"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS[top]


def test_every_top_level_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.suffix == ".py" or p.is_dir()}
    tops.discard("__pycache__")
    assert tops - set(LAYERS) == set(), "add the new package to LAYERS and docs/architecture.md"


def test_no_module_imports_a_layer_above_it():
    upward = [
        f"{mod} -> {dep}" for mod, deps in _graph().items() for dep in deps if _layer(dep) > _layer(mod)
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    # a package's __init__ re-exports its modules; an edge module -> its own package is not a cycle
    for mod in graph:
        graph[mod] = {d for d in graph[mod] if not mod.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in graph[node]:
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_tests_mirror_the_source():
    """tests/<package>/ holds the tests of src/mixprec/<package>/ (data folders aside); tests of
    what crosses packages (the CLI's exit codes end to end, the README, the fuzz tier) stay at the top."""
    tests = Path(__file__).resolve().parent
    data = {"golden", "keras_workloads", "__pycache__"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name not in data}
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - packages == set(), f"test folders without a source package: {sorted(folders - packages)}"


def _doc_rows() -> dict[str, set[str]]:
    """The architecture table: package (``"frameworks/script/"``; ``""`` for the top level) -> the
    modules its row names."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index("| package | modules | its job |") + 2  # (after the header and its rule)
    rows: dict[str, set[str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        package = "" if cells[0] == "(top level)" else cells[0].strip("`")
        rows.setdefault(package, set()).update(re.findall(r"`([\w.]+)`", cells[1]))
    return rows


def test_the_architecture_doc_names_every_package_and_module():
    """docs/architecture.md went stale one commit after it was made current (issue 52): a package
    or module added, moved or removed fails here until its row says so."""
    rows = _doc_rows()
    wanted: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        if "__pycache__" in path.parts or path.stem in ("__init__", "__main__"):
            continue
        folder = path.parent.relative_to(SRC).as_posix()
        package = f"{folder}/" if folder != "." else ""
        if package == "" and path.stem in rows:  # a top-level module with its own row (keras)
            continue
        wanted.setdefault(package, set()).add(path.stem)
    missing = {p: sorted(m - rows.get(p, set())) for p, m in wanted.items() if m - rows.get(p, set())}
    assert not missing, f"add these to docs/architecture.md's table: {missing}"
    stale = {p: sorted(rows[p] - m) for p, m in wanted.items() if rows.get(p, set()) - m}
    gone = sorted(
        p for p in rows if p and p not in wanted and p.rstrip("/") not in {s.stem for s in SRC.glob("*.py")}
    )
    assert not stale and not gone, f"docs/architecture.md names what is not there: {stale} {gone}"


def test_no_module_or_class_outgrows_one_job():
    big = []
    for path in SRC.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(SRC).as_posix()
        if text.count("\n") > MAX_MODULE_LINES:
            big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{name}:{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, f"split by job (over {MAX_MODULE_LINES} a module, {MAX_CLASS_LINES} a class): {big}"
