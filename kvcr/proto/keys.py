"""Page keys and the hashes engines publish for them.

SGLang keys a HiCache page by a SHA-256 chain over its tokens; routers see a 64-bit event
hash per page. Both are reproduced here byte for byte (vectors: shared/reference/hash-vectors.json).
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from array import array
from dataclasses import dataclass
from typing import Sequence

U64_MASK = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1

STORAGE_NS_PREFIX = b"sglang-cache-namespace-v1"
EVENT_NS_PREFIX = b"sglang-kv-event-namespace-v1"
EVENT_SALT_PREFIX = b"sglang-cache-salt-v1\0"

EVENT_FORMATS = ("default", "dynamo")


class KeyFormatError(ValueError):
    """A key, namespace or hash input that cannot be used."""


def _part(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + struct.pack("<Q", len(raw)) + raw


def _page_bytes(tokens: Sequence[int]) -> bytes:
    if any(t > _U32_MAX for t in tokens):
        return b"\xff" + array("Q", tokens).tobytes()
    return array("I", tokens).tobytes()


def page_digests(tokens: Sequence[int], page_size: int, prior: bytes | None = None) -> list[bytes]:
    """SHA-256 chain over whole pages; a trailing partial page is ignored."""
    if page_size <= 0:
        raise KeyFormatError(f"page_size must be positive, got {page_size}")
    prev = prior or b""
    out: list[bytes] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prev = hashlib.sha256(prev + _page_bytes(tokens[start:start + page_size])).digest()
        out.append(prev)
    return out


def page_hashes(tokens: Sequence[int], page_size: int, prior_hex: str | None = None) -> list[str]:
    """SGLang's HiCache storage keys (64 lowercase hex digits per page)."""
    prior = bytes.fromhex(prior_hex) if prior_hex else None
    return [d.hex() for d in page_digests(tokens, page_size, prior)]


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """Prior digest of a namespaced request's storage chain, None when unnamespaced."""
    if extra_key is None and cache_salt is None:
        return None
    return hashlib.sha256(STORAGE_NS_PREFIX + _part(extra_key) + _part(cache_salt)).digest()


def request_page_hashes(tokens: Sequence[int], page_size: int, *, extra_key: str | None = None,
                        cache_salt: str | None = None) -> list[str]:
    """Storage keys of a whole request, seeded like SGLang when extra_key or cache_salt is set."""
    seed = storage_namespace_seed(extra_key, cache_salt)
    return [d.hex() for d in page_digests(tokens, page_size, seed)]


def hash_str_to_int64(page_hex: str) -> int:
    """SGLang's event int: the first 16 hex digits as a signed int64."""
    if len(page_hex) < 16:
        raise KeyFormatError(f"page hash {page_hex!r} is shorter than 16 hex digits")
    value = int(page_hex[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def to_u64(value: int) -> int:
    """Router view of a 64-bit hash (int64 and u64 carry the same bits)."""
    return value & U64_MASK


def to_int64(value: int) -> int:
    value &= U64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def router_u64(page_hex: str) -> int:
    return to_u64(hash_str_to_int64(page_hex))


def event_salt_seed(cache_salt: str) -> bytes:
    return hashlib.sha256(EVENT_SALT_PREFIX + cache_salt.encode("utf-8")).digest()


def event_namespace_seed(extra_key: str | None, cache_salt: str | None, event_format: str,
                         extra_key_is_lora: bool = True) -> bytes | None:
    """Seed mixed into published hashes; None means hashes are published unchanged.

    With format "default" SGLang mixes in only a known LoRA extra_key, never the salt.
    """
    if event_format not in EVENT_FORMATS:
        raise KeyFormatError(f"event format must be one of {EVENT_FORMATS}, got {event_format!r}")
    if event_format == "default":
        if extra_key is None or not extra_key_is_lora:
            return None
        cache_salt = None
    elif extra_key is None and cache_salt is None:
        return None
    return hashlib.sha256(EVENT_NS_PREFIX + _part(extra_key) + _part(cache_salt)).digest()


def namespaced_block_hash(seed: bytes, value: int) -> int:
    digest = hashlib.sha256(seed + to_int64(value).to_bytes(8, "big", signed=True)).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def event_hashes(tokens: Sequence[int], page_size: int, *, extra_key: str | None = None,
                 cache_salt: str | None = None, event_format: str = "default",
                 extra_key_is_lora: bool = True) -> list[int]:
    """The int64 block hashes an SGLang engine publishes for these pages."""
    prior = event_salt_seed(cache_salt) if cache_salt is not None else None
    chain = [int.from_bytes(d[:8], "big", signed=True) for d in page_digests(tokens, page_size, prior)]
    seed = event_namespace_seed(extra_key, cache_salt, event_format, extra_key_is_lora)
    if seed is None:
        return chain
    return [namespaced_block_hash(seed, h) for h in chain]


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace:
    """Everything that makes two pages with the same token hash hold different bytes."""

    model: str
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    is_mla: bool = False
    layout: str = "page_first"
    dtype: str = "float16"
    page_size: int = 16
    components: tuple[tuple[str, int], ...] = ()
    cp_size: int = 1  # attention context parallelism: ranks hold different tokens' KV
    cp_rank: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise KeyFormatError("namespace.model must be a non-empty string")
        for name, value in (("tp_size", self.tp_size), ("pp_size", self.pp_size), ("page_size", self.page_size)):
            if value < 1:
                raise KeyFormatError(f"namespace.{name} must be >= 1, got {value}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise KeyFormatError(f"namespace.tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise KeyFormatError(f"namespace.pp_rank {self.pp_rank} is outside pp_size {self.pp_size}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise KeyFormatError(f"namespace.cp_rank {self.cp_rank} is outside cp_size {self.cp_size}")

    def fields(self) -> dict[str, object]:
        # MLA ranks hold identical KV, so the rank does not separate them.
        rank = "shared" if self.is_mla else f"{self.tp_rank}/{self.tp_size}"
        return {"model": self.model, "tp": rank, "pp": f"{self.pp_rank}/{self.pp_size}",
                "mla": self.is_mla, "layout": self.layout, "dtype": self.dtype,
                "page_size": self.page_size, "components": [list(c) for c in self.components],
                # only with CP > 1, so every digest made before CP existed stays the same
                **({"cp": f"{self.cp_rank}/{self.cp_size}"} if self.cp_size > 1 else {})}

    @property
    def digest(self) -> str:
        return _namespace_digest(self)

    def differences(self, other: "Namespace") -> list[str]:
        """Human-readable list of fields that differ, e.g. ["dtype: float16 != bfloat16"]."""
        mine, theirs = self.fields(), other.fields()
        return [f"{k}: {mine[k]} != {theirs[k]}" for k in mine if mine[k] != theirs[k]]


PAGE_HEX_DIGITS = 64
_PAGE_HEX = re.compile(r"[0-9a-f]{%d}" % PAGE_HEX_DIGITS)
_PAGE_HEX_LINES = re.compile(r"(?:[0-9a-f]{%d}\n)*" % PAGE_HEX_DIGITS)


class StorageKey(str):
    """The runner's key for a page: the engine's page hash within one namespace, written
    `<page hex>.<namespace digest>`. A str, so pools and indexes key by it as they are."""

    __slots__ = ()

    @property
    def page_hex(self) -> str:
        return self[:PAGE_HEX_DIGITS]

    @property
    def namespace_digest(self) -> str:
        return self[PAGE_HEX_DIGITS + 1:]


def check_page_hex(page_hex: object) -> str:
    if not isinstance(page_hex, str) or not _PAGE_HEX.fullmatch(page_hex):
        raise KeyFormatError(f"page hash must be {PAGE_HEX_DIGITS} lowercase hex digits, got {page_hex!r}")
    return page_hex


def storage_key(page_hex: str, namespace_digest: str) -> StorageKey:
    return StorageKey(f"{check_page_hex(page_hex)}.{namespace_digest}")


def storage_keys(page_hexes: Sequence[object], namespace_digest: str) -> list[StorageKey]:
    """storage_key of each: a request's page hashes checked in one pass, not one match each."""
    if page_hexes and not (set(map(type, page_hexes)) <= {str} and set(map(len, page_hexes)) <= {PAGE_HEX_DIGITS}
            and _PAGE_HEX_LINES.fullmatch("\n".join(page_hexes) + "\n")):
        for page_hex in page_hexes:
            check_page_hex(page_hex)  # the error names the first bad one
    suffix = "." + namespace_digest
    return [StorageKey(h + suffix) for h in page_hexes]


@functools.lru_cache(maxsize=1024)
def _namespace_digest(ns: Namespace) -> str:
    # Cached: every page key of a request carries it.
    parts = "|".join(f"{k}={v}" for k, v in ns.fields().items())
    return hashlib.sha256(parts.encode("utf-8")).hexdigest()[:24]
