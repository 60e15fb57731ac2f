"""What the backend derives from SGLang's call arguments (pure): page announces for routers, and
which prefixes a hybrid model's pools can restore."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import takewhile

from kvcr.proto.announce import Announce
from kvcr.proto.keys import (
    U64_MASK,
    event_hashes,
    event_namespace_seed,
    event_salt_seed,
    hash_str_to_int64,
    namespaced_block_hash,
    page_digests,
    request_page_hashes,
)


@dataclass(frozen=True, slots=True)
class ChainTail:
    """Where an engine's event chain stands after a page: its digest and its published hash."""

    digest: bytes
    event: int


@dataclass(frozen=True, slots=True)
class RequestNamespace:
    """A request's `extra_key` (a LoRA name) and `cache_salt`: they change the hashes engines publish."""

    extra_key: str | None = None
    cache_salt: str | None = None

    @property
    def plain(self) -> bool:
        return self.extra_key is None and self.cache_salt is None


def plain_key_events(keys: list[str]) -> list[int]:
    """Unsalted single-page keys: each is its own event hash (its first 64 bits)."""
    return [hash_str_to_int64(k) & U64_MASK for k in keys]


def request_key_events(tokens: Sequence[int], page_size: int, span: int, ns: RequestNamespace) -> dict[str, int]:
    """Storage key -> the u64 event hash routers know it by (its last engine page's), for every
    whole key of a request's tokens from the root: a namespaced chain is seeded differently for
    storage and for events, so neither can be read off the other."""
    stored = request_page_hashes(tokens, page_size * span, extra_key=ns.extra_key, cache_salt=ns.cache_salt)
    events = event_hashes(tokens, page_size, extra_key=ns.extra_key, cache_salt=ns.cache_salt)
    return {k: events[(i + 1) * span - 1] & U64_MASK for i, k in enumerate(stored)}


@dataclass(frozen=True)
class HintedRequest:
    """A request's kv_hints envelope, and (namespaced requests only) its tokens from the root, so
    the storage keys a lookup is asked for can be matched against the event hashes a hint names."""

    envelope: dict
    ns: RequestNamespace = RequestNamespace()
    tokens: Sequence[int] | None = None
    _events: dict = field(default_factory=dict, repr=False, compare=False)  # (page_size, span) -> map

    def key_events(self, keys: list[str], page_size: int, span: int) -> list[int]:
        """The event hashes of `keys` as far as they can be told (a key the request does not make,
        or a namespaced one without tokens, ends the list)."""
        if self.ns.plain and span == 1:
            return plain_key_events(keys)
        if not self.tokens:
            return []
        known = self._events.get((page_size, span))
        if known is None:
            known = self._events[page_size, span] = request_key_events(self.tokens, page_size, span, self.ns)
        return list(map(known.__getitem__, takewhile(known.__contains__, keys)))


def start_of_chain(ns: RequestNamespace) -> ChainTail | None:
    """The chain's state before a sequence's first page (a salt seeds it; nothing else does)."""
    return ChainTail(event_salt_seed(ns.cache_salt), 0) if ns.cache_salt is not None else None


def tail_of_plain_key(key: str) -> ChainTail:
    """Without salt or LoRA the event chain is the storage chain: a key is its own tail."""
    return ChainTail(bytes.fromhex(key), hash_str_to_int64(key))


def chain_announces(keys: list[str], tokens: list[int] | None, page_size: int, span: int,
                    after: ChainTail | None, parent_event: int | None,
                    ns: RequestNamespace = RequestNamespace()) -> tuple[list[Announce], list[ChainTail]] | None:
    """Announces with the engine's own event hashes for pages whose tokens are known (None
    without them: such pages are stored and served, never announced). A key covering `span` engine
    pages is announced as that many blocks. `after` is the chain's state before the first key;
    each key's tail is returned to continue it."""
    if not tokens or len(tokens) != len(keys) * span * page_size:
        return None
    digests = page_digests(tokens, page_size, after.digest if after else None)
    seed = event_namespace_seed(ns.extra_key, ns.cache_salt, "default")
    events = [int.from_bytes(d[:8], "big", signed=True) for d in digests]
    events = [namespaced_block_hash(seed, h) for h in events] if seed is not None else events
    out, tails, parent = [], [], parent_event
    per_key = span * page_size
    for i in range(len(keys)):
        blocks = tuple(events[i * span:(i + 1) * span])
        out.append(Announce(event_hash=blocks[-1], parent_hash=parent, blocks=blocks if span > 1 else (),
                            token_ids=tuple(tokens[i * per_key:(i + 1) * per_key]), lora_name=ns.extra_key,
                            cache_salt=ns.cache_salt))
        tails.append(ChainTail(digests[(i + 1) * span - 1], blocks[-1]))
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


class AnnounceChain:
    """Announces for backed-up pages, from what SGLang's backup call says (the hook's token ids,
    parent key, extra key and salt). Chains that cannot be read off the storage keys (salted,
    LoRA, spans) continue from the tail recorded when this backend stored the parent; a parent
    it never stored leaves the pages unannounced (stored and served all the same)."""

    def __init__(self, page_size: int, span: int = 1, max_tails: int = 200_000) -> None:
        self.page_size, self.span, self.max_tails = page_size, span, max_tails
        self._tails: OrderedDict[str, ChainTail] = OrderedDict()
        self._lock = threading.Lock()

    def announces(self, keys: list[str], info: dict, prefix_keys: list[str] | None) -> list[Announce] | None:
        ns = RequestNamespace(info.get("extra_key"), info.get("cache_salt"))
        parent_key = info.get("parent_key", prefix_keys[-1] if prefix_keys else None)
        start = self._before(parent_key, ns)
        if start is None:
            return None
        made = chain_announces(keys, info.get("token_ids"), self.page_size, self.span, *start, ns)
        if made is None:
            return None
        if self.span > 1 or not ns.plain:
            with self._lock:
                for key, tail in zip(keys, made[1]):
                    self._tails[key] = tail
                    self._tails.move_to_end(key)
                while len(self._tails) > self.max_tails:
                    self._tails.popitem(last=False)
        return made[0]

    def _before(self, parent_key: str | None, ns: RequestNamespace) -> tuple[ChainTail | None, int | None] | None:
        """(chain state, parent's event hash) before the first key; None when unknown here."""
        if parent_key is None:
            return start_of_chain(ns), None
        if self.span == 1 and ns.plain:
            tail = tail_of_plain_key(parent_key)
            return tail, tail.event
        with self._lock:
            tail = self._tails.get(parent_key)
        return (tail, tail.event) if tail is not None else None
