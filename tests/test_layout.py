"""The package's shape: no import cycle, imports at the top of modules, the layering of the
orchestration modules, small modules, no harness code inside the library."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparserl_jax"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, level: int, importer: str) -> str:
    if not level:
        return module
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str) -> list[tuple[str, ast.AST, bool]]:
    """(imported project module, node, at module top level) for every import in `name`."""
    tree = ast.parse(MODULES[name].read_text())
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name)
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "sparserl_jax":
                out.append((target, node, id(node) in top))
    return out


GRAPH = {name: {t for t, _, _ in _imports(name) if t in MODULES} for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v):
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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_the_package():
    assert "sparserl_jax.train" in GRAPH and "sparserl_jax.config" in GRAPH
    assert "sparserl_jax.config" in GRAPH["sparserl_jax.build"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_project_imports_are_top_level():
    """No lazy or TYPE_CHECKING imports of the project's own modules: the layers are real."""
    lazy = [
        f"{name}:{node.lineno} imports {target}"
        for name in MODULES
        for target, node, top in _imports(name)
        if not top
    ]
    assert lazy == []


@pytest.mark.parametrize(
    "module,forbidden",
    [
        ("sparserl_jax.config", {"build", "train", "generate", "cli", "sampler", "step"}),
        ("sparserl_jax.build", {"train", "generate", "cli", "sampler", "step"}),
        ("sparserl_jax.step", {"train", "cli", "generate"}),
        ("sparserl_jax.train", {"cli", "generate", "decoupled.trainer", "decoupled.launch"}),
        ("sparserl_jax.generate", {"cli", "train"}),
        # The decoupled jobs sit beside `train` (they reuse its learn half): below the cli only.
        ("sparserl_jax.decoupled.trainer", {"cli", "generate"}),
        ("sparserl_jax.decoupled.sampler_job", {"cli", "train", "step", "decoupled.trainer"}),
        ("sparserl_jax.decoupled.exchange", {"cli", "train", "step", "decoupled.trainer"}),
    ],
)
def test_layers(module, forbidden):
    """config -> build -> {step -> train, generate, decoupled jobs} -> cli: nothing reaches up
    a layer (a sampler job never needs the learner's step)."""

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for w in GRAPH[todo.pop()] - seen:
                seen.add(w)
                todo.append(w)
        return seen

    above = {f"sparserl_jax.{m}" for m in forbidden} & set(MODULES)
    assert reach(module) & above == set()


def test_modules_are_small_and_not_harness():
    long = {n: c for n, p in MODULES.items() if (c := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines"
    harness = [n for n in MODULES if "bench" in n.rsplit(".", 1)[-1]]
    assert harness == [], "benchmark harnesses belong in benchmarks/, not the package"


def test_every_subpackage_defines_all():
    missing = [
        n
        for n in MODULES
        if _is_package(n) and "__all__" not in MODULES[n].read_text() and n != "sparserl_jax"
    ]
    assert missing == []
