"""The house's layering, read from the source (no import is run): dependencies between genq's packages point
one way (shared/DESIGN.md: `webapi -> jobstore`, `workers -> jobstore, batching`, all of them -> contract),
and no module of genq imports, through any chain, a module that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("batchclient", "batching", "contract", "jobstore", "webapi", "workers")
# what each package may import of the others
ALLOWED = {
    "batchclient": set(),  # talks to the API over HTTP only
    "batching": set(),  # the engine knows nothing of jobs, HTTP or databases
    "contract": set(),
    "jobstore": {"contract"},
    "webapi": {"contract", "jobstore", "batchclient"},  # `genq batch` is the batch client's command
    "workers": {"contract", "jobstore", "batching"},
}
# the engine's torch-free modules the API uses, so that it counts tokens and checks a grammar exactly as the
# engine will (tests/webapi/test_no_torch.py checks that they import no torch)
SHARED_WITH_THE_API = {"batching.tokenizer", "batching.grammar"}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imported(node: ast.AST, module: str) -> list[str]:
    """The genq modules an import statement names (a `from package import name` that names a module
    counts as that module)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative
            base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
        ]
    return [name for name in names if name.split(".")[0] in PACKAGES]


def _imports(module: str, top_level_only: bool) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    if top_level_only:  # at import time, `if TYPE_CHECKING:` blocks included (a circle for the reader)
        nodes = [n for stmt in tree.body for n in ([stmt] + (stmt.body if isinstance(stmt, ast.If) else []))]
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        for name in _imported(node, module):
            while name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name != module:
                found.add(name)
    return found


def test_packages_depend_one_way():
    wrong = []
    for module in MODULES:
        package = module.split(".")[0]
        for target in _imports(module, top_level_only=False):
            other = target.split(".")[0]
            if package == "webapi" and target in SHARED_WITH_THE_API:
                continue
            if other != package and other not in ALLOWED[package]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    graph = {module: _imports(module, top_level_only=True) for module in MODULES}
    circles: set[tuple[str, ...]] = set()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circle = path[path.index(target) :]
                start = circle.index(min(circle))
                circles.add(tuple(circle[start:] + circle[:start]))
            elif target in graph and target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    # a package's __init__ re-exporting its modules is not a circle a reader follows
    circles = {c for c in circles if not any(m in PACKAGES for m in c)}
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in sorted(circles))


def test_the_check_sees_imports():
    """The graph above is not empty by accident: known edges are found."""
    assert "batching.model_runner" in _imports("batching.cuda_graphs", top_level_only=True)
    assert "contract.settings" in _imports("workers.celery", top_level_only=False)
