"""The layering above the engine, read from the source: the server's modules import each
other without a circle, and nothing above the engine imports its internals or reaches for
them by attribute. Every import counts: module level, inside functions and under
``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What sits above the engine and must see it only through its face (``EngineInfo``,
# ``EngineSnapshot``) and its request API (``LLM``, ``LLMEngine``, ``AsyncEngine``).
ABOVE_ENGINE = (
    "ragserve/server",
    "ragserve/bench",
    "ragserve/commands",
    "ragserve/cli.py",
    "ragserve/llm.py",
    "pipelines",
    "loadtests",
)
FORBIDDEN = ("kvstore", "kernels", "ragserve.engine", "ragserve.models")
ALLOWED = (
    "ragserve.engine.async_engine",
    "ragserve.engine.engine_info",  # the face, and the value types it hands out
    "ragserve.engine.llm_engine",
    "ragserve.models.default_model",  # where the embedded model's files are
    "ragserve.models.hf_export",  # a model's shape and HF directory, read without loading it
    # A client of the Redis-protocol store (pool, breaker): the document registry shares
    # its rows through the store on a client of its own; it holds no engine state.
    "kvstore.remote_store",
)
# (file, module): benchmarks of one thing below the engine, reading no engine state: the
# block hash; two builds of the native CPU kernels swapped under one engine.
EXCEPTIONS = {
    ("ragserve/bench/prefix.py", "kvstore.hashing"),
    ("ragserve/bench/builds.py", "kernels.cpu_native"),
}
# Attributes of the engine's internals: the scheduler, KV manager, block pool, KV tensor,
# loaded model and tiers.
INTERNAL_ATTRIBUTES = {
    "scheduler",
    "kv_manager",
    "block_pool",
    "kv_cache",
    "kv_spec",
    "loaded",
    "tiers",
}


def python_files(relative: str) -> list[Path]:
    path = REPO / relative
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> Iterator[str]:
    """Every module ``path`` imports; ``from package import name`` also yields
    ``package.name`` (it may be a submodule)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def server_import_graph() -> dict[str, set[str]]:
    """Each module of ``ragserve.server`` -> the modules of ``ragserve.server`` it imports."""
    files = python_files("ragserve/server")
    modules = {module_name(path) for path in files}
    return {
        module_name(path): {name for name in imported_modules(path) if name in modules}
        - {module_name(path)}
        for path in files
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle is not None:
            return cycle
    return None


def test_find_cycle_finds_a_circle_and_only_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_server_modules_import_each_other_without_a_circle() -> None:
    graph = server_import_graph()
    assert graph.get("ragserve.server.state"), "the graph reads the server's imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def is_forbidden(module: str) -> bool:
    def within(prefix: str) -> bool:
        return module == prefix or module.startswith(prefix + ".")

    return any(within(p) for p in FORBIDDEN) and not any(within(a) for a in ALLOWED)


def test_nothing_above_the_engine_imports_its_internals() -> None:
    found = []
    for relative in ABOVE_ENGINE:
        for path in python_files(relative):
            where = path.relative_to(REPO).as_posix()
            found += [
                f"{where}: {module}"
                for module in set(imported_modules(path))
                if is_forbidden(module)
                and not any(where == file and module.startswith(m) for file, m in EXCEPTIONS)
            ]
    assert not found, "imports of engine internals:\n" + "\n".join(sorted(found))


def names_engine(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "engine") or (
        isinstance(node, ast.Name) and node.id == "engine"
    )


def test_nothing_above_the_engine_reaches_for_its_internals() -> None:
    found = []
    for relative in ABOVE_ENGINE:
        for path in python_files(relative):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Attribute):
                    continue
                # ``engine.engine``: the engine behind ``AsyncEngine``
                behind_async = node.attr == "engine" and names_engine(node.value)
                if node.attr in INTERNAL_ATTRIBUTES or behind_async:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "engine internals read above the engine:\n" + "\n".join(found)


def test_the_forbidden_set_is_what_it_says() -> None:
    assert is_forbidden("kvstore.tier_stack") and is_forbidden("kernels.registry")
    assert is_forbidden("ragserve.engine.scheduler") and is_forbidden("ragserve.models.loader")
    assert not is_forbidden("ragserve.engine.engine_info")
    assert not is_forbidden("ragserve.engine.async_engine")
    assert not is_forbidden("ragserve.sampling_params")
