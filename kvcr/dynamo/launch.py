"""Starting the Dynamo bridge next to an engine (`kvcr worker --dynamo`, the SGLang launcher).

Dynamo's runtime pins packages of its own, so the bridge runs with Dynamo's Python (an
environment with `ai-dynamo`, and kvcr installed without its dependencies). It dies with the
process that started it, so a crashed engine never leaves a registered Dynamo worker behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..config import ENV_PUBLIC, ENV_SECRET, CurveKeys

PR_SET_PDEATHSIG = 1


class DynamoSetupError(RuntimeError):
    pass


def dynamo_python(explicit: str | None = None) -> str:
    """Dynamo's interpreter: --dynamo-python, then $KVCR_DYNAMO_PYTHON, then the repo's `.venv-dynamo`."""
    root = Path(__file__).resolve().parents[2]
    for candidate in (explicit, os.environ.get("KVCR_DYNAMO_PYTHON"), str(root / ".venv-dynamo" / "bin" / "python")):
        if candidate and (Path(candidate).exists() or shutil.which(candidate)):
            return candidate
    raise DynamoSetupError("no Python with Dynamo found: run `make dynamo-setup`, or pass --dynamo-python "
                           "(an environment with ai-dynamo 1.6.1 and kvcr installed with --no-deps)")


@dataclass(frozen=True, slots=True)
class BridgeOptions:
    backend: str
    model_path: str
    model_name: str
    namespace: str = "kvcr"
    component: str = "backend"
    runner: str | None = None
    dp_rank: int | None = None
    oracle: bool = False
    ready_file: str | None = None
    python: str | None = None

    def argv(self) -> list[str]:
        args = [dynamo_python(self.python), "-m", "kvcr.dynamo.bridge", "--backend", self.backend,
                "--model-path", self.model_path, "--model-name", self.model_name, "--namespace", self.namespace,
                "--component", self.component]
        for flag, value in (("--runner", self.runner), ("--dp-rank", self.dp_rank), ("--ready-file", self.ready_file)):
            if value is not None:
                args += [flag, str(value)]
        return args + (["--oracle"] if self.oracle else [])


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: a forked child must not dlopen


def bridge_file(info_file: str | Path) -> Path:
    """Where `kvcr worker --info-file F --dynamo` has its bridge write the Dynamo worker id."""
    return Path(f"{info_file}.dynamo")


def _die_with(parent: int):
    def preexec() -> None:
        # The death signal follows the forking thread: start the bridge from the main thread.
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)
    return preexec


def keys_env(curve: CurveKeys | None) -> dict | None:
    """The environment a bridge for a runner with keys needs (its events, replay and control speak
    CURVE): ours plus the deployment keypair; None (inherit) without keys."""
    if curve is None:
        return None
    return {**os.environ, ENV_PUBLIC: curve.public.decode(), ENV_SECRET: curve.secret.decode()}


def start_bridge(options: BridgeOptions, *, log_path: str | None = None, env: dict | None = None) -> subprocess.Popen:
    out = open(log_path, "a") if log_path else None
    try:
        return subprocess.Popen(options.argv(), stdout=out, stderr=subprocess.STDOUT if out else None, env=env,
                                preexec_fn=_die_with(os.getpid()))
    finally:
        if out is not None:
            out.close()


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM (a bridge then deregisters from Dynamo), then SIGKILL after `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
