"""The NVMe tier against SGLang's real HiCacheFile, and a restarted runner seen by Dynamo's indexer."""

import os
import signal

import pytest
import torch  # noqa: E402  (installed by `make sglang-setup`: the CPU build)
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402

from kvcr.client import AttachedWriter, ControlClient
from kvcr.proto import messages as m
from tests.helpers import wait_until
from tests.nvme_tier import NS, PAGE, Tier, chain


def hicache_file(directory, ns=NS):
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    cfg = HiCacheStorageConfig(tp_rank=ns.tp_rank, tp_size=ns.tp_size, pp_rank=ns.pp_rank, pp_size=ns.pp_size,
                               attn_cp_rank=0, attn_cp_size=1, is_mla_model=ns.is_mla, enable_storage_metrics=False,
                               is_page_first_layout=True, model_name=ns.model,
                               extra_config={"file_storage_path": str(directory)})
    return HiCacheFile(cfg)


def test_hicache_file_reads_the_pages_we_write(tmp_path):
    t = Tier(tmp_path)
    hexes, ann, data = chain(3, seed=8)
    t.tier.write(hexes, [memoryview(d) for d in data], ann)
    theirs = hicache_file(t.tier.dir)
    for h, d in zip(hexes, data):
        assert theirs.exists(h)
        out = torch.empty(PAGE, dtype=torch.uint8)
        assert theirs.get(h, out) is not None and out.numpy().tobytes() == d


def test_we_read_the_pages_hicache_file_writes_and_count_them_unverified(tmp_path):
    t = Tier(tmp_path)
    theirs = hicache_file(t.tier.dir)
    hexes, _, data = chain(2, seed=9)
    for h, d in zip(hexes, data):
        assert theirs.set(h, torch.frombuffer(bytearray(d), dtype=torch.uint8))
    assert t.tier.present(hexes) == 2  # found on disk although another program wrote them
    assert t.read(hexes) == data
    assert t.index.statistics().num_unverified == 2 and t.stored() == []  # no tokens: never announced
    t.tier.close()
    t2 = Tier(tmp_path)  # and after a restart, through the scan
    t2.tier.scan()
    assert t2.read(hexes) == data and t2.index.statistics().num_unverified == 2


@pytest.mark.parametrize("ns", [NS.__class__(model="mla/x", tp_size=4, tp_rank=2, is_mla=True, page_size=4)])
def test_mla_pages_are_shared_by_every_rank_as_hicache_file_names_them(tmp_path, ns):
    t = Tier(tmp_path, ns=ns)
    hexes, ann, data = chain(1, seed=10)
    t.tier.write(hexes, [memoryview(d) for d in data], ann)
    out = torch.empty(PAGE, dtype=torch.uint8)
    assert hicache_file(t.tier.dir, ns).get(hexes[0], out) is not None and out.numpy().tobytes() == data[0]


# --- a runner process with an NVMe tier ------------------------------------------------------------

def test_a_runner_restart_serves_and_reannounces_what_survived_on_disk(runner_factory, tmp_path, indexer):
    from tests.dynamo import registered_runner
    from tests.pages import BLOCK, pages_for

    # Spill policy with room to spare: only the pages Persist writes through reach NVMe.
    proc, info, reg = registered_runner(indexer, runner_factory, **{"nvme.storage_dir": str(tmp_path / "nvme"),
                                                                    "nvme.write_policy": "spill"})
    keys, ann, data = pages_for(6, seed=31, page_bytes=4096)
    tokens = [t for a in ann for t in a.token_ids]
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        writer.put("kv", keys, data, ann)
        writer.close()
        assert client.request(m.Persist(pool="kv", keys=keys[:4])).num_persisted == 4
    q = reg.wait_for(tokens, cpu=6 * BLOCK)
    assert q["disk"] == 6 * BLOCK  # cumulative: DRAM copies plus the NVMe copies of the first 4
    proc.stop(signal.SIGKILL)

    info2 = proc.start()
    # After the restart only the 4 pages on disk exist: announced under DISK, not CPU.
    q = wait_until(lambda: (q := reg.query(tokens)) and q.get("disk") == 4 * BLOCK and q, 20, 0.2,
                   "disk == 4 pages after the restart")
    assert q["cpu"] == 0 and q["gpu"] == 0
    with ControlClient(info2["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        assert writer.get("kv", keys) == data[:4]  # promoted from NVMe into DRAM, byte for byte
        writer.close()
