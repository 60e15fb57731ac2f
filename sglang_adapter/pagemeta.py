"""What the backend derives from SGLang's call arguments (pure): page announces for routers, and
which prefixes a hybrid model's pools can restore."""

from __future__ import annotations

from kvcr.proto.announce import Announce
from kvcr.proto.keys import hash_str_to_int64


def page_announces(keys: list[str], tokens: list[int] | None, page_size: int,
                   parent_key: str | None) -> list[Announce] | None:
    """Announces (SGLang's own event hashes, chained from `parent_key`) for pages whose tokens are
    known; None without them: such pages are stored and served, never announced."""
    if not tokens or len(tokens) != len(keys) * page_size:
        return None
    parent = hash_str_to_int64(parent_key) if parent_key else None
    out = []
    for i, key in enumerate(keys):
        h = hash_str_to_int64(key)
        out.append(Announce(event_hash=h, parent_hash=parent,
                            token_ids=tuple(tokens[i * page_size:(i + 1) * page_size])))
        parent = h
    return out


def restorable(held: list[bool], policy: str, trailing: int) -> set[int]:
    """Prefix lengths (in keys) a pool can restore: every page ("all_pages") or only the last
    `trailing` ("trailing_pages": state pools keep a window ending at the prefix)."""
    if policy == "all_pages":
        n = next((i for i, h in enumerate(held) if not h), len(held))
        return set(range(1, n + 1))
    if policy == "trailing_pages":
        return {n for n in range(1, len(held) + 1) if all(held[max(0, n - trailing):n])}
    raise ValueError(f"kvcr: unsupported pool hit policy {policy!r}")
