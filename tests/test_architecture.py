"""The import graph stays acyclic and layered, and docs/architecture.md names every module (docs/architecture.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_dp"
SUBPACKAGES = ("clipping", "optim", "audit")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Each hf_dp module's module-level imports of other hf_dp modules (not inside functions or TYPE_CHECKING)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        targets: set[str] = set()
        for node in tree.body:  # module level only: a function's import runs when called, after every import
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, path.name == "__init__.py")
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    targets.add(candidate if candidate in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _layer(module: str) -> str:
    """A sub-package as one node; each top-level module as its own."""
    parts = module.split(".")
    return "hf_dp." + parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else module


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_a_cycle_is_found_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_modules():
    assert _cycle(import_graph()) is None


def test_no_import_cycle_between_subpackages():
    layered: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        layer = _layer(module)
        layered.setdefault(layer, set()).update(_layer(t) for t in targets if _layer(t) != layer)
    assert _cycle(layered) is None


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("hf_dp.clipping", ("hf_dp.optim", "hf_dp.trainer", "hf_dp.run", "hf_dp.data", "hf_dp.mechanism")),
        ("hf_dp.optim", ("hf_dp.trainer", "hf_dp.run", "hf_dp.mechanism", "hf_dp.data")),
        ("hf_dp.mechanism", ("hf_dp.trainer", "hf_dp.run", "hf_dp.optim")),
    ],
)
def test_layers_import_only_downwards(package, forbidden):
    for module, targets in import_graph().items():
        if module == package or module.startswith(package + "."):
            bad = sorted(t for t in targets if t.startswith(forbidden))
            assert not bad, f"{module} imports {bad}"


def test_the_optimizer_registry_is_a_leaf():
    graph = import_graph()
    assert not {t for t in graph["hf_dp.optim.registry"] if t.startswith("hf_dp.optim.")}


@pytest.mark.parametrize(
    "module, allowed",
    [
        ("hf_dp.dpo_losses", set()),  # under trl
        ("hf_dp.checkpoint_files", set()),  # under checkpoint, run, trainer
        ("hf_dp.rdp", set()),  # under prv_accountant and accounting
        ("hf_dp.prv_accountant", {"hf_dp.rdp"}),  # under accounting
    ],
)
def test_the_modules_under_trl_checkpoint_and_accounting_stay_below_them(module, allowed):
    assert import_graph()[module] <= allowed


def test_architecture_doc_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(hf_dp/[\w/]+\.py)`", text))
    missing = sorted(
        str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if str(p.relative_to(ROOT)) not in named
    )
    assert not missing, f"docs/architecture.md does not name {missing}"
    stale = sorted(name for name in named if not (ROOT / name).exists())
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"
