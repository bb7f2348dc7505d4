"""Guard rails of the code's shape (issue #29), read from the source, nothing run:

- no private name (`_x`) of one module is used by another, in gateway/, trainer_bridge/,
  sandbox/ and tests/: a refactor may rename what is private without breaking anything else;
- the gateway's import graph is at most MAX_DEPTH floors deep (its longest chain of modules,
  each importing the next);
- no gateway module is over MAX_LINES lines.

The allow-lists name today's offenders in the gateway, which is being redesigned on other
branches; each entry must still offend (a stale entry fails), so the lists only shrink."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "gateway", "trainer_bridge", "sandbox", "stack", "tests")
MAX_DEPTH = 7
MAX_LINES = 500


# -- private names --------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute module an `from ... import` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(tree: ast.AST, package: str) -> Iterator[tuple[str, str | None, str, int]]:
    """(module, name imported from it or None for a plain `import`, local name it is bound
    to, line) for each import, relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            origin = imported_from(node, package)
            for alias in node.names:
                yield origin, alias.name, alias.asname or alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                yield alias.name if alias.asname else local, None, local, node.lineno


def private_uses(source: str, module: str, package: str) -> Iterator[tuple[str, int]]:
    """(private name of another project module, line) for each `from m import _x` and each
    `m._x` where `m` names a project module imported here."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> project module it is bound to
    for origin, name, local, line in imports(tree, package):
        target = origin if name is None else f"{origin}.{name}"
        if origin.split(".")[0] not in PACKAGES:
            continue
        if is_module(target):
            modules[local] = target
        elif is_private(name):
            yield target, line
    for node in ast.walk(tree):
        owner = attribute_owner(node, modules)
        if owner is not None and owner != module and is_module(owner):
            yield f"{owner}.{node.attr}", node.lineno


def attribute_owner(node: ast.AST, modules: dict[str, str]) -> str | None:
    """For `m.sub._x`, with `m` bound to a project module: the dotted owner of `_x`."""
    if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
        return None
    chain, value = [], node.value
    while isinstance(value, ast.Attribute):
        chain.append(value.attr)
        value = value.value
    if not (isinstance(value, ast.Name) and value.id in modules):
        return None
    return ".".join([modules[value.id], *reversed(chain)])


def test_the_scan_finds_both_forms_and_resolves_relative_imports():
    source = ("from core import merge\nfrom core.merge import _hidden, public\n"
              "from .store import db\nimport core.store.bodies as b\n"
              "merge._also\ndb._inner\nb._ends\npublic._not_a_module\n")
    assert sorted(private_uses(source, "core.x", "core")) == [
        ("core.merge._also", 5), ("core.merge._hidden", 2),
        ("core.store.bodies._ends", 7), ("core.store.db._inner", 6)]


def private_names_used_across_modules() -> dict[tuple[str, str], str]:
    found = {}
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")):
            module = module_name(path)
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for name, line in private_uses(path.read_text(), module, package):
                found[(module, name)] = f"{path.relative_to(REPO)}:{line}"
    return found


def test_no_private_name_is_used_across_modules():
    found = private_names_used_across_modules()
    assert not found, "private names used by another module (make them public, or test " \
        "through a public seam):\n" + "\n".join(f"{w}: {n}" for (_, n), w in found.items())


# -- the gateway's import depth ---------------------------------------------------------------


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for child in graph[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    return seen


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of modules each importing the next. A cycle is one floor: modules
    that reach each other are collapsed into one (a few dozen modules: reachability per
    module is cheap)."""
    reach = {m: reachable(graph, m) for m in graph}
    floor_of = {m: "+".join(sorted(n for n in reach[m] if m in reach[n])) for m in graph}
    below = {f: set() for f in floor_of.values()}
    for m, children in graph.items():
        below[floor_of[m]] |= {floor_of[c] for c in children} - {floor_of[m]}
    chains: dict[str, list[str]] = {}

    def chain_from(floor: str) -> list[str]:
        if floor not in chains:
            rest = max((chain_from(f) for f in sorted(below[floor])), key=len, default=[])
            chains[floor] = [floor, *rest]
        return chains[floor]

    return max((chain_from(f) for f in sorted(below)), key=len, default=[])


def test_longest_chain_counts_a_cycle_as_one_floor():
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set(), "e": {"d"}}) == [
        "a", "b+c", "d"]
    assert longest_chain({}) == []


@pytest.fixture(scope="module")
def gateway_chain() -> list[str]:
    # Type-only imports are no floor: nothing of them runs.
    graph = grimp.build_graph("gateway", cache_dir=None, exclude_type_checking_imports=True)
    chain = longest_chain({m: graph.find_modules_directly_imported_by(m) for m in graph.modules})
    print(f"the gateway's import depth: {len(chain)} floors (at most {MAX_DEPTH}): "
          + " -> ".join(chain))
    return chain


def test_the_gateways_imports_are_at_most_seven_floors_deep(gateway_chain):
    assert len(gateway_chain) <= MAX_DEPTH, " -> ".join(gateway_chain)


# -- module length ----------------------------------------------------------------------------


def test_no_gateway_module_is_over_500_lines():
    lengths = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
               for p in sorted((REPO / "gateway").rglob("*.py"))}
    long = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert not long, f"gateway modules over {MAX_LINES} lines: {long}"
