"""Text to token ids, the same way on the router and on the worker (pages hash the same).

A tokenizer is a local Hugging Face `tokenizer.json` (or a directory holding one); nothing is
downloaded. A directory whose `tokenizer_config.json` has a `chat_template` renders chats with it
(jinja2), as engines do; otherwise the built-in template below is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "kvcr" / "worker" / "assets" / "tokenizer.json"
ROLES = ("system", "user", "assistant")


class RequestError(ValueError):
    """A request body the router or worker cannot serve; the message names the field."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


def parse_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {ROLES}")
        content = msg.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        out.append(ChatMessage(msg["role"], content))
    return out


class TextTokenizer:
    def __init__(self, path: str | Path | None = None) -> None:
        from tokenizers import Tokenizer  # only the HTTP router and the worker need it

        path = Path(path or DEFAULT_TOKENIZER)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"tokenizer {file} does not exist (tokenizers are never downloaded)")
        self.tok = Tokenizer.from_file(str(file))
        self.template = _chat_template(path) if path.is_dir() else None
        self.vocab_size = self.tok.get_vocab_size()
        self.eos_id = self.tok.token_to_id("<|eos|>")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, messages: list[ChatMessage]) -> str:
        if self.template is not None:
            return self.template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                        add_generation_prompt=True, bos_token="", eos_token="")
        return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"

    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        return self.encode(self.chat_prompt(messages))


def _chat_template(directory: Path) -> Any:
    cfg = directory / "tokenizer_config.json"
    template = json.loads(cfg.read_text()).get("chat_template") if cfg.exists() else None
    if not isinstance(template, str):
        return None
    import jinja2

    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def request_tokens(body: dict, route: str, tokenizer: TextTokenizer) -> list[int]:
    """The prompt's token ids for an SGLang `/generate` or OpenAI completions/chat body."""
    if route == "chat":
        return tokenizer.chat_ids(parse_messages(body.get("messages")))
    if route == "generate" and body.get("input_ids") is not None:
        ids = body["input_ids"]
    else:
        key = "text" if route == "generate" else "prompt"
        text = body.get(key)
        if isinstance(text, list) and text and all(isinstance(t, int) for t in text):
            ids = text  # OpenAI prompts may be token ids
        elif isinstance(text, str):
            return tokenizer.encode(text)
        else:
            raise RequestError(f"{key} must be a string (or input_ids a list of token ids)")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in ids):
        raise RequestError("input_ids must be a non-empty list of non-negative integers")
    return ids
