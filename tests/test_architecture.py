"""The direction of imports between the packages, read from the source with `ast`: every import counts, at the
top of a module, inside a function or under TYPE_CHECKING.

casp_core <- service <- api, worker <- casp_cli: the library knows no service; service/ knows neither the API nor
the workers; the API and the workers never import each other; only the `casp` command (casp_cli) wires them, and
its HTTP client imports none of them.
And no module imports itself back through others.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("casp_core", "service", "api", "worker", "casp_cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def imported_names(path: Path, module: str) -> Iterator[str]:
    """Every module name an import statement of the file names, relative imports made absolute. For
    `from x import y` both `x.y` and `x` are given: y may be a submodule or a name defined in x."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            yield source
            yield from (f"{source}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of these packages it imports (the most specific one an import names)."""
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(path, module):
            # `import a.b.c` of a name that is not a module (`from a.b import function`) falls back to a.b.
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def package_of(module: str) -> str:
    return module.split(".")[0]


def imports_across(importer: str, forbidden: set[str]) -> list[str]:
    """The imports of packages in `forbidden` made by `importer`, a package or a module."""
    return sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module == importer or module.startswith(f"{importer}.")
        for target in targets
        if package_of(target) in forbidden
    )


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("api", {"worker", "casp_cli"}),
        ("worker", {"api", "casp_cli"}),
        ("service", {"api", "worker", "casp_cli"}),
        ("casp_core", {"service", "api", "worker", "casp_cli"}),
        # The Python client talks HTTP only: it must run where the server's packages are not installed.
        ("casp_cli.client", {"casp_core", "service", "api", "worker"}),
    ],
)
def test_imports_go_one_way(importer: str, forbidden: set[str]) -> None:
    assert imports_across(importer, forbidden) == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    """Type-only imports count: a cycle of types says a type lives in the wrong module."""
    assert cycles(import_graph()) == []


def family_classes() -> set[str]:
    """The classes of casp_core/families that derive from `Family` (by name, across its modules)."""
    bases: dict[str, set[str]] = {}
    for path in (REPO / "casp_core" / "families").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {base.id for base in node.bases if isinstance(base, ast.Name)}
    found = {"Family"}
    while grown := {name for name, parents in bases.items() if parents & found} - found:
        found |= grown
    return found - {"Family"}


def test_a_familys_behaviour_comes_through_family_of_alone() -> None:
    """Outside casp_core.families nothing names a family's class (an `isinstance(family, MixtureOfExperts)` branch):
    what differs between families is a `Family` attribute or method, reached through `family_of` (`Family` itself is
    the interface, and may be named)."""
    classes = family_classes()
    assert {"MixtureOfExperts", "Llama", "Qwen3Moe"} <= classes
    named = sorted(
        f"{module} imports {alias.name}"
        for module, path in all_modules().items()
        if not module.startswith("casp_core.families")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("casp_core.families")
        for alias in node.names
        if alias.name in classes
    )
    assert named == []
