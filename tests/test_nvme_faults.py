"""Full disk, read-only filesystem, permission denied: produced for real, never by a fake.

Tests run as root, where chmod does not make a directory read-only, so ENOSPC and EROFS come from
a 1 MiB tmpfs mounted inside `unshare -m`, and EACCES from a child dropped to uid nobody.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare to make real faults")


def run_in_tmpfs(scenario, tmp_path, size="1m"):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = tmp_path / "result.json"
    script = (f"mount -t tmpfs -o size={size} tmpfs {mnt} && "
              f"{sys.executable} -m tests.nvme_fault_child {scenario} {mnt} {out}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_a_full_disk_fails_the_write_cleanly_and_keeps_every_stored_page(tmp_path):
    r = run_in_tmpfs("enospc", tmp_path)
    assert 1 <= r["stored"] < 64 and r["failed_again"]
    assert r["errors"].get("ENOSPC", 0) >= 2
    assert r["intact"] and r["tmp_left"] == []


def test_a_read_only_filesystem_refuses_writes_and_still_serves_reads(tmp_path):
    r = run_in_tmpfs("erofs", tmp_path)
    assert r["before"] == [True, True, True] and r["refused"] == [False]
    assert r["errors"] == {"EROFS": 1} and r["intact"]


def test_a_disk_that_fills_during_write_behind_leaves_fills_working_and_drops_counted(tmp_path):
    r = run_in_tmpfs("burst_enospc", tmp_path)
    assert r["errors"].get("ENOSPC", 0) >= 1 and 1 <= r["on_disk"] < 64
    assert r["ready"] == 32  # every put succeeded: DRAM kept working
    assert r["dropped"].get("nvme_write_failed", 0) >= 1  # what neither tier kept is counted, by name
    assert r["on_disk"] + r["ready"] + sum(r["dropped"].values()) >= 64
    assert r["intact"] and r["tmp_left"] == []


def test_a_disk_turning_read_only_during_write_behind_keeps_what_it_has_and_counts_the_rest(tmp_path):
    r = run_in_tmpfs("burst_erofs", tmp_path, size="4m")
    assert r["before"] == 16 and r["errors"].get("EROFS", 0) >= 1
    assert r["dropped"].get("nvme_write_failed", 0) >= 1 and r["first_request_back"] and r["intact"]


def test_permission_denied_is_a_counted_failure_and_reads_still_work(tmp_path):
    # pytest's tmp_path sits under a 0700 directory: use a world-traversable one for the store.
    base = Path(tempfile.mkdtemp(prefix="kvcr-eacces-"))
    try:
        os.chmod(base, 0o755)
        out = tmp_path / "result.json"
        proc = subprocess.run([sys.executable, "-m", "tests.nvme_fault_child", "eacces", str(base / "store"),
                               str(out), str(tmp_path / "private")], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        r = json.loads(out.read_text())
    finally:
        shutil.rmtree(base)
    assert r["refused"] == [False] and r["errors"] == {"EACCES": 1} and r["intact"]
    assert "nvme.storage_dir: cannot use" in r["unusable"] and "Permission denied" in r["unusable"]
