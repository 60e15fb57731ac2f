"""The trust model, surface by surface: what an unauthenticated client gets (nothing that addresses
the region), which exposures a runner refuses to start with, and a page changed behind the
runner's back after its commit, which a pull in security mode never delivers."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import zmq

from kvcr.client import AttachedWriter, ControlClient
from kvcr.config import ConfigError, CurveKeys, check_hint_sources, load_config
from kvcr.proto import messages as m
from tests.helpers import ROOT, wait_until
from tests.pages import pages_for

PAGE = 64 * 1024
POOLS = [{"name": "kv", "page_bytes": PAGE}]
TOKEN = "t0ken-for-the-tests-only"
SECRETS = ("address", "rkeys", "region_base")


@pytest.fixture(scope="module")
def curve_pair():
    public, secret = (k.decode() for k in zmq.curve_keypair())
    return {"runner.curve_public_key": public, "runner.curve_secret_key": secret}, \
        CurveKeys(public.encode(), secret.encode(), frozenset())


def http_get(url: str, token: str = "") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_http_info_and_the_info_file_never_hand_out_what_addresses_the_region(runner_factory):
    a = runner_factory("a", **{"dram.pools": POOLS})
    info = a.start()
    with ControlClient(info["endpoints"]["control"]) as client:  # loopback, no CURVE: a local client
        wait_until(lambda: client.info()["ucx"]["rkeys"], 10, 0.05, "UCX registration")
    status, body = http_get(info["endpoints"]["http"] + "/info")
    served = json.loads(body)
    assert status == 200 and served["ucx"]["registered_bytes"] > 0
    assert not set(SECRETS) & set(served["ucx"]) and not set(SECRETS) & set(info["ucx"])


def test_with_a_token_info_answers_only_its_bearer_and_metrics_stay_open(runner_factory):
    a = runner_factory("a", **{"dram.pools": POOLS, "runner.http_token": TOKEN})
    http = a.start()["endpoints"]["http"]
    for token in ("", "wrong-token-of-some-length"):
        status, body = http_get(http + "/info", token)
        assert status == 401 and b"runner.http_token" in body
    status, body = http_get(http + "/info", TOKEN)
    assert status == 200 and json.loads(body)["name"] == "a"
    assert http_get(http + "/healthz")[0] == 200
    status, body = http_get(http + "/metrics")
    assert status == 200 and b"kvcr_ucx_workers_retired" in body and b"kvcr_http_unauthorized_total 2.0" in body


@pytest.mark.parametrize("keys, problem", [
    ({"runner": {"control_endpoint": "tcp://0.0.0.0:5600"}}, "runner.control_endpoint = 'tcp://0.0.0.0:5600' is reachable"),
    ({"runner": {"control_endpoint": "tcp://worker0:5600"}}, "set runner.curve_public_key"),
    ({"runner": {"http_host": "0.0.0.0"}}, "runner.http_host = '0.0.0.0' is reachable from other hosts"),
    ({"runner": {"http_host": "10.0.0.2", "http_token": "short"}}, "at least 16 characters"),
    ({"runner": {"ucx_interface": "eth0; rm"}}, "runner.ucx_interface = 'eth0; rm' is not a device name"),
])
def test_a_runner_reachable_from_other_hosts_without_keys_is_refused_by_name(tmp_path, keys, problem):
    path = tmp_path / "kvcr.json"
    path.write_text(json.dumps(keys))
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace("[", r"\[")):
        load_config(path)


@pytest.mark.parametrize("keys", [
    {"runner": {"control_endpoint": "tcp://0.0.0.0:5600", "insecure": True, "http_host": "0.0.0.0"}},
    {"runner": {"control_endpoint": "tcp://10.0.0.2:5600", "http_host": "10.0.0.2", "http_token": TOKEN,
                "curve_public_key": "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",
                "curve_secret_key": "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"}},
    {"runner": {"control_endpoint": "ipc:///tmp/kvcr-control", "http_host": "localhost"}},
])
def test_keys_a_token_or_a_named_insecure_switch_let_it_start(tmp_path, keys):
    path = tmp_path / "kvcr.json"
    path.write_text(json.dumps(keys))
    load_config(path)


def _put(info, curve, n, seed):
    keys, ann, data = pages_for(n, seed=seed, page_bytes=PAGE)
    with ControlClient(info["endpoints"]["control"], curve=curve) as client:
        wait_until(lambda: client.info()["ucx"]["rkeys"], 10, 0.05, "UCX registration")
        writer = AttachedWriter(client)
        writer.put("kv", keys, data, ann)
        writer.close()
    return keys, data


def test_a_page_overwritten_after_its_commit_is_never_pulled_by_a_secured_peer(runner_factory, curve_pair):
    """A stray writer changes a committed page before anyone claims it (the same bytes a UCX PUT
    would change: TCP and shared-memory transports ignore the region's read-only registration).
    The source's claim answers with the digest taken at commit, and the secured puller stops the
    run before that page."""
    from kvcr.drivers.shm import Region

    keys_cfg, curve = curve_pair
    a = runner_factory("a", **{"dram.pools": POOLS, **keys_cfg})
    b = runner_factory("b", **{"dram.pools": POOLS, "runner.peers": ["*"], **keys_cfg})
    ai, bi = a.start(), b.start()
    keys, data = _put(ai, curve, 6, seed=21)
    with ControlClient(ai["endpoints"]["control"], curve=curve) as client:
        offsets = client.request(m.ClaimRequest(pool="kv", keys=keys, lease_s=1.0)).offsets
    region = Region.attach(ai["shm_path"])
    view = region.view
    view[offsets[3] + 100:offsets[3] + 108] = b"attacker"  # page 3, after its commit, behind the runner's back
    view.release()
    region.close()
    with ControlClient(bi["endpoints"]["control"], curve=curve, timeout_s=30) as client:
        assert client.request(m.PullRequest(source_endpoint=ai["endpoints"]["control"], pool="kv", keys=keys)).num_local == 3
        writer = AttachedWriter(client)
        try:
            assert writer.get("kv", keys) == data[:3]
        finally:
            writer.close()
    status, body = http_get(bi["endpoints"]["http"] + "/metrics")
    assert b"kvcr_pull_digest_mismatches_total 1.0" in body


def test_the_cli_speaks_curve_with_the_deployment_keys_from_its_environment(runner_factory, curve_pair):
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    keys_cfg, _ = curve_pair
    info = runner_factory("a", **{"dram.pools": POOLS, **keys_cfg}).start()

    def kvcr_info(**env):
        return subprocess.run([sys.executable, "-m", "kvcr.cli", "info", info["endpoints"]["control"], "--timeout", "1"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, **env})

    keyless = kvcr_info()
    assert keyless.returncode == 1 and "no reply" in keyless.stderr
    keyed = kvcr_info(KVCR_CURVE_PUBLIC_KEY=keys_cfg["runner.curve_public_key"],
                      KVCR_CURVE_SECRET_KEY=keys_cfg["runner.curve_secret_key"])
    assert keyed.returncode == 0 and json.loads(keyed.stdout)["name"] == "a"
    broken = kvcr_info(KVCR_CURVE_PUBLIC_KEY="short")
    assert broken.returncode == 1 and "Traceback" not in broken.stderr and "KVCR_CURVE_PUBLIC_KEY must be a 40-character Z85 CURVE key" in broken.stderr


def test_a_key_directory_secures_a_runner_and_its_clients(runner_factory, tmp_path):
    import os
    import stat
    import subprocess
    import sys

    from kvcr import curve_keys as keys
    from tests.helpers import ROOT

    directory = tmp_path / "keys"
    run = lambda *args, **env: subprocess.run([sys.executable, "-m", "kvcr.cli", *args], cwd=ROOT, capture_output=True,
                                              text=True, timeout=60, env={**os.environ, **env})
    assert "wrote curve.public, curve.secret, http.token" in run("keys", "init", str(directory)).stdout
    assert "every key is there already" in run("keys", "init", str(directory)).stdout  # never replaced
    assert stat.S_IMODE((directory / "curve.secret").stat().st_mode) == 0o600
    made = keys.load(directory)
    info = runner_factory("a", **{"dram.pools": POOLS, "runner.keys_dir": str(directory)}).start()
    assert http_get(info["endpoints"]["http"] + "/info")[0] == 401
    assert http_get(info["endpoints"]["http"] + "/info", made.http_token)[0] == 200
    assert run("info", info["endpoints"]["control"], "--timeout", "1").returncode == 1  # no keys: no answer
    for endpoint in (info["endpoints"]["control"], info["endpoints"]["http"]):  # CURVE, and the token
        keyed = run("info", endpoint, "--timeout", "5", KVCR_KEYS_DIR=str(directory))
        assert keyed.returncode == 0 and json.loads(keyed.stdout)["name"] == "a"
    (directory / "http.token").write_text("short\n")
    with pytest.raises(keys.KeysError, match="http.token must hold a token of at least 16 characters"):
        keys.load(directory)


def batches_heard(info: dict, curve: CurveKeys | None, within_s: float) -> int:
    """Batches a subscriber holding `curve` (None: no keys) hears on the runner's PUB socket
    within `within_s` (an idle runner heartbeats every second)."""
    from kvcr.drivers.zmq_subscriber import Delivery, Subscriber

    sub = Subscriber()
    sub.add("a", info["endpoints"]["events"], None, curve)
    deadline, heard = time.monotonic() + within_s, 0
    try:
        while time.monotonic() < deadline and not heard:
            heard += sum(isinstance(item, Delivery) for item in sub.poll(100))
    finally:
        sub.close()
    return heard


@pytest.mark.parametrize("plain", [False, True])
def test_events_and_replay_speak_curve_with_keys_unless_published_plain(runner_factory, curve_pair, plain):
    from kvcr.drivers.zmq_replay import fetch_replay

    keys_cfg, curve = curve_pair
    info = runner_factory("a", **{"dram.pools": POOLS, **keys_cfg, "events.plain": plain}).start()
    assert info["events_curve"] is not plain
    _put(info, curve, 2, seed=5)
    keyed = None if plain else curve
    replay = fetch_replay(zmq.Context.instance(), info["endpoints"]["replay"], 0, 5000, keyed)
    assert replay.complete and any(batch.events for _, batch in replay.batches)
    assert batches_heard(info, keyed, within_s=10) >= 1
    keyless = fetch_replay(zmq.Context.instance(), info["endpoints"]["replay"], 0, 1000)
    assert keyless.complete is plain and bool(keyless.batches) is plain
    assert (batches_heard(info, None, within_s=3) >= 1) is plain


def test_the_router_follows_a_runners_curve_events_only_with_the_deployment_keys(runner_factory, curve_pair):
    from router_hints.core import RouterCore
    from router_hints.discovery import DiscoveryError, from_runner_info

    keys_cfg, curve = curve_pair
    info = runner_factory("a", **{"dram.pools": POOLS, **keys_cfg}).start()
    publisher = from_runner_info("a", info, block_size=info["block_size"])
    with pytest.raises(DiscoveryError, match="events speak CURVE and the router holds no keys"):
        RouterCore(block_size=info["block_size"]).add(publisher)
    core = RouterCore(block_size=info["block_size"], curve=curve)
    core.add(publisher)
    try:
        _put(info, curve, 3, seed=6)
        wait_until(lambda: core.poll(100) >= 0 and core.index.num_blocks() == 3, 10, 0, "the router indexed 3 blocks")
    finally:
        core.close()


def test_a_client_with_a_keypair_of_its_own_is_admitted_until_its_key_file_is_removed(runner_factory, tmp_path):
    import os

    from kvcr import curve_keys as keys
    from tests.helpers import ROOT

    run = lambda *args, **env: subprocess.run([sys.executable, "-m", "kvcr.cli", *map(str, args)], cwd=ROOT,
                                              capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    deployment, mine = tmp_path / "keys", tmp_path / "router-keys"
    assert run("keys", "init", deployment).returncode == 0
    made = run("keys", "client", deployment, "router", mine)
    assert made.returncode == 0 and "clients/router.public" in made.stdout
    again = run("keys", "client", deployment, "router", mine)
    assert again.returncode == 1 and "is never replaced" in again.stderr
    own, shared = keys.load(mine), keys.load(deployment)
    assert own.server_public == shared.curve_public and own.curve_public != shared.curve_public
    info = runner_factory("a", **{"dram.pools": POOLS, "runner.keys_dir": str(deployment)}).start()
    keyed = run("info", info["endpoints"]["control"], "--timeout", "5", KVCR_KEYS_DIR=mine)
    assert keyed.returncode == 0 and json.loads(keyed.stdout)["name"] == "a"
    client = CurveKeys(own.curve_public.encode(), own.curve_secret.encode(), frozenset(), own.server_public.encode())
    assert batches_heard(info, client, within_s=10) >= 1  # events too
    (deployment / "clients" / "router.public").unlink()  # revoked: its next connection is refused
    time.sleep(1.2)
    assert run("info", info["endpoints"]["control"], "--timeout", "1", KVCR_KEYS_DIR=mine).returncode == 1
    path = tmp_path / "runner.json"
    path.write_text(json.dumps({"runner": {"keys_dir": str(mine)}}))
    with pytest.raises(ConfigError, match="is a client's key directory"):
        load_config(path).curve()


@pytest.mark.parametrize("front_host, overrides, refused", [
    ("0.0.0.0", {"runner.peers": ["*"]}, True),
    ("10.0.0.2", {"runner.peers": ["*"]}, True),
    ("127.0.0.1", {"runner.peers": ["*"]}, False),
    ("0.0.0.0", {"runner.peers": ["tcp://10.0.0.3:5600"]}, False),
    ("0.0.0.0", {"runner.peers": ["*"], "runner.insecure": True}, False),
])
def test_a_front_open_to_other_hosts_may_not_take_hints_naming_any_source_without_keys(front_host, overrides,
                                                                                        refused):
    cfg = load_config(None, overrides)
    if refused:
        with pytest.raises(ConfigError, match=f"listens on '{front_host}'.*runner.peers = \"\\*\""):
            check_hint_sources(cfg, front_host)
    else:
        check_hint_sources(cfg, front_host)


def test_with_keys_any_hinted_source_must_hold_the_deployment_keys(curve_pair):
    check_hint_sources(load_config(None, {"runner.peers": ["*"], **curve_pair[0]}), "0.0.0.0")


def test_a_worker_open_to_other_hosts_without_keys_refuses_to_start(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvcr.cli", "worker", "--host", "0.0.0.0", "--port", "0",
                           "--set", f"runner.state_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "runner.peers = \"*\" pulls from whatever source" in proc.stderr


# --- a runner started with no security settings at all, on one host -----------------------------

NOBODY = 65534
_KEYLESS_ATTACK = """
import json, os, sys
from kvcr.client import ControlClient, ControlError
from kvcr.proto import messages as m
endpoint, uid, key, local = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
if uid:  # everything is imported: only the sockets below are opened as that user
    os.setgid(uid); os.setuid(uid)
requests = {"claim": m.ClaimRequest(pool="kv", keys=[key]),
            "reserve": m.Reserve(pool="kv", keys=[key], writer_pid=os.getpid()),
            "send_pages": m.SendPages(claim_id=1, address="00", ops=[[0, 4096, 0]]),
            "remove": m.Remove(pool="kv", keys=[key])}
out = {}
with ControlClient(endpoint, timeout_s=5, local=local) as client:
    info = client.info()
    out["over_unix_socket"] = client.is_local
    out["ucx"] = sorted(info["ucx"])
    for name, msg in requests.items():
        try:
            out[name] = ("answered", repr(client.request(msg)))
        except ControlError as exc:
            out[name] = (exc.code, str(exc))
print(json.dumps(out))
"""


@pytest.mark.parametrize("attacker", ["same user over TCP", "another user"])
def test_a_keyless_runners_tcp_socket_hands_nothing_that_reads_or_writes_its_pages(runner_factory, attacker):
    from tests.peers import pull, read, start_pair, store, wait_registered

    if attacker == "another user" and os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    a, ai, b, bi = start_pair(runner_factory)  # no keys, no insecure: the defaults
    wait_registered(ai)
    keys, _, data = store(ai, 4, seed=50)
    # The same user's raw TCP client; another user tries the same-host socket first (refused by its mode).
    uid, local = (0, "0") if attacker == "same user over TCP" else (NOBODY, "1")
    out = subprocess.run([sys.executable, "-c", _KEYLESS_ATTACK, ai["endpoints"]["control"], str(uid), keys[0], local],
                         capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["over_unix_socket"] is False
    assert not set(SECRETS) & set(got["ucx"])  # no worker address, region base or rkeys: no GET, no PUT
    for name in ("claim", "reserve", "send_pages", "remove"):
        code, message = got[name]
        assert code == "unauthenticated" and "runner.keys_dir" in message, (name, got[name])
    # The legitimate readers, over the same-host socket: this process's attached reader, and a peer runner.
    assert read(ai, keys) == data
    assert pull(bi, ai, keys) == 4 and read(bi, keys) == data
    status, body = http_get(ai["endpoints"]["http"] + "/metrics")
    assert b"kvcr_control_unauthenticated_refused_total 4.0" in body


def test_a_keyless_runner_named_insecure_serves_region_requests_over_tcp(runner_factory):
    a = runner_factory("a", **{"dram.pools": POOLS, "runner.insecure": True})
    info = a.start()
    with ControlClient(info["endpoints"]["control"], local=False) as client:
        wait_until(lambda: client.info()["ucx"].get("rkeys"), 10, 0.05, "UCX registration")
        assert client.request(m.ClaimRequest(pool="kv", keys=["00" * 32])).offsets == []
