"""Peer pulls as both backends make them: the source a request's hint names, and the delivery of
what a peer confirmed straight into SGLang's host pages."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from kvcr.proto.hints import HintError, parse_envelope

from . import hooks
from .pagemeta import HintedRequest
from .pending import PendingClaims

if TYPE_CHECKING:
    from kvcr.drivers.puller import Confirmation, Puller

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


def deliver_confirmed(puller: Puller, pending: PendingClaims, keys: list[str], segments: list[list[int]], n: int,
                      segment_bytes: tuple[int, ...], slice_offset: int = 0,
                      on_delivered: Callable[[int, int, Confirmation], None] | None = None) -> int:
    """GET what batch_exists confirmed, from keys[n] on, straight into the host pages (a TP rank:
    its slice of each page). Returns the pages delivered whole, in order; `on_delivered(first,
    count, confirmation)` is told of each claim's whole pages as they arrive."""
    delivered = 0
    while n + delivered < len(keys):
        first = n + delivered
        claim = pending.take(keys, first)  # only a claim on exactly these keys
        if claim is None:
            break
        want = min(len(claim.page_hexes), len(keys) - first)
        result = puller.deliver(claim.conf, segments[first:first + want], segments=segment_bytes,
                                slice_offset=slice_offset)
        if result.uncertain:
            # The data plane ends every transfer before it returns (a stuck lane's worker is
            # destroyed), so this is a failure like any other: nothing of it is delivered.
            log.error("kvcr: a peer transfer into host pages failed uncertainly (%s); none of it is used",
                      result.error)
            break
        if result.delivered and on_delivered is not None:
            on_delivered(first, result.delivered, claim.conf)
        delivered += result.delivered
        if result.delivered < want:
            break
    return delivered
