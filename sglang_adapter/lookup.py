"""SGLang's lookup (`batch_exists`) as both backends answer it, written once: the leading pages held
here, then the claims this request already counts on, then a fresh claim at the peer a hint names.
A page counts as a hit only once it is held here or claimed for this request (lookup confirmation).
"""

from __future__ import annotations

import logging

from kvcr.drivers.claim_holder import ClaimHolder

from . import hooks

log = logging.getLogger(__name__)


class LookupFailed(Exception):
    """The backend could not tell what it holds (its runner did not answer): nothing is a hit."""


class ConfirmedLookup:
    """The lookup of a backend that supplies `_held_here`, `_claim_holder` and `_claim_beyond`."""

    def _held_here(self, keys: list[str]) -> int:
        """How many leading keys this backend's runner holds (LookupFailed when it cannot tell)."""
        raise NotImplementedError

    def _claim_holder(self) -> ClaimHolder | None:
        """The claims taken at peers (None while no peer was ever claimed from)."""
        raise NotImplementedError

    def _claim_beyond(self, keys: list[str], local: int, owner: str | None, extra_info) -> int:
        """How far the keys are covered once a peer is asked for what lies past `local`."""
        raise NotImplementedError

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        claims = self._claim_holder()
        if claims is not None:
            claims.expire()  # claims SGLang never collected go back first
        try:
            local = self._held_here(keys)
            if local == len(keys):
                return local
            owner = hooks.current_request()
            claims = self._claim_holder()  # the first lookup may have started the runner and its puller
            if claims is not None:
                confirmed = claims.covered(keys, local, owner)
                if confirmed > local:
                    return confirmed  # asked again (another rank, a retry, a shared prefix): the claims stand
            return self._claim_beyond(keys, local, owner, extra_info)
        except LookupFailed as exc:
            log.warning("kvcr lookup failed: %s", exc)
            return 0

    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1
