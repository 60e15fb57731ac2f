"""Request traces: Mooncake's FAST'25 JSONL and our token-ids JSONL, read into one shape. Pure.

Mooncake: `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`, each
hash id a 512-token block whose id stands for its whole prefix. Ours: `{"timestamp": ms,
"token_ids": [...], "output_length": n}`; blocks are cut and chained here, so equal prefixes get
equal ids as in Mooncake's files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that cannot be used, named by its line number."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    blocks: tuple[int, ...]  # prefix block ids, root first; equal ids mean reusable KV


def _int(obj: dict, key: str, line: int, *, default: int | None = None) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"line {line}: {key} must be a non-negative integer, got {value!r}")
    return value


def _timestamp(obj: dict, line: int) -> float:
    value = obj.get("timestamp")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != value:
        raise TraceError(f"line {line}: timestamp must be a non-negative number of milliseconds, got {value!r}")
    return value / 1000.0


class BlockIds:
    """Chained block ids for token-ids traces: the same (parent, tokens) always gets the same id."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def of(self, tokens: list[int]) -> tuple[int, ...]:
        out, parent = [], -1
        for start in range(0, len(tokens) - len(tokens) % self.block_tokens, self.block_tokens):
            key = (parent, tuple(tokens[start:start + self.block_tokens]))
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return tuple(out)


def parse_line(obj: object, line: int, ids: BlockIds) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"line {line}: a request is a JSON object, got {type(obj).__name__}")
    arrival = _timestamp(obj, line)
    output = _int(obj, "output_length", line, default=0)
    if "hash_ids" in obj:
        blocks = obj["hash_ids"]
        if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                                   for b in blocks):
            raise TraceError(f"line {line}: hash_ids must be a list of non-negative integers")
        length = _int(obj, "input_length", line)
        if length > len(blocks) * ids.block_tokens or (blocks and length <= (len(blocks) - 1) * ids.block_tokens):
            raise TraceError(f"line {line}: input_length {length} does not fit {len(blocks)} blocks of "
                             f"{ids.block_tokens} tokens")
        return TraceRequest(arrival, length, output, tuple(blocks))
    if "token_ids" in obj:
        tokens = obj["token_ids"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in tokens):
            raise TraceError(f"line {line}: token_ids must be a list of non-negative integers")
        return TraceRequest(arrival, len(tokens), output, ids.of(tokens))
    raise TraceError(f"line {line}: a request needs hash_ids (Mooncake) or token_ids")


def parse_lines(lines: Iterable[str], *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Iterator[TraceRequest]:
    """Requests in file order; blank lines are skipped, anything else wrong raises TraceError."""
    ids = BlockIds(block_tokens)
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"line {number}: not JSON ({exc.msg})") from None
        yield parse_line(obj, number, ids)


def read_trace(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    try:
        with open(path, encoding="utf-8") as f:
            requests = list(parse_lines(f, block_tokens=block_tokens))
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from None
    if not requests:
        raise TraceError(f"{path}: no requests")
    return sorted(requests, key=lambda r: r.arrival_s)
