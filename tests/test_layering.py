"""The package layering, read from the source: kvcr imports neither router_hints nor sglang_adapter
(they build on it), and kvcr/proto (decisions) imports nothing of kvcr's I/O."""

import ast
from pathlib import Path

import pytest

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
