"""The launcher's --help is SGLang's, plus `kvcr` as a storage backend and kvcr's extra-config keys."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is installed by `make test` (sglang-setup)")

from sglang_adapter.config import AdapterConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEYS = [f.name for f in dataclasses.fields(AdapterConfig)]


def _help(*command: str) -> str:
    # The --help path imports SGLang's server arguments only, not its pools: no torchvision stub.
    proc = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def launcher_help() -> str:
    return _help(sys.executable, "-m", "sglang_adapter.launch_server")


def _backend_choices(text: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("--hicache-storage-backend {"))
    return line.split("{", 1)[1].split("}", 1)[0].split(",")


def test_kvcr_is_a_storage_backend_choice_with_an_explanation(launcher_help):
    choices = _backend_choices(launcher_help)
    assert "kvcr" in choices and "dynamic" in choices and "file" in choices  # SGLang's own stay
    assert "kvcr: kvcr's KV-cache reuse backend" in " ".join(launcher_help.split())


def test_every_adapter_key_is_listed_with_its_type_and_default(launcher_help):
    epilog = launcher_help[launcher_help.index("kvcr extra-config keys"):]
    for key in KEYS:
        assert f"  {key} (" in epilog, key
    assert '  claim_lease_s (float, default 16.0)' in epilog
    assert '  peers (list of strings, default [])' in epilog
    assert '  use_posted_hints (bool, default true)' in epilog


def test_every_adapter_key_has_its_meaning_in_the_help(launcher_help):
    text = " ".join(launcher_help.split())
    for f in dataclasses.fields(AdapterConfig):
        assert f.metadata["help"] in text, f.name


def test_kvcr_sglang_help_is_the_same_help():
    text = _help(str(Path(sys.executable).with_name("kvcr")), "sglang")
    assert text.startswith("usage: kvcr sglang")
    assert "kvcr" in _backend_choices(text)
    assert all(f"  {key} (" in text for key in KEYS)
