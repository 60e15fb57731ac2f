"""What a page tells routers about itself, and how to derive it from a request's tokens."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

from .events import EventError, require_hash, require_optional_str
from .keys import event_hashes


@dataclass(frozen=True, slots=True, kw_only=True)
class Announce:
    """The engine's own event hash for a page, its parent's, and the page's tokens."""

    event_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    lora_name: str | None = None
    cache_salt: str | None = None
    # A page that spans several engine pages (SGLang's span mode) is announced as that many
    # blocks: their event hashes in order, the last one being event_hash. Empty: one block.
    blocks: tuple[int, ...] = ()

    @property
    def block_hashes(self) -> tuple[int, ...]:
        return self.blocks or (self.event_hash,)

    def __post_init__(self) -> None:
        require_hash("event_hash", self.event_hash)
        if self.blocks:
            for h in self.blocks:
                require_hash("blocks", h)
            if self.blocks[-1] != self.event_hash or len(self.token_ids) % len(self.blocks):
                raise EventError("a multi-block announce ends with its event_hash and splits its tokens evenly")
        if self.parent_hash is not None:
            require_hash("parent_hash", self.parent_hash)
            if self.parent_hash == self.event_hash:
                raise EventError("a page cannot be its own parent")
        if not isinstance(self.token_ids, tuple):
            raise EventError("token_ids must be a tuple of non-negative integers")
        try:
            array("Q", self.token_ids)  # checks every entry in C: an unsigned 64-bit integer
        except (TypeError, OverflowError):
            raise EventError("token_ids must be non-negative integers") from None
        require_optional_str("lora_name", self.lora_name)
        require_optional_str("cache_salt", self.cache_salt)

    def to_wire(self) -> list:
        wire = [self.event_hash, self.parent_hash, list(self.token_ids), self.lora_name, self.cache_salt]
        return [*wire, list(self.blocks)] if self.blocks else wire  # peers of older minors read 5

    @classmethod
    def from_wire(cls, raw: object) -> "Announce":
        if not isinstance(raw, list) or len(raw) not in (5, 6) or not isinstance(raw[2], list) \
                or (len(raw) == 6 and not isinstance(raw[5], list)):
            raise EventError("an announce is [event_hash, parent_hash, [token ids], lora_name, cache_salt"
                             "(, [block hashes])]")
        event_hash, parent, tokens, lora_name, cache_salt = raw[:5]
        return cls(event_hash=event_hash, parent_hash=parent, token_ids=tuple(tokens), lora_name=lora_name,
                   cache_salt=cache_salt, blocks=tuple(raw[5]) if len(raw) == 6 else ())


def announce_request(tokens: Sequence[int], page_size: int, *, first_page: int = 0, num_pages: int | None = None,
                     extra_key: str | None = None, cache_salt: str | None = None, lora_name: str | None = None,
                     event_format: str = "default") -> list[Announce]:
    """Announces for pages [first_page, first_page + num_pages) of a request whose tokens start at 0.

    The event chain depends on every earlier page, so `tokens` must cover the request from its start.
    """
    hashes = event_hashes(tokens, page_size, extra_key=extra_key, cache_salt=cache_salt,
                          event_format=event_format, extra_key_is_lora=lora_name is not None)
    last = len(hashes) if num_pages is None else min(len(hashes), first_page + num_pages)
    out = []
    for i in range(first_page, last):
        out.append(Announce(event_hash=hashes[i], parent_hash=hashes[i - 1] if i else None,
                            token_ids=tuple(tokens[i * page_size:(i + 1) * page_size]),
                            lora_name=lora_name, cache_salt=cache_salt))
    return out
