"""Peer pulls between real runner processes: ZMQ claims, UCX one-sided GETs, releases on every path."""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kvcr.client import AttachedWriter, ControlClient, ControlError
from kvcr.proto import messages as m
from kvcr.proto.pull import PeerError
from tests.helpers import stop, wait_until
from tests.pages import pages_for
from tests.peers import (PAGE, POOLS, buffers, claims_held, no_claims_left, pull, read, source, start_pair, store,
                         wait_registered)


def test_a_runner_pulls_pages_it_lacks_byte_for_byte_and_the_source_keeps_no_claim(runner_factory):
    a, ai, b, bi = start_pair(runner_factory)
    wait_registered(ai)
    keys, ann, data = store(ai, 64, seed=1)
    assert pull(bi, ai, keys) == 64
    assert read(bi, keys) == data
    no_claims_left(ai)
    with ControlClient(bi["endpoints"]["control"]) as client:
        _, events = client.snapshot()  # B announces what it pulled, with the engine's hashes
    assert [h for e in events for h in e.block_hashes] == [x.event_hash for x in ann]


def test_only_the_leading_pages_the_source_holds_are_pulled(runner_factory):
    a, ai, b, bi = start_pair(runner_factory)
    wait_registered(ai)
    keys, _, data = store(ai, 64, seed=2, upto=40)
    assert pull(bi, ai, keys) == 40
    assert read(bi, keys) == data[:40]
    with ControlClient(ai["endpoints"]["control"]) as client:
        tiers = client.request(m.Lookup(pool="kv", keys=keys)).tiers
    assert tiers == [1] * 40 + [0] * 24
    no_claims_left(ai)


def test_nvme_pages_are_staged_into_dram_at_the_source_first(runner_factory, tmp_path):
    a, ai, b, bi = start_pair(runner_factory, a_overrides={"nvme.storage_dir": str(tmp_path / "nvme")})
    wait_registered(ai)
    keys, _, data = store(ai, 8, seed=3)
    with ControlClient(ai["endpoints"]["control"]) as client:
        assert client.request(m.Persist(pool="kv", keys=keys)).num_persisted == 8
        # drop the DRAM copies only: the NVMe copies remain (Remove drops both, so evict via a fresh runner)
    a.stop()
    ai = a.start()  # DRAM is empty after a restart; the NVMe tier still holds the 8 pages
    wait_registered(ai)
    with ControlClient(ai["endpoints"]["control"]) as client:
        wait_until(lambda: client.request(m.Lookup(pool="kv", keys=keys)).tiers == [2] * 8, 10, 0.05, "scan")
    assert pull(bi, ai, keys) == 8
    assert read(bi, keys) == data


def test_a_namespace_mismatch_is_refused_naming_both_values(runner_factory):
    a, ai, b, bi = start_pair(runner_factory, b_overrides={"namespace.dtype": "bfloat16"})
    wait_registered(ai)
    keys, _, _ = store(ai, 2, seed=4)
    # B (bfloat16) claims at A (float16): A refuses, naming both values, and B passes that on.
    with pytest.raises(ControlError, match="dtype: ours 'float16', yours 'bfloat16'"):
        pull(bi, ai, keys)


def test_an_untrusted_source_is_refused(runner_factory):
    a, ai, b, bi = start_pair(runner_factory, b_overrides={"runner.peers": ["tcp://127.0.0.1:1"]})
    keys, _, _ = store(ai, 2, seed=5)
    with pytest.raises(ControlError, match="not a trusted peer"):
        pull(bi, ai, keys)
    assert read(bi, keys) == []


# --- the destination side in this process: stalls, kills, cancels ------------------------------------


def test_a_destination_that_stalls_past_its_lease_never_delivers_reused_bytes(runner_factory, puller):
    a, ai = source(runner_factory)
    keys, _, data = store(ai, 4, seed=6)
    conf = puller.confirm(ai["endpoints"]["control"], "kv", keys)
    assert conf.num_pages == 4
    time.sleep(1.2)  # the 0.5 s lease expires at the source while we stall
    with ControlClient(ai["endpoints"]["control"]) as client:
        client.request(m.Remove(pool="kv", keys=keys))  # slots freed ...
    store(ai, 4, seed=7)  # ... and reused for other pages
    raw, dests = buffers(4)
    result = puller.deliver(conf, dests)
    assert result.delivered == 0  # the release answer says the slots changed: nothing is delivered
    no_claims_left(ai)


def test_a_cancelled_confirmation_releases_its_claim(runner_factory, puller):
    a, ai = source(runner_factory)
    keys, _, _ = store(ai, 4, seed=8)
    conf = puller.confirm(ai["endpoints"]["control"], "kv", keys)
    assert claims_held(ai) == 1
    assert puller.release(conf) == (True,) * 4
    assert claims_held(ai) == 0 and puller.release(conf) == ()  # idempotent


def test_a_source_killed_mid_pull_delivers_only_whole_leading_pages(runner_factory, puller):
    a, ai = source(runner_factory, **{"dram.size": "64Mi"})
    keys, _, data = store(ai, 256, seed=9)
    raw, dests = buffers(256)
    conf = puller.confirm(ai["endpoints"]["control"], "kv", keys)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", puller.deliver(conf, dests)))
    killer = threading.Timer(0.002, lambda: a.proc.send_signal(signal.SIGKILL))
    t0 = time.monotonic()
    killer.start()
    thread.start()
    thread.join(puller.timeout_s + puller.abandon_s + 5)
    assert not thread.is_alive() and time.monotonic() - t0 < puller.timeout_s + puller.abandon_s + 2
    r = result["r"]
    got = raw.raw
    for i in range(256):
        page = got[i * PAGE:(i + 1) * PAGE]
        if i < r.delivered:
            assert page == data[i], f"delivered page {i} differs"
    if r.delivered < 256:  # what was not delivered is never trusted: the caller keeps its sentinel pages
        assert r.error or r.delivered == 0
    a.proc.wait(5)
    ai2 = a.start()
    no_claims_left(ai2)


def test_a_posted_hint_names_the_source_and_move_mode_drops_the_source_copy(runner_factory):
    from kvcr.proto.hints import build_envelope
    from kvcr.proto.keys import hash_str_to_int64

    a, ai, b, bi = start_pair(runner_factory)
    wait_registered(ai)
    keys, ann, data = store(ai, 8, seed=10)
    envelope = build_envelope(ai["endpoints"]["control"], [hash_str_to_int64(k) for k in keys], mode="move")
    with ControlClient(bi["endpoints"]["control"]) as client:
        assert client.request(m.PostHint(envelope=envelope)).num_hashes == 8
        with pytest.raises(ControlError, match="non-empty list"):
            client.request(m.PostHint(envelope={**envelope, "actions": [{**envelope["actions"][0], "payload": {
                "source_control_endpoint": "tcp://x:1", "block_hashes": []}}]}))
        assert client.request(m.PullRequest(pool="kv", keys=keys), timeout_s=30).num_local == 8  # no source named
    assert read(bi, keys) == data
    with ControlClient(ai["endpoints"]["control"]) as client:
        assert client.request(m.Lookup(pool="kv", keys=keys)).tiers == [0] * 8  # moved, not copied
    no_claims_left(ai)


def test_a_peer_over_its_claim_limit_is_told_busy(runner_factory, puller):
    a, ai = source(runner_factory, **{"runner.max_claims_per_peer": 1})
    keys, _, _ = store(ai, 4, seed=11)
    first = puller.confirm(ai["endpoints"]["control"], "kv", keys[:2])
    assert first is not None
    assert puller.confirm(ai["endpoints"]["control"], "kv", keys[2:]) is None  # Busy: a miss, not an error
    puller.release(first)
    assert puller.confirm(ai["endpoints"]["control"], "kv", keys[2:]).num_pages == 2


def test_with_curve_only_key_holders_get_answers_and_peers_still_pull(runner_factory):
    import zmq

    public, secret = (k.decode() for k in zmq.curve_keypair())
    keys_cfg = {"runner.curve_public_key": public, "runner.curve_secret_key": secret}
    a, ai, b, bi = start_pair(runner_factory, b_overrides=keys_cfg, a_overrides=keys_cfg)
    from kvcr.config import CurveKeys
    curve = CurveKeys(public.encode(), secret.encode(), frozenset())
    with ControlClient(ai["endpoints"]["control"], curve=curve) as client:
        wait_until(lambda: client.info()["ucx"]["rkeys"], 10, 0.05, "UCX registration")
        keys, _, data = pages_for(4, seed=12, page_bytes=PAGE)
        writer = AttachedWriter(client)
        writer.put("kv", keys, data)
        writer.close()
    with ControlClient(bi["endpoints"]["control"], curve=curve, timeout_s=30) as client:
        assert client.request(m.PullRequest(source_endpoint=ai["endpoints"]["control"], pool="kv", keys=keys)).num_local == 4
    # No keys at all, or a key pair the runner does not know: not a single byte comes back.
    with ControlClient(ai["endpoints"]["control"], timeout_s=1.0) as plain, pytest.raises(TimeoutError):
        plain.info()
    other_public, other_secret = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = public.encode(), other_public, other_secret
    sock.connect(ai["endpoints"]["control"])
    sock.send_multipart([b"", m.encode(m.InfoRequest())])
    assert not sock.poll(1000)
    sock.close()


def test_with_digests_a_page_scribbled_on_at_the_source_is_not_delivered(runner_factory, puller):
    from kvcr.drivers.shm import Region

    a, ai = source(runner_factory)
    keys, _, data = store(ai, 4, seed=13)
    puller.verify_transfer_bytes = True
    conf = puller.confirm(ai["endpoints"]["control"], "kv", keys)
    assert len(conf.digests) == 4
    # A real fault, not a fake: a stray writer attached to the pool overwrites a claimed page.
    region = Region.attach(ai["shm_path"])
    view = region.view
    view[conf.offsets[2]:conf.offsets[2] + 16] = b"\x00" * 16
    view.release()
    region.close()
    raw, dests = buffers(4)
    result = puller.deliver(conf, dests)
    assert result.delivered == 2 and puller.num_digest_mismatches == 1
    assert raw.raw[:2 * PAGE] == data[0] + data[1]


def test_a_restarted_source_is_fenced_and_then_served_afresh(runner_factory, puller):
    from tests.dynamo import free_port

    a, ai = source(runner_factory, **{"runner.control_endpoint": f"tcp://127.0.0.1:{free_port()}"})
    keys, _, data = store(ai, 4, seed=14)
    conf = puller.confirm(ai["endpoints"]["control"], "kv", keys)
    a.stop()
    ai = a.start()  # same control endpoint, new incarnation, new region: the old claim means nothing
    wait_registered(ai)
    raw, dests = buffers(4)
    assert puller.deliver(conf, dests).delivered == 0
    store(ai, 4, seed=14)
    conf = puller.confirm(ai["endpoints"]["control"], "kv", keys)  # fenced, then reconnected afresh
    assert conf.source.incarnation == ai["incarnation"]
    assert puller.deliver(conf, dests).delivered == 4 and raw.raw[:4 * PAGE] == b"".join(data)
    no_claims_left(ai)  # the claim granted to the stale view was given back


@pytest.mark.parametrize("transfer", ["get", "tag"])
def test_a_puller_pulls_again_after_its_source_dies_mid_transfer_any_number_of_times(runner_factory, puller,
                                                                                      transfer):
    """A source stopped with our GETs (or tagged sends) in flight, then killed and restarted, three
    times: each stuck transfer ends by the stated bound, leaves nothing uncertain, and the same
    puller then pulls every page from the restarted source."""
    from tests.dynamo import free_port

    a, ai = source(runner_factory, **{"runner.control_endpoint": f"tcp://127.0.0.1:{free_port()}",
                                      "dram.size": "64Mi"})
    puller.transport = transfer
    bound = puller.timeout_s + puller.abandon_s + 2
    raw, dests = buffers(128)
    for _ in range(3):
        keys, _, data = store(ai, 128, seed=16)
        conf = puller.confirm(ai["endpoints"]["control"], "kv", keys)
        a.proc.send_signal(signal.SIGSTOP)  # granted, then frozen: nothing it should send comes
        t0 = time.monotonic()
        result = puller.deliver(conf, dests)
        took = time.monotonic() - t0
        assert took < bound, f"the stuck transfer ended after {took:.2f} s, past {bound} s: {result}"
        assert not result.uncertain and result.delivered == 0, result
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(5)
        ai = a.start()
        wait_registered(ai)
    keys, _, data = store(ai, 128, seed=16)
    t0 = time.monotonic()
    result = puller.pull(ai["endpoints"]["control"], "kv", keys, dests)
    took = time.monotonic() - t0
    assert result.delivered == 128, result
    assert took < bound, f"the pull from the restarted source took {took:.2f} s, past {bound} s"
    assert raw.raw[:128 * PAGE] == b"".join(data)
    assert puller.plane.num_retired_workers == 3
    no_claims_left(ai)


def kill_while_its_claim_is_held(dest, dest_info, source_info, keys, attempts=5) -> None:
    """SIGKILL a destination runner whose pull of `keys` holds a claim at the source at that moment
    (stopped first, so the claim cannot be released between the check and the kill)."""
    for _ in range(attempts):
        with ControlClient(dest_info["endpoints"]["control"]) as client:  # a caught-too-late pull's pages
            client.request(m.Remove(pool="kv", keys=keys))
        threading.Thread(target=lambda: _pull_until_killed(dest_info, source_info, keys), daemon=True).start()
        try:
            wait_until(lambda: claims_held(source_info) >= 1, 3, 0.002, "the destination's claim")
        except AssertionError:
            continue
        dest.proc.send_signal(signal.SIGSTOP)
        if claims_held(source_info) >= 1:
            dest.proc.send_signal(signal.SIGKILL)
            dest.proc.wait(5)
            return
        dest.proc.send_signal(signal.SIGCONT)  # it finished first: try again
        no_claims_left(source_info)
    pytest.fail(f"no pull was caught holding its claim in {attempts} attempts")


def _pull_until_killed(dest_info, source_info, keys) -> None:
    try:
        pull(dest_info, source_info, keys, timeout_s=10)
    except (ControlError, TimeoutError, OSError):
        pass  # killed mid-request


@pytest.mark.parametrize("transfer", ["get", "tag", "shm"])
def test_a_destination_killed_mid_pull_leaves_no_claim_past_its_lease_and_its_source_serving(runner_factory, puller,
                                                                                            transfer):
    a, ai = source(runner_factory, **{"dram.size": "160Mi", "runner.lease_seconds": 2.0})
    keys, _, data = store(ai, 1024, seed=23)
    b = runner_factory("b", **{"dram.pools": POOLS, "dram.size": "160Mi", "runner.peers": ["*"],
                               "runner.transfer": transfer})
    bi = b.start()
    wait_registered(bi)
    kill_while_its_claim_is_held(b, bi, ai, keys)
    wait_until(lambda: claims_held(ai) == 0, 2.0 + 3, 0.05, "the dead destination's claim ended by its lease")
    raw, dests = buffers(1024)
    assert puller.pull(ai["endpoints"]["control"], "kv", keys, dests).delivered == 1024
    assert raw.raw[:1024 * PAGE] == b"".join(data)
    no_claims_left(ai)


@pytest.mark.parametrize("transfer", ["get", "tag", "shm", "auto"])
def test_both_transfers_deliver_the_same_bytes_scattered_over_the_destination(runner_factory, puller, transfer):
    a, ai = source(runner_factory)
    keys, _, data = store(ai, 16, seed=15)
    puller.transport = transfer
    raw, dests = buffers(32)
    scattered = dests[::2]  # every other page: nothing to coalesce on our side
    result = puller.pull(ai["endpoints"]["control"], "kv", keys, scattered)
    assert result.delivered == 16 and not result.uncertain
    assert [raw.raw[d - ctypes.addressof(raw):d - ctypes.addressof(raw) + PAGE] for d in scattered] == data
    no_claims_left(ai)


def test_a_large_same_host_pull_split_over_copy_threads_lands_every_page(runner_factory, puller):
    from kvcr.drivers.memcopy import PARALLEL_MIN_BYTES
    from kvcr.drivers.puller import Puller

    a, ai = source(runner_factory)
    n = PARALLEL_MIN_BYTES // PAGE + 9  # past the threshold, and not a multiple of the thread count
    keys, _, data = store(ai, n, seed=22)
    threaded = Puller(puller.plane, timeout_s=2.0, abandon_s=1.0, transport="shm", copy_threads=3)
    try:
        raw, dests = buffers(2 * n)
        scattered = dests[::-1][::2]  # reversed and sparse: no two neighbours coalesce
        assert threaded.pull(ai["endpoints"]["control"], "kv", keys, scattered).delivered == n
        assert [raw.raw[d - ctypes.addressof(raw):d - ctypes.addressof(raw) + PAGE] for d in scattered] == data
    finally:
        threaded.close()
    no_claims_left(ai)


@pytest.mark.parametrize("transfer", ["get", "shm"])
def test_back_to_back_pulls_find_the_previous_claim_released(runner_factory, puller, transfer):
    # One claim per peer at the source: a claim that overtook the release before it would be refused.
    a, ai = source(runner_factory, **{"runner.max_claims_per_peer": 1})
    keys, _, data = store(ai, 4, seed=23)
    puller.transport = transfer
    raw, dests = buffers(4)
    for _ in range(20):
        assert puller.pull(ai["endpoints"]["control"], "kv", keys, dests).delivered == 4
    assert raw.raw[:4 * PAGE] == b"".join(data)
    no_claims_left(ai)


def test_a_release_queued_when_the_source_is_forgotten_still_goes_out(runner_factory, puller):
    from kvcr.drivers.puller import Puller

    a, ai = source(runner_factory)
    keys, _, _ = store(ai, 2, seed=24)
    endpoint = ai["endpoints"]["control"]
    long_lease = Puller(puller.plane, timeout_s=2.0, abandon_s=1.0, lease_s=30.0, inline_max=0)
    try:
        conf = long_lease.confirm(endpoint, "kv", keys)
        gate = threading.Event()
        long_lease._sender.submit(gate.wait, 10)  # the sender is busy: the release stays queued...
        long_lease.release(conf, wait=False)
        long_lease.forget(endpoint)  # ...and forgetting the source must send it, not drop it
        gate.set()
        no_claims_left(ai)  # well before the 30 s lease could end the claim
    finally:
        long_lease.close()


def test_the_tagged_fallback_sends_nothing_outside_the_claim(runner_factory, puller):
    a, ai = source(runner_factory)
    keys, _, _ = store(ai, 4, seed=16)
    conf = puller.confirm(ai["endpoints"]["control"], "kv", keys[:2])
    with conf.source.lock, pytest.raises(ControlError, match="outside claim"):
        conf.source.client.request(m.SendPages(claim_id=conf.claim_id, address=puller.plane.pull_address.hex(),
                                               ops=[[conf.offsets[1] + PAGE * 8, PAGE, 1]]))
    puller.release(conf)


def test_a_source_whose_pages_are_another_size_is_refused(runner_factory, puller):
    a, ai = source(runner_factory)
    keys, _, _ = store(ai, 2, seed=17)
    puller.page_bytes = {"kv": PAGE * 2}  # we would overrun our buffers with its pages
    assert puller.confirm(ai["endpoints"]["control"], "kv", keys) is None
    no_claims_left(ai)


def metric_value(info, name: str) -> float:
    text = urllib.request.urlopen(info["endpoints"]["http"] + "/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_claim_granted_after_the_puller_gave_up_is_released_at_once(runner_factory):
    # A stalled source (SIGSTOP) answers the claim after our 1 s wait: the grant must go straight
    # back, not hold its pages for the source's 60 s lease.
    a, ai, b, bi = start_pair(runner_factory, a_overrides={"runner.lease_seconds": 60.0},
                              b_overrides={"runner.control_timeout_s": 1.0})
    wait_registered(ai)
    keys, _, _ = store(ai, 8, seed=7)
    warm, _, _ = store(ai, 2, seed=17)
    assert pull(bi, ai, warm) == 2  # B knows A: what stalls below is the claim itself
    stop(a.proc)
    try:
        assert pull(bi, ai, keys) == 0  # a miss, after one control timeout
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert metric_value(bi, "kvcr_peer_unreachable_total") == 1
    # the claim was granted (its pages counted as hits at A), then given back long before its lease
    wait_until(lambda: metric_value(ai, "kvcr_hits_total") >= 2 + 8 and claims_held(ai) == 0, 20, 0.1,
               "the late grant released")


@pytest.mark.parametrize("requests", [2, 3])
def test_an_unreachable_source_is_asked_once_then_skipped(runner_factory, requests):
    b = runner_factory("b", **{"dram.pools": POOLS, "runner.peers": ["*"], "runner.control_timeout_s": 0.5,
                               "runner.unreachable_backoff_s": 120.0})
    bi = b.start()
    dead = {"endpoints": {"control": "tcp://127.0.0.1:9"}}  # discard port: nothing answers
    keys, _, _ = pages_for(4, seed=8, page_bytes=PAGE)
    for _ in range(requests):
        assert pull(bi, dead, keys) == 0
    assert metric_value(bi, "kvcr_peer_unreachable_total") == 1
    assert metric_value(bi, "kvcr_peer_skipped_unreachable_total") == requests - 1


# --- the same-host control socket ----------------------------------------------------------------

def test_a_same_host_source_is_asked_over_its_unix_socket(runner_factory, puller):
    a, ai = source(runner_factory)
    keys, _, data = store(ai, 8, seed=30)
    puller.transport = "shm"
    before = metric_value(ai, "kvcr_control_local_requests_total")
    raw, dests = buffers(8)
    for _ in range(3):
        assert puller.pull(ai["endpoints"]["control"], "kv", keys, dests).delivered == 8
    assert raw.raw[:8 * PAGE] == b"".join(data)
    no_claims_left(ai)  # the releases came on the connection that holds the claims
    assert metric_value(ai, "kvcr_control_local_requests_total") - before >= 6  # 3 claims and 3 releases


def test_a_keyless_source_is_not_pulled_from_over_tcp(runner_factory, puller):
    a, ai = source(runner_factory)
    keys, _, _ = store(ai, 4, seed=30)
    puller.local_control = False  # its TCP info holds no region addresses, and claims there are refused
    before = metric_value(ai, "kvcr_control_local_requests_total")
    with pytest.raises(PeerError, match="has no keys"):
        puller.confirm(ai["endpoints"]["control"], "kv", keys)
    assert metric_value(ai, "kvcr_control_local_requests_total") == before
    no_claims_left(ai)


def test_a_keyless_puller_trusts_a_source_answering_over_tcp_only_by_name(runner_factory, puller):
    # Any local user can run a keyless source that answers over TCP (runner.insecure): its bytes
    # would be stored under our keys. Without keys only the same-host socket (its user checked) vouches.
    a, ai = source(runner_factory, **{"runner.insecure": True})
    keys, _, data = store(ai, 4, seed=34)
    endpoint = ai["endpoints"]["control"]
    puller.local_control = False
    with pytest.raises(PeerError, match="trusted only over its same-host socket"):
        puller.confirm(endpoint, "kv", keys)
    puller.trusted = frozenset({endpoint})
    raw, dests = buffers(4)
    assert puller.pull(endpoint, "kv", keys, dests).delivered == 4 and raw.raw[:4 * PAGE] == b"".join(data)
    no_claims_left(ai)


def test_a_tcp_answer_naming_our_own_same_host_socket_cannot_supply_the_region_we_read(runner_factory, puller,
                                                                                     tmp_path):
    # A fake keyless source: its first answer names no same-host socket (we stay on TCP), its
    # second names a real runner's socket with another region. What we read must come from the
    # socket that vouches for its owner, never from that TCP answer.
    import zmq

    a, ai = source(runner_factory)
    keys, _, data = store(ai, 4, seed=35)
    with ControlClient(ai["endpoints"]["control"]) as client:
        real = client.info()
    theirs = tmp_path / "their-pool"  # a file of theirs we can read, as a pool would be
    theirs.write_bytes(b"\xee" * (1 << 20))
    forged = {**real, "shm_path": str(theirs), "ucx": {**real["ucx"], "region_base": 4096}}
    answers = [{**real, "endpoints": {**real["endpoints"], "local_control": ""}}, forged]
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    fake = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"

    def serve():
        for answer in answers:
            if not sock.poll(10_000):
                return
            ident, *_, payload = sock.recv_multipart()
            sock.send_multipart([ident, b"", m.encode(m.Info(info=answer), request_id=m.decode(payload).request_id)])
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        src = puller.source(fake)
        assert src.client.is_local and src.region_base == real["ucx"]["region_base"] and src.shm_path == real["shm_path"]
        raw, dests = buffers(4)
        assert puller.pull(fake, "kv", keys, dests).delivered == 4 and raw.raw[:4 * PAGE] == b"".join(data)
    finally:
        server.join(10)
        sock.close()


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "little") + payload


def _local_socket(info):
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(info["endpoints"]["local_control"])
    return sock


def test_a_bad_frame_on_the_unix_socket_is_answered_or_drops_that_connection_only(runner_factory, puller):
    a, ai = source(runner_factory)
    keys, _, data = store(ai, 4, seed=31)
    garbage = _local_socket(ai)
    garbage.sendall(_frame(b"\xc1 not msgpack"))
    reply = m.decode(garbage.recv(1 << 16)[4:])
    assert isinstance(reply, m.Error) and "not msgpack" in reply.message
    oversized = _local_socket(ai)
    oversized.sendall((1 << 31).to_bytes(4, "little"))
    assert oversized.recv(16) == b""  # closed: no message is that long
    puller.transport = "shm"
    raw, dests = buffers(4)
    assert puller.pull(ai["endpoints"]["control"], "kv", keys, dests).delivered == 4
    assert raw.raw[:4 * PAGE] == b"".join(data)
    garbage.close()
    oversized.close()


NOBODY = 65534

_AS_ANOTHER_USER = """
import os, socket, sys
os.setgid({uid}); os.setuid({uid})
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(5)
try:
    sock.connect(sys.argv[1])
except PermissionError:
    print("refused by the file mode"); sys.exit(0)
try:
    sock.sendall(sys.stdin.buffer.read())
    print("closed" if sock.recv(1 << 16) == b"" else "answered")
except (ConnectionResetError, BrokenPipeError):  # closed before, or with, our request unread
    print("closed")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_users_process_gets_nothing_from_the_unix_socket(runner_factory):
    a, ai = source(runner_factory)
    path = ai["endpoints"]["local_control"]
    lookup = _frame(m.encode(m.Lookup(pool="kv", keys=["00" * 32])))
    script = _AS_ANOTHER_USER.format(uid=NOBODY)

    def as_nobody() -> str:
        out = subprocess.run([sys.executable, "-c", script, path], input=lookup, capture_output=True, timeout=30)
        assert out.returncode == 0, out.stderr.decode()
        return out.stdout.decode().strip()
    assert as_nobody() == "refused by the file mode"
    os.chmod(path, 0o666)  # past the file mode, its credentials are checked as it is accepted
    assert as_nobody() == "closed"
    assert metric_value(ai, "kvcr_control_local_refused_total") == 1


def test_a_source_killed_after_its_unix_socket_served_us_costs_one_miss_not_a_wedge(runner_factory, puller):
    from kvcr.drivers.puller import Puller
    from kvcr.proto.reach import Reachability

    a, ai = source(runner_factory)
    keys, _, _ = store(ai, 4, seed=32)
    quick = Puller(puller.plane, timeout_s=2.0, abandon_s=1.0, transport="shm", reach=Reachability(0.1))
    try:
        raw, dests = buffers(4)
        assert quick.pull(ai["endpoints"]["control"], "kv", keys, dests).delivered == 4
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        assert quick.confirm(ai["endpoints"]["control"], "kv", keys) is None
        assert quick.reach.num_failures == 1
        # A restart on the same endpoint, with another socket: asked afresh once the backoff is over.
        b = runner_factory("a2", **{"dram.pools": POOLS, "runner.control_endpoint": ai["endpoints"]["control"]})
        bi = b.start()
        wait_registered(bi)
        keys2, _, data2 = store(bi, 4, seed=33)
        assert quick.pull(bi["endpoints"]["control"], "kv", keys2, dests).delivered == 4
        assert raw.raw[:4 * PAGE] == b"".join(data2)
        assert bi["endpoints"]["local_control"] != ai["endpoints"]["local_control"]
        no_claims_left(bi)
    finally:
        quick.close()


# --- small claims answered with their bytes ------------------------------------------------------

@pytest.fixture
def inline_puller(puller):
    """The fixture's puller, but asking for the bytes of claims of up to 4 pages in the answer."""
    from kvcr.drivers.puller import Puller

    p = Puller(puller.plane, timeout_s=2.0, abandon_s=1.0, lease_s=0.5, inline_max=4 * PAGE)
    yield p
    p.close()


@pytest.mark.parametrize("digests", [False, True], ids=["plain", "digests"])
def test_a_small_claim_comes_back_with_its_bytes_and_leaves_no_claim_at_the_source(runner_factory, inline_puller,
                                                                                 digests):
    a, ai = source(runner_factory, **{"runner.verify_transfer_bytes": digests, "runner.inline_pull_bytes": 4 * PAGE})
    endpoint = ai["endpoints"]["control"]
    keys, _, data = store(ai, 6, seed=31)
    inline_puller.verify_transfer_bytes = digests
    conf = inline_puller.confirm(endpoint, "kv", keys[:4])
    assert conf.num_pages == 4 and conf.released
    assert claims_held(ai) == 0  # ended as it was answered, before a byte was copied here
    raw, dests = buffers(4)
    assert inline_puller.deliver(conf, dests).delivered == 4
    assert raw.raw[:4 * PAGE] == b"".join(data[:4])
    assert inline_puller.num_digest_mismatches == 0 and inline_puller.num_inline_pages == 4
    # Over the limit: a claim held at the source, GETs, a release.
    conf = inline_puller.confirm(endpoint, "kv", keys)
    assert not conf.released and claims_held(ai) == 1
    raw, dests = buffers(6)
    assert inline_puller.deliver(conf, dests).delivered == 6
    assert raw.raw[:6 * PAGE] == b"".join(data)
    assert inline_puller.num_inline_pages == 4
    no_claims_left(ai)


def test_a_source_answers_with_bytes_only_up_to_its_own_limit(runner_factory, inline_puller):
    a, ai = source(runner_factory, **{"runner.inline_pull_bytes": PAGE})
    keys, _, data = store(ai, 2, seed=32)
    conf = inline_puller.confirm(ai["endpoints"]["control"], "kv", keys)  # 2 pages: over the source's limit
    assert not conf.released and claims_held(ai) == 1
    raw, dests = buffers(2)
    assert inline_puller.deliver(conf, dests).delivered == 2 and raw.raw[:2 * PAGE] == b"".join(data)
    no_claims_left(ai)


def test_an_uncollected_inline_claim_is_dropped_here_with_nothing_sent(runner_factory, inline_puller):
    a, ai = source(runner_factory)  # two pages: within its default limit
    keys, _, _ = store(ai, 2, seed=33)
    conf = inline_puller.confirm(ai["endpoints"]["control"], "kv", keys)
    assert conf.released
    before = control_requests(ai)
    inline_puller.release(conf)  # the lease ran out, the prefetch ended: the bytes are dropped here
    assert control_requests(ai) == before  # no release went out: the source ended the claim itself
    assert claims_held(ai) == 0


def control_requests(info) -> float:
    text = urllib.request.urlopen(info["endpoints"]["http"] + "/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvcr_control_requests_total "))


def test_a_negative_inline_limit_is_refused_by_name(runner_factory, inline_puller):
    a, ai = source(runner_factory)
    keys, _, _ = store(ai, 1, seed=34)
    src = inline_puller.source(ai["endpoints"]["control"])
    with src.socket() as client, pytest.raises(ControlError, match="inline_max -1 must be >= 0"):
        client.request(m.ClaimRequest(pool="kv", keys=keys, inline_max=-1))
    assert claims_held(ai) == 0
