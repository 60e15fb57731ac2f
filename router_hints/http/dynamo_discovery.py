"""Workers from Dynamo's discovery (etcd), for a kvcr router that runs where Dynamo does.

Every Dynamo worker's model card sits in etcd under `v1/mdc/NAMESPACE/...`, held by its lease, so
a worker that stops or dies leaves with it. A kvcr bridge puts its worker entry in the card's
runtime data (`kvcr_worker`); other Dynamo workers are not kvcr's and are skipped. etcd is
trusted as Dynamo trusts it: whatever is registered there is routed to.
"""

from __future__ import annotations

import json
from typing import Any

from kvcr.drivers import etcd
from kvcr.proto.hints import KVCR_WORKER_KEY

from ..discovery import DiscoveryError
from .config import RouterConfigError, WorkerEntry, parse_worker


def fetch_cards(etcd_url: str, namespace: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """etcd key -> decoded model card, for every card under the namespace (etcd's JSON gateway)."""
    try:
        values = etcd.range_prefix(etcd_url, f"v1/mdc/{namespace}/", timeout_s=timeout_s)
    except etcd.EtcdError as exc:  # unreachable, or not an etcd answer
        raise DiscoveryError(f"Dynamo's {exc}") from None
    cards = {}
    for key, value in values.items():
        try:
            cards[key] = json.loads(value)
        except ValueError:
            continue  # not a card: nobody's worker
    return cards


def entries_from_cards(cards: dict[str, Any]) -> tuple[dict[str, WorkerEntry], list[str]]:
    """(card key -> worker entry) for the kvcr workers among the cards, and why each card that
    names a kvcr worker badly was skipped."""
    entries, problems = {}, []
    for key, card in cards.items():
        try:
            raw = card["card_json"]["runtime_config"]["runtime_data"].get(KVCR_WORKER_KEY)
        except (KeyError, TypeError, AttributeError):
            continue
        if raw is None:
            continue
        try:
            entries[key] = parse_worker(raw, f"{key} {KVCR_WORKER_KEY}")
        except RouterConfigError as exc:
            problems.append(str(exc))
    return entries, problems
