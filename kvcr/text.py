"""Text to token ids, the same way on the router, on the worker and in SGLang (pages hash the same).

A tokenizer is a local Hugging Face `tokenizer.json` (or a directory holding one); nothing is
downloaded. Ids follow SGLang 0.5.23 on transformers 5: a text prompt (`/generate` text, an OpenAI
completions prompt) is encoded with the tokenizer's special tokens (its post-processor, e.g. a
Llama BOS); a chat is rendered with the directory's chat template (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`), which gets the tokenizer's real special-token strings
(`bos_token`, `eos_token`, ...), and the rendered text is encoded without adding special tokens again.
Without a chat template the built-in one below is used, and its text is encoded like a text prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "kvcr" / "worker" / "assets" / "tokenizer.json"
ROLES = ("system", "user", "assistant")
# transformers' named special tokens, each passed to chat templates by name (special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Template variables the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# SGLang restores add_bos_token (default true) for these classes after transformers 5 drops it, and
# then rebuilds the post-processor as "BOS $A" (get_tokenizer -> _fix_v5_add_bos_eos_token).
BOS_FLAG_CLASSES = frozenset({"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
                              "GemmaTokenizer", "GemmaTokenizerFast", "CohereTokenizerFast"})


class RequestError(ValueError):
    """A request body the router or worker cannot serve; the message names the field."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


def _message_text(content: list) -> str:
    # SGLang flattens content parts this way for string-content templates (process_content_for_template_format).
    return " ".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text")
                    and isinstance(p.get("text"), str))


def parse_messages(raw: Any) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {ROLES}")
        content = msg.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            content = _message_text(content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        out.append(ChatMessage(msg["role"], content))
    return out


def _template_kwargs(body: dict) -> dict[str, Any]:
    """SGLang's extra chat-template variables: reasoning_effort, then chat_template_kwargs over it."""
    out: dict[str, Any] = {}
    if body.get("reasoning_effort") is not None:
        out["reasoning_effort"] = body["reasoning_effort"]
    extra = body.get("chat_template_kwargs")
    if extra is None:
        return out
    if not isinstance(extra, dict) or RESERVED_TEMPLATE_KWARGS & extra.keys():
        raise RequestError(f"chat_template_kwargs must be an object without {sorted(RESERVED_TEMPLATE_KWARGS)}")
    return out | extra


def _split_final_assistant(messages: list[ChatMessage], continue_final: bool) -> tuple[list[ChatMessage], str]:
    """SGLang's _handle_last_assistant_message: a final assistant turn is continued (cut off and returned
    as a prefix to append) or, by default, rendered as a user turn."""
    if messages[-1].role != "assistant":
        return messages, ""
    if continue_final:
        return messages[:-1], messages[-1].content
    return [*messages[:-1], replace(messages[-1], role="user")], ""


class TextTokenizer:
    def __init__(self, path: str | Path | None = None) -> None:
        from tokenizers import Tokenizer  # only the HTTP router and the worker need it

        path = Path(path or DEFAULT_TOKENIZER)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"tokenizer {file} does not exist (tokenizers are never downloaded)")
        self.path = file
        self.tok = Tokenizer.from_file(str(file))
        config = _read_json(path / "tokenizer_config.json") if path.is_dir() else {}
        self.special_tokens = _special_tokens(path, config) if path.is_dir() else {}
        self.template = _chat_template(path, config) if path.is_dir() else None
        bos = self.special_tokens.get("bos_token")
        self.bos_id = self.tok.token_to_id(bos) if bos is not None else None
        if config.get("tokenizer_class") in BOS_FLAG_CLASSES and config.get("add_bos_token") is not False:
            self.tok.post_processor = _bos_post_processor(bos, self.bos_id)
        self.vocab_size = self.tok.get_vocab_size()
        self.eos_id = self.tok.token_to_id(self.special_tokens.get("eos_token", "<|eos|>"))

    def encode(self, text: str) -> list[int]:
        """A text prompt's ids, special tokens included (HF `tokenizer.encode(text)`)."""
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None = None) -> str:
        if self.template is None:
            return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"
        import jinja2

        # HF apply_chat_template: named special tokens first, the caller's kwargs over them.
        variables = self.special_tokens | (template_kwargs or {})
        try:
            return self.template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                        tools=None, documents=None, add_generation_prompt=True, **variables)
        except (jinja2.TemplateError, TypeError) as exc:  # SGLang answers these with 400 too
            raise RequestError(f"the chat template rejected the messages: {exc}") from None

    def chat_ids(self, messages: list[ChatMessage], *, continue_final_message: bool = False,
                 template_kwargs: dict[str, Any] | None = None) -> list[int]:
        messages, prefix = _split_final_assistant(messages, continue_final_message)
        prompt = self.chat_prompt(messages, template_kwargs)
        # A real template places its own special tokens; the built-in one is tokenized as a text prompt.
        ids = self.encode(prompt) if self.template is None else self.tok.encode(prompt, add_special_tokens=False).ids
        return ids + self._continuation_ids(prefix) if prefix else ids

    def _continuation_ids(self, prefix: str) -> list[int]:
        # SGLang's _append_assistant_prefix_to_prompt_ids: encode with specials, drop a leading BOS.
        ids = self.encode(prefix)
        return ids[1:] if ids and ids[0] == self.bos_id else ids


def _read_json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.exists() else {}


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json or special_tokens_map.json store it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(directory: Path, config: dict) -> dict[str, str]:
    """The named special tokens transformers 5 loads: tokenizer_config.json's, and only when it has no
    added_tokens_decoder (a legacy save), special_tokens_map.json's over them."""
    sources = [config]
    if "added_tokens_decoder" not in config:
        sources.append(_read_json(directory / "special_tokens_map.json"))
    out: dict[str, str] = {}
    for source in sources:
        for key in SPECIAL_TOKENS:
            if (token := _token_string(source.get(key))) is not None:
                out[key] = token
    return out


def _bos_post_processor(bos: str | None, bos_id: int | None) -> Any:
    """transformers' update_post_processor with add_bos_token=True, add_eos_token=False."""
    from tokenizers import processors

    if bos is None or bos_id is None:
        return processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def _template_source(directory: Path, config: dict) -> str | None:
    """transformers 5 prefers chat_template.jinja to the config's chat_template; of named templates
    SGLang takes the first (TemplateManager._select_named_template)."""
    file = directory / "chat_template.jinja"
    if file.exists():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list) and template and isinstance(template[0], dict):
        template = template[0].get("template")
    return template if isinstance(template, str) else None


def _chat_template(directory: Path, config: dict) -> Any:
    source = _template_source(directory, config)
    return _jinja_environment().from_string(source) if source is not None else None


def _jinja_environment() -> Any:
    """The environment transformers compiles chat templates in (_cached_compile_jinja_template)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # `{% generation %}` only marks assistant text for training masks; it renders its body unchanged.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def request_cache_salt(body: dict) -> str | None:
    """The request's cache namespace: SGLang's `cache_salt` (on /generate and the OpenAI routes).

    The engine hashes, stores and announces a salted request's pages under it (the index keys them
    by the announced salt), so the request's blocks are hashed under it too; "" is none, as in SGLang."""
    salt = body.get("cache_salt")
    if salt is None or salt == "":
        return None
    if not isinstance(salt, str):  # SGLang refuses a list for one request as well
        raise RequestError("cache_salt must be a string")
    return salt


def refuse_lora(body: dict) -> None:
    """An engine without adapters refuses a LoRA request: served by the base weights, its pages
    would be keyed as the base model's and shared with every base request."""
    adapter = body.get("lora_path")
    if adapter not in (None, "", []):
        raise RequestError(f"lora_path {adapter!r}: this worker serves no LoRA adapters")


def request_tokens(body: dict, route: str, tokenizer: TextTokenizer) -> list[int]:
    """The prompt's token ids for an SGLang `/generate` or OpenAI completions/chat body."""
    if route == "chat":
        return tokenizer.chat_ids(parse_messages(body.get("messages")),
                                  continue_final_message=bool(body.get("continue_final_message", False)),
                                  template_kwargs=_template_kwargs(body))
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
