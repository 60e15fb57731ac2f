"""Response bodies in SGLang's `/generate` and OpenAI's completions/chat shapes (pure)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .engine import PrefillInfo


@dataclass(frozen=True, slots=True)
class Served:
    rid: str
    created: int
    model: str
    route: str  # "generate", "completions" or "chat"
    info: PrefillInfo
    page_size: int


def meta_info(s: Served, completion_tokens: int, finish: str | None) -> dict:
    info = s.info
    meta = {"id": s.rid, "prompt_tokens": info.prompt_tokens, "completion_tokens": completion_tokens,
            "cached_tokens": info.cached_tokens(s.page_size),
            "kvcr": {"dram_pages": info.dram_pages, "nvme_pages": info.nvme_pages, "peer_pages": info.peer_pages,
                     "stored_pages": info.stored_pages, "source": info.source, "prefill_s": info.prefill_s,
                     "saved_s": info.saved_s,
                     "oracle": None if info.oracle is None else {"chunked_equal": info.oracle.chunked_equal,
                                                                 "full_max_abs": info.oracle.full_max_abs,
                                                                 "ok": info.oracle.ok}}}
    if finish is not None:
        meta["finish_reason"] = {"type": finish}
    return meta


def usage(s: Served, completion_tokens: int) -> dict:
    return {"prompt_tokens": s.info.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": s.info.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.info.cached_tokens(s.page_size)}}


def _choice(s: Served, text: str, finish: str | None, *, delta: bool) -> dict:
    if s.route == "completions":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    body = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
    return {"index": 0, ("delta" if delta else "message"): body, "logprobs": None, "finish_reason": finish}


def _object(s: Served, *, chunk: bool) -> tuple[str, str]:
    if s.route == "completions":
        return f"cmpl-{s.rid}", "text_completion"
    return f"chatcmpl-{s.rid}", "chat.completion.chunk" if chunk else "chat.completion"


def final_body(s: Served, text: str, output_ids: list[int], finish: str) -> dict:
    if s.route == "generate":
        return {"text": text, "output_ids": output_ids, "meta_info": meta_info(s, len(output_ids), finish)}
    ident, obj = _object(s, chunk=False)
    # `kvcr` is an extension field (clients ignore unknown keys): where the prompt's pages came from.
    return {"id": ident, "object": obj, "created": s.created, "model": s.model,
            "choices": [_choice(s, text, finish, delta=False)], "usage": usage(s, len(output_ids)),
            "kvcr": meta_info(s, len(output_ids), finish)["kvcr"]}


def stream_chunk(s: Served, text: str, delta: str, output_ids: list[int], finish: str | None) -> dict:
    """One server-sent event: SGLang streams the text so far, OpenAI the new piece."""
    if s.route == "generate":
        return {"text": text, "output_ids": list(output_ids), "meta_info": meta_info(s, len(output_ids), finish)}
    ident, obj = _object(s, chunk=True)
    return {"id": ident, "object": obj, "created": s.created, "model": s.model,
            "choices": [_choice(s, delta, finish, delta=True)]}


def role_chunk(s: Served) -> dict:
    ident, obj = _object(s, chunk=True)
    return {"id": ident, "object": obj, "created": s.created, "model": s.model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]}


def usage_chunk(s: Served, completion_tokens: int) -> dict:
    ident, obj = _object(s, chunk=True)
    return {"id": ident, "object": obj, "created": s.created, "model": s.model, "choices": [],
            "usage": usage(s, completion_tokens)}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
