"""What the backend derives from SGLang's call arguments (pure): page announces for routers, and
which prefixes a hybrid model's pools can restore."""

from __future__ import annotations

from kvcr.proto.announce import Announce
from kvcr.proto.keys import hash_str_to_int64, page_digests


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


def span_announces(keys: list[str], tokens: list[int] | None, page_size: int, span: int,
                   prior: bytes | None) -> tuple[list[Announce], list[bytes]] | None:
    """Announces for keys that each span `span` engine pages: each key is announced as that many
    blocks, the engine's own page hashes, chained from `prior` (the digest of the engine page
    before the first key; None at a sequence start). Also returns each key's last engine digest,
    which continues the chain for the keys after it. None without the tokens."""
    if not tokens or len(tokens) != len(keys) * span * page_size:
        return None
    digests = page_digests(tokens, page_size, prior)
    events = [hash_str_to_int64(d.hex()) for d in digests]
    parent = hash_str_to_int64(prior.hex()) if prior else None
    out, tails = [], []
    for i in range(len(keys)):
        blocks = tuple(events[i * span:(i + 1) * span])
        out.append(Announce(event_hash=blocks[-1], parent_hash=parent, blocks=blocks,
                            token_ids=tuple(tokens[i * span * page_size:(i + 1) * span * page_size])))
        tails.append(digests[(i + 1) * span - 1])
        parent = blocks[-1]
    return out, tails


def restorable(held: list[bool], policy: str, trailing: int) -> set[int]:
    """Prefix lengths (in keys) a pool can restore: every page ("all_pages") or only the last
    `trailing` ("trailing_pages": state pools keep a window ending at the prefix)."""
    if policy == "all_pages":
        n = next((i for i, h in enumerate(held) if not h), len(held))
        return set(range(1, n + 1))
    if policy == "trailing_pages":
        return {n for n in range(1, len(held) + 1) if all(held[max(0, n - trailing):n])}
    raise ValueError(f"kvcr: unsupported pool hit policy {policy!r}")
