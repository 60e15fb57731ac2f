"""Chains of pages with their announces, as an engine would store them: the tests' helper."""

import random

from kvcr.proto.announce import announce_request
from kvcr.proto.keys import request_page_hashes

BLOCK = 16


def pages_for(n, seed=0, page_bytes=65536, salt=None):
    rng = random.Random(seed)
    tokens = [rng.randrange(50000) for _ in range(n * BLOCK)]
    return (request_page_hashes(tokens, BLOCK, cache_salt=salt), announce_request(tokens, BLOCK, cache_salt=salt),
            [rng.randbytes(page_bytes) for _ in range(n)])
