"""Which DP rank of its engine a scheduler is, as SGLang numbers its per-rank KV-event ports:
the attention-DP rank under DP attention, the replica under plain DP (`--dp-size` alone, where
SGLang's storage config says rank 0 on every replica)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DpPlacement:
    rank: int = 0
    size: int = 1


def dp_placement() -> DpPlacement:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        # Under DP attention SGLang gives each scheduler a dp_rank too; the attention group's is the one
        # its KV belongs to.
        if parallel.attn_dp_size > 1:
            return DpPlacement(rank=parallel.attn_dp_rank, size=parallel.attn_dp_size)
        return DpPlacement(rank=parallel.dp_rank or 0, size=parallel.dp_size)
    except (ValueError, RuntimeError) as exc:  # nothing published: a backend built outside a scheduler
        log.info("kvcr: no SGLang parallel context (%s): DP rank 0 of 1", exc)
        return DpPlacement()
