"""Dynamo's token requests in, an engine's SGLang-style `/generate` out, and its stream back. Pure.

Dynamo's frontend tokenizes, so the worker receives `token_ids`; the engine behind kvcr (the
`kvcr worker`, or SGLang with `--hicache-storage-backend kvcr`) takes them as `input_ids`. The
router's `kv_hint` travels on unchanged: the engine validates it and pulls exactly as it does for
our own router's hints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class BridgeRequestError(ValueError):
    """A Dynamo request the engine cannot serve; the message names the field."""


def _nonneg_int(section: dict, key: str) -> int | None:
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BridgeRequestError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _optional_str(section: dict, key: str) -> str | None:
    value = section.get(key)
    if value is not None and not isinstance(value, str):
        raise BridgeRequestError(f"{key} must be a string, got {value!r}")
    return value or None  # SGLang takes an empty salt as none


def _section(request: dict, key: str) -> dict:
    value = request.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BridgeRequestError(f"{key} must be an object, got {type(value).__name__}")
    return value


def generate_body(request: Any, *, default_max_tokens: int, oracle: bool = False, rid: str | None = None,
                  model: str | None = None, ranks: tuple[int, ...] | None = None) -> dict:
    """The engine's `/generate` body for one Dynamo request (streamed, greedy unless asked); `rid`
    is Dynamo's request id, which its response carries (`cmpl-<rid>`), so a client can find what
    serving it took (a kvcr worker's /kvcr/served/<rid>). `model`: the one model card the bridge
    registered; Dynamo names a LoRA in `model`, and served by the base weights its pages would be
    the base model's, so a request for any other model is refused."""
    if not isinstance(request, dict):
        raise BridgeRequestError("a Dynamo request must be an object")
    asked = request.get("model")
    if model is not None and asked not in (None, model):
        raise BridgeRequestError(f"model {asked!r}: this bridge serves only {model!r} (a LoRA is a model of "
                                 "its own in Dynamo, and this engine registered none)")
    tokens = request.get("token_ids")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int and t >= 0 for t in tokens):
        raise BridgeRequestError("token_ids must be a non-empty list of token ids")
    stop = _section(request, "stop_conditions")
    sampling_in = _section(request, "sampling_options")
    max_tokens = _nonneg_int(stop, "max_tokens")
    sampling: dict[str, Any] = {"max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
                                "ignore_eos": bool(stop.get("ignore_eos", False))}
    for key in ("temperature", "top_p", "top_k", "seed"):
        if sampling_in.get(key) is not None:
            sampling[key] = sampling_in[key]
    sampling.setdefault("temperature", 0.0)
    if stop.get("stop_token_ids_hidden"):
        sampling["stop_token_ids"] = list(stop["stop_token_ids_hidden"])
    body: dict[str, Any] = {"input_ids": tokens, "sampling_params": sampling, "stream": True}
    routing = _section(request, "routing")
    rank = _nonneg_int(routing, "dp_rank") if ranks is not None else None
    if rank is not None:  # the rank whose pages Dynamo routed on: SGLang's DP controller runs it there
        if rank not in ranks:
            raise BridgeRequestError(f"routing.dp_rank {rank} is not one of this engine's DP ranks {list(ranks)}")
        body["routed_dp_rank"] = rank
    salt = _optional_str(routing, "cache_salt")
    if salt is not None:
        body["cache_salt"] = salt  # the tenant's namespace: Dynamo routed on it, the engine keys pages by it
    if request.get("kv_hint") is not None:
        body["kv_hints"] = request["kv_hint"]  # the name SGLang's /generate takes; the kvcr worker takes both
    if oracle:
        body["kvcr_oracle"] = True
    if rid:
        body["rid"] = rid
    return body


@dataclass
class StreamDecoder:
    """Turns the engine's server-sent events (cumulative `output_ids`) into Dynamo's per-step chunks."""

    sent: int = 0
    finished: bool = False

    def feed(self, line: bytes) -> dict | None:
        text = line.decode("utf-8", "replace").strip()
        if not text.startswith("data:"):
            return None
        data = text[5:].strip()
        if data == "[DONE]":
            return None
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            raise BridgeRequestError(f"the engine streamed malformed JSON: {exc}") from None
        if "error" in chunk:
            raise BridgeRequestError(f"the engine failed the request: {chunk['error']}")
        ids = chunk.get("output_ids") or []
        new = ids[self.sent:]
        self.sent = len(ids)
        finish = (chunk.get("meta_info") or {}).get("finish_reason")
        out: dict[str, Any] = {"index": 0, "token_ids": list(new)}
        if finish:
            self.finished = True
            out["finish_reason"] = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
            meta = chunk.get("meta_info") or {}
            prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", self.sent)
            out["completion_usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                       "total_tokens": prompt + completion,
                                       "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)}}
        return out if new or finish else None
