import os
import signal
import socket
import subprocess

import pytest

from kvcr.drivers.ucx_env import SINGLE_HOST_UCX_ENV
from tests.helpers import RunnerProcess

# UCX on one host, as ucx-notes recommend for tests (set before any child process starts).
for _k, _v in SINGLE_HOST_UCX_ENV.items():
    os.environ.setdefault(_k, _v)

try:  # SGLang's pools and controller import torchvision; its wheels need CUDA: stub it first
    from sglang_adapter.torchvision_stub import install as _install_torchvision_stub

    _install_torchvision_stub()
except ImportError:  # no transformers: the SGLang tests cannot run in this environment anyway
    pass


@pytest.fixture
def runner_factory(tmp_path):
    started: list[RunnerProcess] = []

    def make(name: str = "r0", **overrides) -> RunnerProcess:
        proc = RunnerProcess(tmp_path, name, overrides)
        started.append(proc)
        return proc

    yield make
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop(signal.SIGTERM, timeout_s=10)  # killed if it does not stop in time


@pytest.fixture
def puller():
    """A puller in this process with the shipped back-off and probes, its own UCX worker. It asks
    for no bytes inline, so its tests' small pulls take the claim, GET, release path."""
    from kvcr.drivers.puller import Puller
    from kvcr.drivers.ucx_plane import UcxPlane

    plane = UcxPlane()
    p = Puller(plane, timeout_s=2.0, abandon_s=1.0, lease_s=0.5, inline_max=0)
    yield p
    p.close()
    plane.close()


@pytest.fixture(params=[False, True], ids=["idle", "cpu_hog"])
def cpu_hog(request):
    """Both cores kept busy by other processes for the whole test (or not): what a loaded host
    does to the timings a behaviour rests on."""
    import subprocess
    import sys

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if request.param else 0)]
    yield request.param
    for hog in hogs:
        hog.kill()
        hog.wait()


def _owner_alive(name: str) -> bool:
    parts = name.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(autouse=True)
def _pure_tests_stay_in_memory(request, monkeypatch):
    """A test marked `pure` (`make test-pure`) checks decisions alone: starting a process or
    opening a socket fails it, so the quick loop stays quick and needs nothing running."""
    if request.node.get_closest_marker("pure") is None:
        return

    def refused(what: str):
        def refuse(*args, **kwargs):
            raise AssertionError(f"a test marked pure {what}: it belongs outside the pure set")
        return refuse

    monkeypatch.setattr(subprocess.Popen, "__init__", refused("started a process"))
    monkeypatch.setattr(socket.socket, "__init__", refused("opened a socket"))


@pytest.fixture(autouse=True)
def _no_stray_shm():
    """A region whose owner is gone but whose file remains was leaked (a live owner's is in use,
    perhaps by another suite on this host)."""
    before = set(os.listdir("/dev/shm"))
    yield
    leaked = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("kvcr-") and not _owner_alive(n)}
    assert not leaked, f"shared-memory regions left behind: {leaked}"


@pytest.fixture(scope="session")
def indexer(tmp_path_factory):
    """One Dynamo indexer for the whole session; each test registers its own model name."""
    from tests.dynamo import start_indexer
    yield from start_indexer(tmp_path_factory)


@pytest.fixture
def backends():
    """KVCRStorage backends on real SGLang host pools, closed after the test."""
    from tests.sglang_pools import make_backend

    made = []

    def make(pool, mla: bool = False, **extra):
        made.append(make_backend(pool, mla, **extra))
        return made[-1]

    yield make
    for b in made:
        b.close()


@pytest.fixture(params=["native", "python"])
def hash_and_index_loops(request, monkeypatch):
    """Run a test on kvcr's C token hash and index loops, then on their Python references (what a
    host without a compiler runs); the native run is skipped where they were not built."""
    from kvcr.proto import tokenhash
    from router_hints import index

    if request.param == "native":
        if tokenhash._native is None or index._count_stored is index._count_stored_py:
            pytest.skip("the C helpers were not built on this host (no compiler or no xxhash header)")
    else:
        monkeypatch.setattr(tokenhash, "_native", None)
        monkeypatch.setattr(index, "_count_stored", index._count_stored_py)
        monkeypatch.setattr(index, "_count_removed", index._count_removed_py)
    return request.param


@pytest.fixture
def etcd(tmp_path):
    """A real etcd (Debian's etcd-server) on loopback ports, stopped after the test."""
    from kvcr.dynamo.local import Etcd

    server = Etcd(tmp_path)
    try:
        yield server
    finally:
        server.stop()
