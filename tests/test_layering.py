"""The package layering, read from the source: kvcr imports neither router_hints nor sglang_adapter
(they build on it), and kvcr/proto (decisions) imports nothing of kvcr's I/O."""

import ast
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions, made absolute."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            else:
                out.add(node.module)
    return out


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def offenders(folder: str, forbidden: tuple[str, ...], allowed: set[str] = frozenset()) -> list[str]:
    found = []
    for path in sources(folder):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel.startswith(a + "/") for a in allowed):
            continue
        found += [f"{rel} imports {mod}" for mod in sorted(imported_modules(path))
                  if any(mod == f or mod.startswith(f + ".") for f in forbidden)]
    return found


@pytest.mark.parametrize("folder, forbidden, allowed", [
    ("kvcr", ("router_hints",), set()),
    ("kvcr", ("sglang_adapter",), set()),  # `kvcr demo --engine sglang` comes through an entry point
    ("kvcr/proto", ("kvcr.drivers", "kvcr.runner", "kvcr.service", "kvcr.client", "kvcr.peer", "zmq", "ucxx",
                    "aiohttp", "socket", "threading"), set()),
    ("router_hints", ("sglang_adapter.storage", "sglang_adapter.sidecar"), set()),
])
def test_each_package_imports_only_the_layers_below_it(folder, forbidden, allowed):
    assert offenders(folder, forbidden, allowed) == []


def test_the_scan_sees_imports_inside_functions_and_relative_ones():
    names = imported_modules(ROOT / "router_hints" / "cli.py")
    assert "kvcr.cli" in names                  # absolute, at module level
    assert "router_hints.discovery" in names    # relative, inside a function
    assert "router_hints.replay.main" in names


PACKAGES = ("kvcr", "router_hints", "sglang_adapter")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """Module -> the modules of ours it imports (every import, TYPE_CHECKING and function-local
    ones too); `from package import name` counts as the submodule when `name` is one."""
    modules = {module_name(p): p for pkg in PACKAGES for p in sources(pkg)}

    def ours(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = next(iter(imported_modules_of(node, name, path)))
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = frozenset(t for t in map(ours, targets) if t is not None and t != name)
    return graph


def imported_modules_of(node: ast.ImportFrom, module: str, path: Path) -> set[str]:
    if not node.level:
        return {node.module}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return {".".join(base + ([node.module] if node.module else []))}


def circles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is not None:
                if nxt in index:
                    low[node] = min(low[node], index[nxt])
                else:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_module_imports_its_way_back_to_itself():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_through_several_modules():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a", "d"}), "d": frozenset()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({**graph, "c": frozenset({"d"})}) == []


@pytest.mark.parametrize("module, below", [
    # The DRAM core knows the tier below and shard assembly only through lower.py's interfaces.
    ("kvcr.runner.dram", ("kvcr.runner.nvme_tier", "kvcr.runner.persister", "kvcr.runner.shards",
                          "kvcr.runner.store", "kvcr.service", "kvcr.drivers.nvme")),
    ("kvcr.runner.nvme_tier", ("kvcr.runner.dram", "kvcr.runner.store", "kvcr.runner.shards")),
    ("kvcr.runner.persister", ("kvcr.runner.dram", "kvcr.runner.nvme_tier", "kvcr.runner.store")),
    ("kvcr.runner.shards", ("kvcr.runner.dram", "kvcr.runner.store", "kvcr.runner.nvme_tier")),
    ("kvcr.runner.lower", ("kvcr.runner.dram", "kvcr.runner.nvme_tier", "kvcr.runner.shards",
                           "kvcr.runner.store", "kvcr.runner.persister")),
    ("kvcr.runner.layout", ("kvcr.runner.dram", "kvcr.runner.lower", "kvcr.runner.nvme_tier", "kvcr.runner.shards",
                            "kvcr.runner.store", "kvcr.runner.persister", "kvcr.runner.statistics")),
    ("kvcr.runner.events", ("kvcr.runner.dram", "kvcr.runner.nvme_tier", "kvcr.runner.shards",
                            "kvcr.runner.store", "kvcr.runner.persister", "kvcr.drivers")),
    ("kvcr.runner.statistics", ("kvcr.runner.dram", "kvcr.runner.nvme_tier", "kvcr.runner.shards",
                                "kvcr.runner.store", "kvcr.runner.persister")),
])
def test_the_runner_layers_parts_know_each_other_only_through_its_interfaces(module, below):
    assert sorted(import_graph()[module] & set(below)) == []


def test_a_pure_test_that_starts_a_process_or_opens_a_socket_fails():
    import socket
    import subprocess

    with pytest.raises(AssertionError, match="started a process"):
        subprocess.Popen(["true"])
    with pytest.raises(AssertionError, match="opened a socket"):
        socket.socket()


def test_tests_share_helpers_through_helper_modules_never_through_conftest_or_another_test():
    offending = [f"{path.relative_to(ROOT)} imports {mod}" for path in sorted((ROOT / "tests").rglob("*.py"))
                 for mod in sorted(imported_modules(path))
                 if mod.startswith("tests.") and mod.rsplit(".", 1)[-1].startswith(("conftest", "test_"))]
    assert offending == []
