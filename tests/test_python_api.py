"""docs/python-api.md stays true: every public name it lists imports, and its example runs
against a real runner (UCX, shared memory, claims)."""

import importlib
import re
from pathlib import Path

import pytest

from kvcr.client import ControlClient
from tests.helpers import wait_until

DOC = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def public_names() -> list[tuple[str, str]]:
    """(module, dotted name) for the first cell of every table row under a heading naming its module(s)."""
    out, modules = [], []
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            modules = re.findall(r"`(kvcr[\w.]*)`", line)
        elif line.startswith("| `") and modules:
            for name in re.findall(r"`([A-Za-z_][\w.]*)", line.split(" | ")[0]):
                out.append((next((mod for mod in modules if resolve(mod, name) is not None), modules[0]), name))
    return out


def resolve(module: str, dotted: str) -> object:
    obj = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def test_the_page_lists_names_from_every_section():
    names = public_names()
    assert len(names) >= 30 and len({mod for mod, _ in names}) == 8


@pytest.mark.parametrize("module, name", public_names())
def test_every_public_name_imports_where_the_page_says(module, name):
    assert resolve(module, name) is not None, f"{module}.{name} is documented but missing"


def test_the_example_stores_and_pulls_against_a_live_runner(runner_factory):
    info = runner_factory("api", **{"dram.pools": [{"name": "kv", "page_bytes": 16384}]}).start()
    source = info["endpoints"]["control"]
    with ControlClient(source) as client:
        wait_until(lambda: client.info()["ucx"]["rkeys"], 10, 0.05, "UCX registration")
    [code] = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    exec(compile(code, str(DOC), "exec"), {"SOURCE": source})
