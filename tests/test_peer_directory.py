"""Peers found on one host: the directory's location, its trust checks, and its entries."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvcr.drivers.shm import host_id
from sglang_adapter.peer_directory import PeerDirectory, PeerDirectoryError, open_private, resolve


def _info(control: str, incarnation: str = "i1", digest: str = "ns1") -> dict:
    return {"incarnation": incarnation, "events_curve": False, "host_id": "",
            "endpoints": {"control": control, "events": control.replace("56", "57"), "replay": None},
            "pools": [{"name": "kv", "namespace_digest": digest}]}


@pytest.mark.parametrize("setting, env, expected", [
    ("", {"XDG_RUNTIME_DIR": "/run/user/7"}, None),
    ("auto", {"XDG_RUNTIME_DIR": "/run/user/7"}, "/run/user/7/kvcr/peers"),
    ("auto", {"TMPDIR": "/scratch"}, "/scratch/kvcr-7/peers"),
    ("/srv/kvcr/peers", {"XDG_RUNTIME_DIR": "/run/user/7"}, "/srv/kvcr/peers"),
])
def test_the_peers_dir_setting_names_the_users_own_directory(setting, env, expected):
    found = resolve(setting, env, uid=7)
    assert (str(found) if found else None) == expected


def test_a_missing_directory_is_made_closed_to_other_users(tmp_path):
    path = open_private(tmp_path / "kvcr" / "peers")
    assert path.is_dir() and path.stat().st_mode & 0o777 == 0o700
    assert path.parent.stat().st_mode & 0o777 == 0o700


def test_a_directory_others_may_write_is_refused_with_the_fix(tmp_path):
    shared = tmp_path / "peers"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PeerDirectoryError, match="writable by others .*chmod 700"):
        PeerDirectory(shared)


def test_a_directory_another_user_owns_is_refused(tmp_path, monkeypatch):
    (tmp_path / "peers").mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(PeerDirectoryError, match="belongs to uid"):
        open_private(tmp_path / "peers")


def test_each_runner_sees_the_others_entries_and_not_its_own(tmp_path):
    a, b = PeerDirectory(tmp_path), PeerDirectory(tmp_path)
    a.join(_info("tcp://127.0.0.1:5601", "a"))
    b.join(_info("tcp://127.0.0.1:5602", "b"))
    assert [e.control for e in a.entries().values()] == ["tcp://127.0.0.1:5602"]
    (entry,) = b.entries().values()
    assert entry.control == "tcp://127.0.0.1:5601" and entry.namespace_digests == {"ns1"}
    assert oct(os.stat(a.own).st_mode & 0o777) == oct(0o600)
    a.leave()
    assert b.entries() == {}


def test_an_entry_whose_process_is_gone_is_removed(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    info = {**_info("tcp://127.0.0.1:5603"), "host_id": host_id()}
    (tmp_path / "dead.json").write_text(json.dumps({"pid": gone.pid, "info": info}))
    me = PeerDirectory(tmp_path)
    assert me.entries() == {}
    assert not (tmp_path / "dead.json").exists()


def test_an_entry_that_is_not_a_runners_is_skipped_and_kept(tmp_path, caplog):
    (tmp_path / "junk.json").write_text('{"pid": "x"}')
    assert PeerDirectory(tmp_path).entries() == {}
    assert "junk.json is not a runner's entry" in caplog.text
    assert (tmp_path / "junk.json").exists()
