"""Peers found on one host: the directory's location, its trust checks, and its entries."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, replace

import pytest

from sglang_adapter.peer_directory import Origin, PeerDirectory, PeerDirectoryError, open_private, resolve
from tests.helpers import runner_info as _info


def _leave_entry(directory, name: str, origin: Origin, control: str = "tcp://127.0.0.1:5603") -> None:
    (directory / name).write_text(json.dumps({"origin": asdict(origin), "info": _info(control)}))


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


@pytest.mark.parametrize("which", ["peers", "parent"])
def test_a_directory_others_may_write_is_refused_with_the_fix(tmp_path, which):
    (tmp_path / "kvcr" / "peers").mkdir(parents=True, mode=0o700)
    (tmp_path / "kvcr").chmod(0o700)
    (tmp_path / "kvcr" / "peers" if which == "peers" else tmp_path / "kvcr").chmod(0o777)
    with pytest.raises(PeerDirectoryError, match="writable by others .*chmod 700"):
        PeerDirectory(tmp_path / "kvcr" / "peers")


def test_a_link_or_a_file_in_the_directorys_place_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "kvcr").mkdir(mode=0o700)
    (tmp_path / "kvcr" / "peers").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PeerDirectoryError, match="is not a directory"):
        open_private(tmp_path / "kvcr" / "peers")


def test_a_directory_another_user_owns_is_refused(tmp_path, monkeypatch):
    (tmp_path / "peers").mkdir(mode=0o700)
    tmp_path.chmod(0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(PeerDirectoryError, match="belongs to uid"):
        open_private(tmp_path / "peers")


@pytest.fixture
def peers(tmp_path):
    tmp_path.chmod(0o700)
    return tmp_path / "peers"


def test_each_runner_sees_the_others_entries_and_not_its_own(peers):
    a, b = PeerDirectory(peers), PeerDirectory(peers)
    a.join(_info("tcp://127.0.0.1:5601", "a"))
    b.join(_info("tcp://127.0.0.1:5602", "b"))
    assert [e.control for e in a.entries().values()] == ["tcp://127.0.0.1:5602"]
    (entry,) = b.entries().values()
    assert entry.control == "tcp://127.0.0.1:5601" and entry.namespace_digests == {"ns1"}
    assert oct(os.stat(a.own).st_mode & 0o777) == oct(0o600)
    a.leave()
    assert b.entries() == {}


def _ended_process() -> Origin:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return replace(Origin.here(), pid=gone.pid, started=1)


@pytest.mark.parametrize("origin, kept", [
    (_ended_process, False),                                       # its process ended
    (lambda: replace(Origin.here(), started=1), False),            # our pid, another start time: reused
    (lambda: replace(Origin.here(), boot="an-earlier-boot"), False),  # this host before a reboot
    (lambda: replace(Origin.here(), hostname="another-host", pid=1, started=1), True),  # a shared directory
    (lambda: replace(Origin.here(), pid_namespace=1, pid=1, started=1), True),  # another container
])
def test_an_entry_whose_process_is_gone_is_removed(peers, origin, kept):
    me = PeerDirectory(peers)
    _leave_entry(peers, "other.json", origin())
    assert (me.entries() != {}) == kept
    assert (peers / "other.json").exists() == kept


def test_an_entry_that_is_not_a_runners_is_skipped_and_kept(peers, caplog):
    me = PeerDirectory(peers)
    (peers / "junk.json").write_text('{"pid": "x"}')
    assert me.entries() == {} and me.entries() == {}
    assert caplog.text.count("junk.json is not a runner's entry") == 1  # warned once, not every scan
    assert (peers / "junk.json").exists()


def test_an_entry_removed_under_a_running_engine_is_written_again(peers):
    me, other = PeerDirectory(peers), PeerDirectory(peers)
    me.join(_info("tcp://127.0.0.1:5604"))
    me.own.unlink()
    me.rejoin()
    assert [e.control for e in other.entries().values()] == ["tcp://127.0.0.1:5604"]


def test_only_the_process_that_wrote_an_entry_removes_it(peers):
    me, other = PeerDirectory(peers), PeerDirectory(peers)
    me.join(_info("tcp://127.0.0.1:5605"))
    own = me.own
    me.here = replace(me.here, pid=me.here.pid + 1)  # as a forked child inherits it
    me.leave()
    assert own.exists() and len(other.entries()) == 1
