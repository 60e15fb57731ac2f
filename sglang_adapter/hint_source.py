"""The source a request's hint names, as both backends read it (the claims they take there are
kvcr/drivers/claim_holder.py's)."""

from __future__ import annotations

import logging

from kvcr.proto.hints import HintError, parse_envelope

from . import hooks
from .pagemeta import HintedRequest

log = logging.getLogger(__name__)


def request_hints(extra_info) -> HintedRequest | None:
    """A lookup's request hints: passed in its extra_info, else the launcher's hook recorded them."""
    raw = (extra_info.extra_info or {}).get("kv_hints") if extra_info is not None else None
    return HintedRequest(raw) if raw is not None else hooks.current_hints()


def request_hint_source(hinted: HintedRequest, keys: list[str], page_size: int,
                        span: int = 1) -> tuple[str, int] | None:
    """(source endpoint, leading keys it holds) from a request's `kv_hints`, or None. The hint
    names event hashes; the keys are matched by theirs."""
    try:
        hint = parse_envelope(hinted.envelope)
    except HintError as exc:
        log.warning("kvcr: request hint ignored: %s", exc)
        return None
    events = hinted.key_events(keys, page_size, span)
    held = set(hint.block_hashes)
    depth = next((i for i, e in enumerate(events) if e not in held), len(events))
    return (hint.source_control_endpoint, depth) if depth else None
