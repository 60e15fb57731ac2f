"""The demo's workload: conversations sharing system prompts, in three phases (pure, seeded).

1. seed, share: first turns are pinned round-robin; neighbours share a system prompt, so in
   "share" the second of each pair finds its system prompt on a peer and pulls it;
2. follow-up: the router places the next turns (they stay where their prefix is: local hits);
3. migrate: each conversation's last turn is pinned to a worker that did not serve it before,
   which must pull the whole conversation from the peer the router's hint names.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ("cache", "page", "token", "router", "worker", "prefix", "prefill", "decode", "layer", "tensor", "pool",
         "tier", "event", "stream", "hint", "claim", "lease", "release", "transfer", "peer", "memory", "disk",
         "latency", "bandwidth", "request", "batch", "model", "attention", "key", "value", "block", "hash",
         "index", "score", "load", "queue", "reuse", "hit", "miss", "evict", "spill", "promote", "fetch", "pull",
         "the", "a", "of", "to", "and", "in", "on", "with", "from", "for", "every", "each", "fast", "slow", "warm",
         "cold", "shared", "local", "remote", "exact", "partial", "whole", "first", "last", "next", "long", "short")
PIN_ROUND_ROBIN = "round-robin"
PIN_AWAY = "away"  # a worker that has not served this conversation yet


@dataclass(frozen=True, slots=True)
class Step:
    conversation: int
    turn: int
    user: str
    pin: str | None  # None: the router decides


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    steps: tuple[Step, ...]


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    system: str


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _paragraph(rng: random.Random, sentences: int, words: int) -> str:
    return " ".join(_sentence(rng, words) for _ in range(sentences))


def build(seed: int, conversations: int, turns: int, system_words: int = 160) -> tuple[list[Conversation],
                                                                                        list[Phase]]:
    if conversations < 1 or turns < 2:
        raise ValueError("the demo needs at least 1 conversation of at least 2 turns")
    rng = random.Random(seed)
    num_systems = max(1, conversations // 2)  # two conversations per system prompt
    systems = [_paragraph(rng, system_words // 16, 16) for _ in range(num_systems)]
    convs = [Conversation(i, systems[(i // 2) % num_systems]) for i in range(conversations)]

    def step(c: int, t: int, pin: str | None) -> Step:
        return Step(c, t, _paragraph(rng, 2, 12), pin)

    phases = [Phase("seed", tuple(step(c, 0, PIN_ROUND_ROBIN) for c in range(0, conversations, 2))),
              Phase("share", tuple(step(c, 0, PIN_ROUND_ROBIN) for c in range(1, conversations, 2))),
              Phase("follow-up", tuple(step(c, t, None) for c in range(conversations) for t in range(1, turns - 1))),
              Phase("migrate", tuple(step(c, turns - 1, PIN_AWAY) for c in range(conversations)))]
    return convs, [p for p in phases if p.steps]


def pick_pin(step: Step, workers: list[str], served_by: list[str]) -> str | None:
    """The worker a pinned step goes to, given who served the conversation so far."""
    if step.pin == PIN_ROUND_ROBIN:
        return workers[step.conversation % len(workers)]
    if step.pin == PIN_AWAY:
        last = served_by[-1] if served_by else None
        candidates = [w for w in workers if w not in served_by] or [w for w in workers if w != last] or workers
        return candidates[step.conversation % len(candidates)]
    return None
