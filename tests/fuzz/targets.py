"""Every decoder of outside input as a bytes-in fuzz target, shared by the atheris campaigns
(`make fuzz`, tests/fuzz/campaign.py) and the suite, which replays their corpora
(tests/test_fuzz_corpus.py). A target answers a value or its decoder's own error with a message;
anything else is a finding."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack

CORPUS = Path(__file__).resolve().parent / "corpus"


class Finding(AssertionError):
    """A decoder answered outside its contract (a refusal without a message, say)."""


class NeverRefuses(Exception):
    """The refusal of a decoder that takes every input (it counts what it skips)."""


@dataclass(frozen=True)
class Target:
    name: str
    decode: Callable[[bytes], Any]
    refusal: type[BaseException]   # the decoder's own error: a clean rejection
    seeds: Callable[[], list[bytes]]

    def run(self, data: bytes) -> None:
        try:
            self.decode(data)
        except self.refusal as exc:
            if not str(exc).strip():
                raise Finding(f"{self.name}: {type(exc).__name__} without a message") from exc


def _structure(data: bytes) -> Any:
    """The fuzzer's bytes as a JSON or msgpack value (what a client or a peer can send), else text."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        pass
    try:
        return msgpack.unpackb(data, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError):  # TypeError: a map as a key
        return data.decode("utf-8", "replace")


def _frames(data: bytes) -> list[bytes]:
    return data.split(b"\x00\xff", 3)  # up to 4 frames, as a subscriber receives them


# --- the decoders --------------------------------------------------------------------------------

def _events(data: bytes) -> Any:
    from kvcr.proto.events import decode_batch
    return decode_batch(data)


def _event_frames(data: bytes) -> Any:
    from kvcr.proto.events import decode_frames
    return decode_frames(_frames(data))


def _control(data: bytes) -> Any:
    from kvcr.proto.messages import decode
    return decode(data)


def _hints(data: bytes) -> Any:
    from kvcr.proto.hints import parse_envelope
    return parse_envelope(_structure(data))


def _runner_config(data: bytes) -> Any:
    from kvcr.config import Config, _decode
    return _decode(Config, "", _structure(data))


def _config_file(data: bytes) -> Any:
    from kvcr.config import load_config
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kvcr.json"
        path.write_bytes(data)
        return load_config(path)


def _router_config(data: bytes) -> Any:
    from router_hints.http.config import parse_router_config
    raw = _structure(data)
    if not isinstance(raw, dict):
        raw = {"router": raw}
    return parse_router_config(raw)


_TOKENIZER = None


def _request_body(data: bytes) -> Any:
    """A `kvcr worker`'s request body (the router's goes through the same request_tokens): the
    first byte picks the route."""
    from kvcr.text import TextTokenizer
    from kvcr.worker.server import parse_job
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = TextTokenizer(None)
    route = ("generate", "completions", "chat")[data[0] % 3] if data else "generate"
    return parse_job(_structure(data[1:]), route, _TOKENIZER, max_positions=4096)


def _manifest(data: bytes) -> Any:
    from kvcr.drivers.nvme_manifest import parse_manifest
    records, _ = parse_manifest(data)
    return records


# --- seeds: one valid input or more per target ---------------------------------------------------

def _event_seeds() -> list[bytes]:
    from kvcr.proto.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
    batch = EventBatch(ts=1.5, events=(BlockStored(block_hashes=(1, 2), parent_block_hash=None,
                                                   token_ids=tuple(range(32)), block_size=16),
                                       BlockRemoved(block_hashes=(2,)), AllBlocksCleared()), dp_rank=0)
    return [batch.encode()]


def _frame_seeds() -> list[bytes]:
    return [b"kv@w0\x00\xff" + (7).to_bytes(8, "big") + b"\x00\xff" + _event_seeds()[0]]


def _control_seeds() -> list[bytes]:
    from kvcr.proto import messages as m
    return [m.encode(m.Lookup(pool="kv", keys=["ab" * 32])),
            m.encode(m.ClaimRequest(pool="kv", keys=["cd" * 32], lease_s=2.0, digests=True))]


def _hint_seeds() -> list[bytes]:
    from kvcr.proto.hints import build_envelope
    return [json.dumps(build_envelope("tcp://10.0.0.2:5600", [1, 2, 3])).encode()]


def _config_seeds() -> list[bytes]:
    return [json.dumps({"runner": {"name": "w0", "lease_seconds": 5.0}, "dram": {"size": "64Mi"},
                        "nvme": {"storage_dir": "/tmp/kvcr-nvme", "write_policy": "spill"}}).encode()]


def _router_seeds() -> list[bytes]:
    return [json.dumps({"router": {"port": 0, "block_size": 16},
                        "workers": [{"name": "w0", "url": "http://127.0.0.1:8000"}]}).encode()]


def _body_seeds() -> list[bytes]:
    return [b"\x00" + json.dumps({"text": "hello there"}).encode(),
            b"\x02" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
            b"\x00" + json.dumps({"input_ids": [1, 2, 3]}).encode()]


def _manifest_seeds() -> list[bytes]:
    from kvcr.drivers.nvme_manifest import _RECORD
    records = [["put", "ab" * 32 + "_m_1_2.bin", 8192, 12345, None], ["del", "ab" * 32 + "_m_1_2.bin"],
               ["put", "cd" * 32 + "_m_1_2.bin", 8192, None, [7, None, [1, 2, 3, 4], None, None]]]
    return [b"".join(_RECORD.pack(len(p)) + p for p in (msgpack.packb(r) for r in records))]


def _targets() -> dict[str, Target]:
    from kvcr.config import ConfigError
    from kvcr.proto.events import EventError
    from kvcr.proto.hints import HintError
    from kvcr.proto.messages import ProtocolError
    from kvcr.text import RequestError
    from router_hints.http.config import RouterConfigError

    found = [Target("events", _events, EventError, _event_seeds),
             Target("event_frames", _event_frames, EventError, _frame_seeds),
             Target("control", _control, ProtocolError, _control_seeds),
             Target("hints", _hints, HintError, _hint_seeds),
             Target("runner_config", _runner_config, ConfigError, _config_seeds),
             Target("config_file", _config_file, ConfigError, _config_seeds),
             Target("router_config", _router_config, RouterConfigError, _router_seeds),
             Target("request_body", _request_body, RequestError, _body_seeds),
             Target("manifest", _manifest, NeverRefuses, _manifest_seeds)]
    return {t.name: t for t in found}


TARGETS = _targets()


def corpus(name: str) -> list[Path]:
    return sorted(p for p in (CORPUS / name).glob("*") if p.is_file())
