"""`kvcr demo --router dynamo`: the same workers and workload behind Dynamo's unmodified frontend.

Dynamo's KV router decides from the runners' events, attaches its own `kv_hint`s, and pins the
demo's pinned turns through `nvext.backend_instance_id`; each worker runs `--dynamo` (its bridge
registers it with file discovery under the demo's temp directory)."""

from __future__ import annotations

from ..dynamo.local import Frontend, await_registration, dynamo_env, file_discovery, poll
from .base import Demo, _say
from .procs import Child, worker_command


class DynamoDemo(Demo):
    router_kind = "dynamo"

    frontend: Frontend | None = None

    def start(self) -> None:
        a, logs = self.args, self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.env = dynamo_env(file_discovery(self.tmp / "discovery"), self.env)
        _say("[1/4] starting Dynamo's frontend (python -m dynamo.frontend --router-mode kv, file discovery)")
        self.frontend = Frontend(logs, self.env, block_size=a.page_size).start()
        _say(f"      frontend {self.frontend.url}  (/metrics, /v1/models)")
        _say(f"[2/4] starting {a.workers} workers with --dynamo (torch model {a.layers}x{a.hidden}, runner with DRAM "
             f"{a.dram} + NVMe in {self.tmp}, each registered through its bridge)")
        for i in range(a.workers):
            name, base = f"w{i}", self.tmp / f"w{i}"
            args = [*worker_command(name, base, page_size=a.page_size, layers=a.layers, hidden=a.hidden, seed=a.seed,
                                    dram=a.dram, transport=a.transport), "--dynamo", "--dynamo-oracle"]
            self.children.append(Child(logs, name, args, self.env))
            self.workers.append(self.children[-1])
            self.children[-1].start()
        self.dynamo_ids = {}
        for w in self.workers:
            w.wait_ready()
            self.dynamo_ids[w.name] = await_registration(w)
            ep = w.info["kvcr_runner"]["endpoints"]
            _say(f"      {w.name} {w.url}  Dynamo worker {self.dynamo_ids[w.name]}  runner control {ep['control']}")
        self.model = self.workers[0].info["model"]
        poll(lambda: self.model in self.frontend.models(), 60, "the model served by Dynamo")

    def router_url(self) -> str:
        return self.frontend.url

    def driver_args(self) -> list[str]:
        workers = ",".join(f"{w.name}={w.url}={self.dynamo_ids[w.name]}" for w in self.workers)
        return ["--dynamo-workers", workers, "--model", self.model]

    def hold_text(self) -> str:
        return (f"  curl -s {self.frontend.url}/v1/models\n"
                f"  curl -s {self.frontend.url}/metrics | grep dynamo_component_kv_cache_events_applied")

    def stop(self) -> None:
        super().stop()
        if self.frontend is not None:
            self.frontend.stop()
