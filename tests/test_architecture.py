"""The direction of imports between the packages, read from the source with `ast`: every import counts, at the
top of a module, inside a function or under TYPE_CHECKING.

casp_core <- service <- api, worker <- casp_cli: the library knows no service; service/ knows neither the API nor
the workers; the API and the workers never import each other; only the `casp` command (casp_cli) wires them, and
its HTTP client imports none of them.
And no module imports itself back through others.

Inside casp_core, the rooms (its folders, docs/architecture.md) stand on the root's modules, the foundation, and form
no cycle between them; the paper's method writes no files and knows no job; the shipped modeling files import nothing
of casp_core (a checkpoint carries them alone); the settings load no torch (the API and the CLI check settings
before any heavy import).
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


CASP_CORE = REPO / "casp_core"
ROOM_DIRS = sorted(path.name for path in CASP_CORE.iterdir() if (path / "__init__.py").is_file())
# What of the rooms the foundation may import: the families (a model's family decides how it loads), and where a
# model comes from besides a folder or the hub (a GGUF file, dequantized into the cache).
FOUNDATION_REACHES = {"casp_core.families", "casp_core.artifacts.gguf.source", "casp_core.artifacts.caches"}


def room_of(module: str) -> str | None:
    """The room (`casp_core.<folder>`) a module of casp_core lives in; None for the root's modules and others."""
    parts = module.split(".")
    if parts[0] != "casp_core" or len(parts) < 2 or parts[1] not in ROOM_DIRS:
        return None
    return f"casp_core.{parts[1]}"


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if (room := room_of(module)) is not None:
            rooms.setdefault(room, set()).update(
                target_room for target in targets if (target_room := room_of(target)) not in (None, room)
            )
    return rooms


def test_the_rooms_are_the_folders_and_the_root_holds_the_foundation() -> None:
    """casp_core's root keeps the modules every room imports (at most 10); the shipped modeling files are one flat
    folder, casp_core/families/modeling (transformers copies only a modeling file's siblings into a checkpoint)."""
    root_modules = sorted(path.name for path in CASP_CORE.glob("*.py"))
    assert len(root_modules) <= 10, root_modules
    assert {"families", "method", "recovery", "artifacts", "eval", "report", "cli", "job"} <= set(ROOM_DIRS)
    modeling = sorted(path.relative_to(REPO).as_posix() for path in CASP_CORE.rglob("modeling_casp_*.py"))
    assert modeling and all(path.startswith("casp_core/families/modeling/") for path in modeling), modeling


def test_the_rooms_form_no_cycle() -> None:
    assert cycles(room_graph(import_graph())) == []


def test_the_room_graph_sees_a_cycle() -> None:
    """The rule above can fail: an import of the job from the method closes a cycle."""
    graph = import_graph()
    graph["casp_core.method.prune"] = graph["casp_core.method.prune"] | {"casp_core.job.run"}
    assert any({"casp_core.job", "casp_core.method"} <= set(cycle) for cycle in cycles(room_graph(graph)))


def test_the_foundation_imports_only_the_foundation_and_what_loads_a_model() -> None:
    reached = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith("casp_core") and room_of(module) is None and not module.endswith("__main__")
        for target in targets
        if room_of(target) is not None and not {target, room_of(target)} & FOUNDATION_REACHES
    )
    assert reached == []


def imports_of_room(graph: dict[str, set[str]], importer: str, forbidden: set[str]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == importer or module.startswith(f"{importer}.")
        for target in targets
        if any(target == room or target.startswith(f"{room}.") for room in forbidden)
    )


METHOD_MUST_NOT_REACH = {f"casp_core.{room}" for room in ("job", "artifacts", "eval", "report", "recovery")}


def test_the_method_writes_no_files_and_knows_no_job() -> None:
    assert imports_of_room(import_graph(), "casp_core.method", METHOD_MUST_NOT_REACH) == []


def test_the_method_rule_sees_a_forbidden_import() -> None:
    graph = import_graph()
    graph["casp_core.method.budget"] = graph["casp_core.method.budget"] | {"casp_core.artifacts.gguf.types"}
    assert imports_of_room(graph, "casp_core.method", METHOD_MUST_NOT_REACH) == [
        "casp_core.method.budget imports casp_core.artifacts.gguf.types"
    ]


def test_the_modeling_files_import_nothing_of_casp_core() -> None:
    """Every import of a modeling file, relative ones made absolute: a checkpoint runs its copy where casp_core is
    not installed."""
    modeling = CASP_CORE / "families" / "modeling"
    imported = sorted(
        f"{path.name} imports {name}"
        for path in modeling.glob("modeling_casp_*.py")
        for name in imported_names(path, module_name(path))
        if name.startswith("casp_core") and not name.startswith("casp_core.families.modeling.modeling_casp_")
    )
    assert imported == []


def external_imports(module: str, graph: dict[str, set[str]], modules: dict[str, Path]) -> set[str]:
    """The top-level packages outside casp_core that `module` and every casp_core module it reaches import."""
    seen, todo, found = set(), [module], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        found |= {name.split(".")[0] for name in imported_names(modules[current], current)} - {"casp_core"}
        todo += [target for target in graph[current] if target.startswith("casp_core")]
    return found


def test_the_settings_load_no_torch() -> None:
    modules = all_modules()
    found = external_imports("casp_core.settings", import_graph(), modules)
    assert "pydantic" in found  # the walk reads the settings' own imports
    assert not found & {"torch", "transformers", "safetensors", "gguf", "llama_cpp", "compressed_tensors"}
