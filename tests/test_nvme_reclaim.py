"""A restart's NVMe scan removes temporary files a killed writer left, and says so; a young one
(perhaps a live writer's in a shared directory) is kept."""

import logging
import os
import time

from tests.nvme_tier import Tier

LOGGER = "kvcr.drivers.nvme"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_the_scan_removes_old_temps_keeps_young_ones_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    first = Tier(tmp_path)
    ns_dir = first.tier.dir
    first.tier.close()
    old, young = ns_dir / ".killed-writer.tmp", ns_dir / ".live-writer.tmp"
    old.write_bytes(b"half")
    young.write_bytes(b"half")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    t = Tier(tmp_path, stale_temp_age_s=600)
    t.tier.scan()
    t.tier.close()
    assert not old.exists() and young.exists()
    assert _warnings(caplog) == [f"nvme: removed 1 temporary file(s) in {ns_dir} left by writers that died"]


def test_a_scan_with_nothing_to_remove_is_silent(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    t = Tier(tmp_path)
    t.tier.scan()
    t.tier.close()
    assert _warnings(caplog) == []
