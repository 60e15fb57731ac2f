"""A synthetic trace in Mooncake's format: shared system prompts of Zipf popularity, multi-turn
sessions that extend their own history, bursty arrivals. Fixed seed: the same file every time."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .trace import MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True, kw_only=True)
class SynthSpec:
    requests: int = 2000
    seed: int = 0
    system_prompts: int = 20
    system_blocks: int = 6        # blocks of each shared system prompt
    zipf_s: float = 1.1           # popularity skew of the system prompts
    turn_blocks: tuple[int, int] = (1, 4)  # new blocks a turn adds (user message + last answer)
    max_turns: int = 6
    rate_per_s: float = 6.0       # mean arrivals per second
    burst_every_s: float = 10.0   # a burst of arrivals at 4x the rate for a second, this often
    output_length: tuple[int, int] = (32, 512)


def generate(spec: SynthSpec) -> list[dict]:
    rng = random.Random(spec.seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    systems = [fresh(spec.system_blocks) for _ in range(spec.system_prompts)]
    weights = [1.0 / (k + 1) ** spec.zipf_s for k in range(spec.system_prompts)]
    open_sessions: list[tuple[list[int], int]] = []  # (history block ids, turns so far)
    out, now_s = [], 0.0
    for _ in range(spec.requests):
        burst = (now_s % spec.burst_every_s) < 1.0
        now_s += rng.expovariate(spec.rate_per_s * (4.0 if burst else 1.0))
        if open_sessions and rng.random() < 0.6:  # a follow-up turn of an open session
            i = rng.randrange(len(open_sessions))
            history, turns = open_sessions[i]
            blocks = history + fresh(rng.randint(*spec.turn_blocks))
            if turns + 1 >= spec.max_turns:
                open_sessions.pop(i)
            else:
                open_sessions[i] = (blocks, turns + 1)
        else:
            system = rng.choices(systems, weights)[0]
            blocks = system + fresh(rng.randint(*spec.turn_blocks))
            open_sessions.append((blocks, 1))
        tail = rng.randint(1, MOONCAKE_BLOCK_TOKENS)  # the last block is partial
        out.append({"timestamp": round(now_s * 1000), "input_length": (len(blocks) - 1) * MOONCAKE_BLOCK_TOKENS + tail,
                    "output_length": rng.randint(*spec.output_length), "hash_ids": blocks})
    return out


def write(path: str | Path, spec: SynthSpec) -> int:
    lines = generate(spec)
    Path(path).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)
