"""A region left by a runner that was killed (SGLang SIGKILLs its schedulers) is reclaimed by the
next start, which says so, and by the launcher once the engine's processes are gone."""

import logging
import os
import subprocess
from pathlib import Path

import pytest

from kvcr.drivers.shm import SHM_DIR, Region, region_name, sweep_stale

LOGGER = "kvcr.drivers.shm"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: no zombie keeps the pid alive for kill(pid, 0)
    return proc.pid


@pytest.fixture
def dead_region():
    """A region file in /dev/shm named for a process that is gone."""
    path = Path(SHM_DIR) / f"kvcr-test-{_dead_pid()}-x"
    path.write_bytes(b"\0" * 4096)
    yield path
    path.unlink(missing_ok=True)


def _reclaimed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_the_next_region_create_removes_a_dead_owners_region_and_names_it(dead_region, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    region = Region.create(region_name("test", os.getpid(), "reclaim"), 4096)
    try:
        assert not dead_region.exists()
        messages = _reclaimed(caplog)
        assert len(messages) == 1 and dead_region.name in messages[0]
    finally:
        region.close()
    assert not Path(region.path).exists()


def test_a_live_owners_region_and_other_files_are_kept(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    live = tmp_path / region_name("test", os.getpid(), "live")
    foreign = tmp_path / "kvcr-notaregion"
    dead = tmp_path / region_name("test", _dead_pid(), "dead")
    for path in (live, foreign, dead):
        path.write_bytes(b"")
    assert sweep_stale(str(tmp_path)) == [dead.name]
    assert live.exists() and foreign.exists() and not dead.exists()
    assert _reclaimed(caplog) == [f"reclaimed 1 shared-memory region(s) in {tmp_path} left by processes "
                                  f"that are gone: {dead.name}"]


def test_a_sweep_with_nothing_to_reclaim_is_silent(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    (tmp_path / region_name("test", os.getpid(), "live")).write_bytes(b"")
    assert sweep_stale(str(tmp_path)) == []
    assert _reclaimed(caplog) == []


def test_the_launcher_reclaims_regions_after_the_engine_ends(dead_region, caplog, monkeypatch):
    pytest.importorskip("sglang", reason="SGLang is installed by `make test` (sglang-setup)")
    import sglang.launch_server
    import sglang.srt.server_args
    import sglang.srt.utils

    from sglang_adapter import launch_server

    def run_server(server_args):
        raise RuntimeError("engine died")

    killed = []
    monkeypatch.setenv("KVCR_SGLANG_HOOKS", "0")  # main sets it; restored after the test
    monkeypatch.setattr(sglang.srt.server_args, "prepare_server_args", lambda args: args)
    monkeypatch.setattr(sglang.launch_server, "run_server", run_server)
    monkeypatch.setattr(sglang.srt.utils, "kill_process_tree", lambda pid, include_parent: killed.append(pid))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with pytest.raises(RuntimeError, match="engine died"):
        launch_server.main(["--model-path", "some/model"])
    assert killed == [os.getpid()]
    assert not dead_region.exists()
    assert any(dead_region.name in m for m in _reclaimed(caplog))
