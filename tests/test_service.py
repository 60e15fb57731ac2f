"""A real `kvcr serve` process: discovery, self-check, events with replay and snapshot, shutdown, restart."""

import json
import os
import random
import signal
import stat
import subprocess
import sys
import urllib.request

import msgpack
import pytest
import zmq

from kvcr.client import fetch_info
from kvcr.client import AttachedWriter, ControlClient, ControlError
from kvcr.proto import messages as m
from kvcr.proto.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcr.selfcheck import run_selfcheck
from kvcr.drivers.zmq_subscriber import Delivery, Notice, Subscriber
from tests.helpers import ROOT, wait_until
from tests.pages import BLOCK, pages_for

def collect(sub, until, timeout_s=10.0):
    """Deliveries and notices until `until(items)` is true."""
    items = []
    try:
        wait_until(lambda: (items.extend(sub.poll(100)), until(items))[1], timeout_s, message="events")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; got {items}") from None
    return items


def stored_hashes(items):
    return [h for d in items if isinstance(d, Delivery) for e in d.batch.events if isinstance(e, BlockStored)
            for h in e.block_hashes]


def subscribe(info, name="r"):
    sub = Subscriber()
    sub.add(name, info["endpoints"]["events"], info["endpoints"]["replay"])
    return sub


def test_info_is_served_on_the_control_socket_and_over_http(runner_factory):
    info = runner_factory().start()
    over_zmq = fetch_info(info["endpoints"]["control"])
    over_http = fetch_info(info["endpoints"]["http"])
    assert over_http == info  # the info file, as HTTP: without what addresses the region
    assert {k: v for k, v in over_zmq.items() if k != "ucx"} == {k: v for k, v in info.items() if k != "ucx"}
    assert {"address", "region_base", "rkeys"} <= set(over_zmq["ucx"])
    assert set(info["endpoints"]) == {"events", "replay", "control", "http", "local_control"}
    assert info["endpoints"]["local_control"] == info["shm_path"] + ".sock"  # same-host peers only
    assert stat.S_IMODE(os.stat(info["endpoints"]["local_control"]).st_mode) == 0o600
    assert info["block_size"] == BLOCK and len(info["incarnation"]) == 16
    assert info["pools"][0]["namespace"]["model"] == "default"
    out = subprocess.run([sys.executable, "-m", "kvcr.cli", "info", info["endpoints"]["control"]], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert json.loads(out.stdout)["incarnation"] == info["incarnation"]


def test_selfcheck_round_trips_64_pages_and_the_stream_shows_64_stored(runner_factory):
    info = runner_factory().start()
    sub = subscribe(info)
    wait_until(lambda: list(sub.poll(50)) or True, 1.0)  # let the SUB connect (slow joiner)
    import time
    time.sleep(0.5)
    assert run_selfcheck(info["endpoints"]["control"], pages=64) == 0
    items = collect(sub, lambda it: len(stored_hashes(it)) >= 64)
    assert len(stored_hashes(items)) == 64
    sub.close()


def test_a_gap_is_repaired_by_replay(runner_factory):
    info = runner_factory().start()
    control = info["endpoints"]["control"]
    with ControlClient(control) as client:
        seq, _ = client.snapshot()
        writer = AttachedWriter(client)
        keys, ann, data = pages_for(6)
        for i in range(3):  # three batches nobody is listening to
            writer.put("kv", keys[i:i + 1], data[i:i + 1], ann[i:i + 1])
        import time
        time.sleep(0.3)  # let the publisher thread send them before anyone subscribes
        sub = subscribe(info)
        sub.start_after("r", seq)
        import time
        time.sleep(0.5)
        writer.put("kv", keys[3:], data[3:], ann[3:])
        items = collect(sub, lambda it: len(stored_hashes(it)) >= 6)
        writer.close()
    assert stored_hashes(items) == [a.event_hash for a in ann]
    assert any(isinstance(x, Notice) and x.kind == "gap" for x in items)
    assert [d.replayed for d in items if isinstance(d, Delivery)][:3] == [True, True, True]
    sub.close()


def test_snapshot_streams_the_inventory_with_its_seq(runner_factory):
    info = runner_factory().start()
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        keys, ann, data = pages_for(10)
        writer.put("kv", keys, data, ann)
        seq, events = client.snapshot()
        writer.close()
    assert seq >= 1
    assert [h for e in events for h in e.block_hashes] == [a.event_hash for a in ann]
    assert all(isinstance(e, BlockStored) and e.parent_block_hash in (None, ann[0].event_hash) or True
               for e in events)


def test_pages_read_back_exactly_and_a_missing_page_cuts_the_prefix(runner_factory):
    info = runner_factory().start()
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        keys, ann, data = pages_for(8, seed=3)
        writer.put("kv", keys[:5], data[:5], ann[:5])
        assert writer.get("kv", keys) == data[:5]
        assert client.request(m.Lookup(pool="kv", keys=keys)).num_ready == 5
        assert client.request(m.Remove(pool="kv", keys=keys[2:3])).num_removed == 1
        assert writer.get("kv", keys) == data[:2]
        writer.close()


def test_sigterm_announces_every_removal_and_restart_clears_first_with_a_higher_seq(runner_factory):
    proc = runner_factory()
    info = proc.start()
    sub = subscribe(info)
    import time
    time.sleep(0.5)
    keys, ann, data = pages_for(5)
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        writer.put("kv", keys, data, ann)
        writer.close()
    collect(sub, lambda it: len(stored_hashes(it)) >= 5)
    assert proc.stop(signal.SIGTERM) == 0
    items = collect(sub, lambda it: any(isinstance(d, Delivery) and any(isinstance(e, BlockRemoved)
                                                                         for e in d.batch.events) for d in it))
    removed = [h for d in items if isinstance(d, Delivery) for e in d.batch.events if isinstance(e, BlockRemoved)
               for h in e.block_hashes]
    assert sorted(removed) == sorted(a.event_hash for a in ann)
    last_seq = max(d.seq for d in items if isinstance(d, Delivery))
    sub.close()

    info2 = proc.start()  # same state_dir, new incarnation
    assert info2["incarnation"] != info["incarnation"]
    with ControlClient(info2["endpoints"]["control"]) as client:
        seq, events = client.snapshot()
    assert seq > last_seq and events == []
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(info2["endpoints"]["replay"])
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    first = replay.recv_multipart()
    replay.close()
    assert int.from_bytes(first[2], "big") > last_seq
    assert msgpack.unpackb(first[3])[1][0] == {"type": "AllBlocksCleared"}
    assert AllBlocksCleared().to_wire() == {"type": "AllBlocksCleared"}


# Without keys, requests that touch the region are refused before their handler; a runner that
# accepts TCP by name (insecure) lets the same frames reach the handlers' own checks.
@pytest.mark.parametrize("insecure, handler_codes", [(True, {"claim", "UnknownPool"}), (False, {"unauthenticated"})])
def test_bad_control_frames_are_refused_counted_and_the_runner_keeps_answering(runner_factory, insecure,
                                                                               handler_codes):
    info = runner_factory(**{"runner.peers": ["tcp://127.0.0.1:9"], "runner.insecure": insecure}).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(info["endpoints"]["control"])
    rng = random.Random(7)
    bad = [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"type": "claim", "keys": 3}),
           msgpack.packb({"type": "lookup", "keys": ["zz"]}), msgpack.packb({"type": "reserve", "pool": "nope"}),
           msgpack.packb({"type": "release", "claim_id": 999}), msgpack.packb({"type": "lookup", "version": [9, 0]}),
           msgpack.packb({"type": "granted"}), msgpack.packb({"type": "no-such"}),
           msgpack.packb({"type": [1]}),
           msgpack.packb({"type": "reserve", "keys": ["a" * 64], "announces": [[5, 5, [1] * 16, None, None]]}),
           msgpack.packb({"type": "reserve", "keys": ["a" * 64], "announces": ["x"]}),
           msgpack.packb({"type": "reserve", "keys": ["a" * 64], "lease_s": float("nan")}),
           msgpack.packb({"type": "claim", "keys": ["a" * 64], "lease_s": -1.0}),
           msgpack.packb({"type": "reserve", "keys": ["a" * 64], "writer_pid": -1}),
           msgpack.packb({"type": "commit", "fill_id": 1, "ok": [1, 2, 3]})]
    def mutated(i: int) -> bytes:  # valid messages with fields replaced by junk, and raw noise
        if i % 2:
            return rng.randbytes(rng.randrange(1, 64))
        body = {"type": rng.choice(["lookup", "claim", "reserve", "commit", "release", "renew", "remove", "pull",
                                    "persist", "info"]),
                rng.choice(["keys", "pool", "lease_s", "claim_id", "ok", "announces", "writer_pid", "version"]):
                    rng.choice([None, -1, 2**64 - 1, "x" * 70, [None], {"a": 1}, 1.5, [["zz"]], b"\x00"])}
        return msgpack.packb(body)

    frames = bad + [mutated(i) for i in range(5000)]
    for frame in frames:
        sock.send_multipart([b"", frame])
    replies = [msgpack.unpackb(sock.recv_multipart()[-1]) for _ in frames]
    sock.close()
    assert len(replies) == len(frames)  # every frame answered, none fatal
    assert all(r["type"] == "error" and r["message"] for r in replies[:len(bad)])
    errors = [r for r in replies if r["type"] == "error"]
    assert not [r for r in errors if r["code"] == "internal"], [r for r in errors if r["code"] == "internal"][:3]
    assert len(errors) > 4000  # most mutations are refused; the rest happen to be valid requests
    codes = {r["code"] for r in replies[:len(bad)]}
    assert {"bad_request", "unknown_type", "version", "KeyFormatError", *handler_codes} <= codes
    with ControlClient(info["endpoints"]["control"]) as client:
        assert client.request(m.Lookup(pool="kv", keys=["a" * 64])).num_ready == 0
        with pytest.raises(ControlError, match="unknown pool 'nope'"):
            client.request(m.Lookup(pool="nope", keys=[]))
    assert urllib.request.urlopen(info["endpoints"]["http"] + "/healthz", timeout=5).read() == b"ok\n"
    metrics = urllib.request.urlopen(info["endpoints"]["http"] + "/metrics", timeout=5).read().decode()
    rejected = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("kvcr_control_rejected_total")]
    assert rejected == [len(errors) + 1]


def test_an_exhausted_pool_with_every_page_claimed_is_a_clear_error(runner_factory):
    info = runner_factory(**{"dram.size": "1Mi", "dram.max_claim_fraction": 1.0,
                             "dram.pools": [{"name": "kv", "page_bytes": "256Ki"}]}).start()
    with ControlClient(info["endpoints"]["control"]) as client:
        writer = AttachedWriter(client)
        keys, ann, data = pages_for(5, page_bytes=256 * 1024)
        writer.put("kv", keys[:4], data[:4], ann[:4])
        grant = client.request(m.ClaimRequest(pool="kv", keys=keys[:4]))
        with pytest.raises(ControlError, match="pool 'kv' is full: 1 pages needed, 0 free, 4 claimed"):
            writer.put("kv", keys[4:], data[4:], ann[4:])
        client.request(m.ReleaseRequest(claim_id=grant.claim_id))
        assert writer.get("kv", keys[:4]) == data[:4]  # nothing already stored was lost
        writer.close()


def test_a_quiet_release_ends_its_claim_unanswered_and_a_bad_one_is_only_counted(runner_factory):
    info = runner_factory(**{"dram.size": "1Mi", "dram.max_claim_fraction": 1.0,
                             "dram.pools": [{"name": "kv", "page_bytes": "256Ki"}]}).start()
    with ControlClient(info["endpoints"]["control"], timeout_s=0.3) as client:
        writer = AttachedWriter(client)
        keys, ann, data = pages_for(4, page_bytes=256 * 1024)
        writer.put("kv", keys, data, ann)
        grant = client.request(m.ClaimRequest(pool="kv", keys=keys))
        for claim_id in (grant.claim_id, 999):  # the claim we hold, then one nobody holds
            with pytest.raises(TimeoutError):
                client.request(m.ReleaseRequest(claim_id=claim_id, quiet=True))
        new_keys, new_ann, new_data = pages_for(4, seed=3, page_bytes=256 * 1024)
        writer.put("kv", new_keys, new_data, new_ann)  # fits only if the claimed pages were let go
        assert writer.get("kv", new_keys) == new_data
        writer.close()
    metrics = urllib.request.urlopen(info["endpoints"]["http"] + "/metrics", timeout=5).read().decode()
    assert "kvcr_control_rejected_total 1.0" in metrics  # the unknown claim: refused, not answered


@pytest.mark.parametrize("override,problem", [
    ("dram.size=100Ti", "dram.size = 109951162777600 bytes does not fit in /dev/shm"),
    ("dram.colour=1", "unknown key dram.colour"),
    ("runner.block_size=\"x\"", "runner.block_size = 'x' must be an integer"),
    ("events.endpoint=5557", "events.endpoint"),
    ("namespace.tp_rank=4", "namespace.tp_rank 4 is outside tp_size 1"),
])
def test_bad_config_stops_serve_with_a_message_naming_the_key(override, problem, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvcr.cli", "serve", "--set", override], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert problem in out.stderr


def test_lock_memory_beyond_the_memlock_limit_names_both_keys(tmp_path):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cmd = [sys.executable, "-m", "kvcr.cli", "serve", "--set", "dram.size=64Mi", "--set", "dram.lock_memory=true"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, hard)))
    assert out.returncode == 2
    assert "exceeds the memlock limit" in out.stderr and "dram.lock_memory" in out.stderr


def test_a_peer_one_minor_version_ahead_is_served_and_a_new_major_is_refused(runner_factory):
    info = runner_factory().start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(info["endpoints"]["control"])
    newer = {"type": "lookup", "version": [m.PROTOCOL_MAJOR, m.PROTOCOL_MINOR + 1], "keys": ["a" * 64],
             "request_id": 5, "field_from_the_future": {"x": 1}}
    sock.send_multipart([b"", msgpack.packb(newer)])
    reply = msgpack.unpackb(sock.recv_multipart()[-1])
    assert reply["type"] == "lookup_reply" and reply["request_id"] == 5 and reply["tiers"] == [0]
    sock.send_multipart([b"", msgpack.packb({**newer, "version": [m.PROTOCOL_MAJOR + 1, 0]})])
    reply = msgpack.unpackb(sock.recv_multipart()[-1])
    assert reply["code"] == "version" and f"major version {m.PROTOCOL_MAJOR + 1}" in reply["message"]
    sock.close()


def test_the_ranks_of_one_dp_config_bind_base_plus_rank_publish_the_advertised_host_and_list_each_other(
        runner_factory):
    from sglang_adapter.cpu_harness.server import free_port

    control, http = free_port(2), free_port(2)
    group = {"runner.dp_size": 2, "runner.control_endpoint": f"tcp://0.0.0.0:{control}", "runner.http_host": "0.0.0.0",
             "runner.http_port": http, "runner.insecure": True, "runner.advertise_host": "127.0.0.1"}
    infos = [runner_factory(f"dp{rank}", **group, **{"runner.dp_rank": rank}).start() for rank in (0, 1)]
    # a wildcard bind is published as the advertised host, never as 0.0.0.0
    assert [i["endpoints"]["control"] for i in infos] == [f"tcp://127.0.0.1:{control + r}" for r in (0, 1)]
    assert [i["endpoints"]["http"] for i in infos] == [f"http://127.0.0.1:{http + r}" for r in (0, 1)]
    assert infos[0]["dp_ranks"] == infos[1]["dp_ranks"] == {str(r): f"http://127.0.0.1:{http + r}" for r in (0, 1)}
    assert fetch_info(infos[0]["dp_ranks"]["1"])["dp_rank"] == 1
