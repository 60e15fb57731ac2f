"""Time to first token on live SGLang 0.5.23 engines with kvcr's backend: recompute, a local kvcr
hit, a peer pull (same-host copy and UCX over TCP), and SGLang's own `file` backend, same run.

    .venv/bin/python bench/sglang_live.py [--tokens 2048 8192] [--repeats 3] [--quick] [--no-write]

The bench model has Llama-3-8B's KV bytes per token (32 layers x 8 KV heads x 128 dims, bf16:
128 KiB) behind a 256-wide residual stream, so transfers are full size while a CPU can prefill it.
Engines run through the development-only CPU harness (sglang_adapter.cpu_harness); each request
asks for one token, so its latency is its time to first token. What a user sees is reported:
`cached_tokens` by source and TTFT; every figure is a median (min-max) over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Spread, machine_line, publish, table  # noqa: E402
from kvcr.drivers.ucx_env import SINGLE_HOST_UCX_ENV  # noqa: E402

PAGE = 16
WAIT = ["--hicache-storage-prefetch-policy", "wait_complete", "--chunked-prefill-size", "4096"]
CASES = ("recompute", "kvcr local hit", "kvcr peer: same-host copy", "kvcr peer: UCX TCP", "SGLang file backend")


def model_figures(shape: dict) -> tuple[int, float]:
    """(KV bytes per token, weight FLOPs per token) of the bench model."""
    h, hd, L = shape["hidden_size"], shape["head_dim"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    kv_bytes = L * kv * 2 * 2
    weights = L * (h * q + 2 * h * kv + q * h + 3 * h * shape["intermediate_size"])
    return kv_bytes, 2.0 * weights


def ttft(server, text: str, **extra) -> tuple[float, dict]:
    body = {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **extra}
    t0 = time.perf_counter()
    meta = server.post("/generate", body, timeout_s=1800)["meta_info"]
    return time.perf_counter() - t0, meta


def peer_round(engines: dict, tokens: int, seed: int) -> dict[str, tuple[float, dict]]:
    from kvcr.proto.hints import build_envelope
    from sglang_adapter.cpu_harness.model import prompt_text

    a, text = engines["A"], prompt_text(seed, tokens - 1)  # ~one token a word, plus BOS
    out = {"recompute": ttft(a, text)}
    full = out["recompute"][1]["prompt_tokens"] // PAGE
    while len(a.stored_hashes()) < full:  # backed up behind the request
        time.sleep(0.5)
    a.flush()
    out["kvcr local hit"] = ttft(a, text)
    hint = build_envelope(a.endpoints["control"], a.stored_hashes())
    for case, name in (("kvcr peer: same-host copy", "B-shm"), ("kvcr peer: UCX TCP", "B-tcp")):
        out[case] = ttft(engines[name], text, kv_hints=hint)
    for s in engines.values():
        s.flush()
    return out


def file_round(f, tokens: int, seed: int) -> dict[str, tuple[float, dict]]:
    from sglang_adapter.cpu_harness.model import prompt_text

    text = prompt_text(seed, tokens - 1)
    ttft(f, text)
    time.sleep(1.0)  # SGLang's file backend writes behind; give it time to land
    f.flush()
    out = {"SGLang file backend": ttft(f, text)}
    f.flush()
    return out


def start(run: Path, model: Path, tokens: int, names: tuple[str, ...], file_dir: Path) -> dict:
    """Engines sized for `tokens`: device and host pools, and a kvcr pool a whole prompt can be
    claimed from (claims may pin 90 % of it)."""
    from sglang_adapter.cpu_harness.server import LiveServer

    room = ["--max-total-tokens", str(tokens + 1024), "--context-length", str(tokens + 1024), "--hicache-ratio", "1.5"]
    dram = {"dram.size": f"{(tokens + 1024) * 128 // 1024 + 64}Mi", "dram.max_claim_fraction": 0.9}
    specs = {"A": dict(runner=dram), "B-shm": dict(runner={**dram, "runner.transfer": "shm"}),
             "B-tcp": dict(runner={**dram, "runner.transfer": "get"}, env={"UCX_TLS": "tcp"}),
             "F": dict(backend="file", env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(file_dir)})}
    servers = {n: LiveServer(run, n, model, args=[*WAIT, *room], **specs[n]) for n in names}
    for s in servers.values():
        s.start()
    for s in servers.values():
        s.wait_ready(600)
    return servers


def measure(tmp: Path, model: Path, tokens: int, repeats: int) -> dict[str, list]:
    """Peers first (A and two B engines), then SGLang's file backend alone: at most three engines."""
    got: dict[str, list] = {c: [] for c in CASES}
    for names, round_ in ((("A", "B-shm", "B-tcp"), peer_round), (("F",), file_round)):
        engines = start(tmp, model, tokens, names, tmp / f"file-{tokens}")
        try:
            for r in range(repeats):
                print(f"\r  {tokens} tokens, {'/'.join(names)}: repeat {r + 1}/{repeats}", end="", flush=True)
                arg = engines if round_ is peer_round else engines["F"]
                for case, value in round_(arg, tokens, seed=1000 * tokens + r).items():
                    got[case].append(value)
            print()
        finally:
            for s in engines.values():
                s.stop()
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2k tokens, 1 repeat, nothing written")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    sizes, repeats = ([2048], 1) if args.quick else (args.tokens, args.repeats)
    import os
    for k, v in SINGLE_HOST_UCX_ENV.items():
        os.environ.setdefault(k, v)
    from sglang_adapter.cpu_harness.model import KV_LIKE_8B, build_model

    kv_bytes, flops = model_figures(KV_LIKE_8B)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcr-bench-live-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model", shape=KV_LIKE_8B, max_tokens=max(sizes) + 1024)
        for tokens in sizes:
            got = measure(tmp, model, tokens, repeats)
            base = statistics.median(t for t, _ in got["recompute"])
            for case in CASES:
                times = [t for t, _ in got[case]]
                meta = got[case][-1][1]
                details = meta.get("cached_tokens_details") or {}
                source = ", ".join(f"{k} {v}" for k, v in details.items() if isinstance(v, int) and v) or "none"
                rows.append(f"| {tokens} | {case} | {meta['prompt_tokens']} | {meta.get('cached_tokens', 0)} "
                            f"({source}) | {Spread.of(times).fmt(1000, 0)} | "
                            f"{base / statistics.median(times):.1f}x |")
    intro = (f"`bench/sglang_live.py --repeats {repeats}`, {machine_line()}. Live SGLang 0.5.23 engines on CPU "
             f"(sglang_adapter.cpu_harness), torch_native attention, 16-token pages, "
             f"`wait_complete` prefetch. Bench model: {kv_bytes // 1024} KiB of KV per token (Llama-3-8B's), "
             f"{flops / 1e6:.0f} MFLOP per token in its weights (plus attention). TTFT: a one-token "
             "/generate, median (min–max) ms; speed-up against recompute in the same run. Peers: engine A "
             "holds the pages; B engines get a `kv_hints` envelope naming A (same-host copy, or UCX GETs "
             "with `UCX_TLS=tcp`). The file backend is SGLang's HiCacheFile on this machine's disk, "
             "measured after the peer engines stopped (at most three engines at once). On a CPU a hit's "
             "TTFT is mostly the engine's own restore path (host-pool loads through the harness's torch "
             "index copies, attention over the cached prefix), alike for every backend: compare the rows "
             "with one another, not with a GPU (bench/gpu_smoke.sh runs this on one).")
    columns = ["prompt tokens", "served by", "prompt", "cached tokens (source)", "TTFT ms", "vs recompute"]
    print("\n".join(table(columns, rows)))
    publish("sglang_live", "Live SGLang: time to first token by where the prefix comes from", intro,
            [table(columns, rows)], write=not (args.quick or args.no_write))
    return 0


if __name__ == "__main__":
    sys.exit(main())
