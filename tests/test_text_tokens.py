"""The router's and worker's prompt ids equal the engine's (SGLang on Hugging Face transformers).

A tiny byte-level BPE tokenizer that adds a BOS, like Llama's, is saved with transformers in the
layouts real checkpoints use; `TextTokenizer` must give the ids `AutoTokenizer` gives for a text
prompt (`encode`) and for a chat (`apply_chat_template(..., tokenize=True, add_generation_prompt=True)`),
which is what SGLang 0.5.23 computes for `/generate`, `/v1/completions` and `/v1/chat/completions`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvcr.text import DEFAULT_TOKENIZER, RequestError, TextTokenizer, request_tokens

pytestmark = pytest.mark.pure

transformers = pytest.importorskip("transformers")

BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
                 "{% if enable_thinking is defined and not enable_thinking %}<|nothink|>{% endif %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORDS = ["cache", "page", "prefix", "router", "worker", "token", "block", "hint", "the", "a", "of", "to"]
LAYOUTS = ("chat_template_jinja", "config_chat_template", "config_added_token_dicts", "legacy_special_tokens_map")
TEXTS = ("the cache page", " leading space and\nnew lines\n", "<s>already starts with the BOS", "ünïcode ✓ prefix")
CHATS = {
    "one_user_turn": [{"role": "user", "content": "the router sends a hint"}],
    "system_user": [{"role": "system", "content": "you are a cache"}, {"role": "user", "content": "page a block"}],
    "multi_turn": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hint?"},
                   {"role": "assistant", "content": "the worker pulls"}, {"role": "user", "content": "to where"}],
}


@pytest.fixture(scope="module")
def bpe() -> Any:
    """A byte-level BPE whose post-processor adds the BOS to every encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(10)) + rng.choice(".!?\n") for _ in range(500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def _edit_config(directory: Path, edit: Callable[[dict], None]) -> None:
    file = directory / "tokenizer_config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def _template_into_config(directory: Path) -> None:
    (directory / "chat_template.jinja").unlink()
    _edit_config(directory, lambda c: c.update(chat_template=CHAT_TEMPLATE))


def _added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}


def _drop_bos_eos(config: dict) -> None:
    del config["bos_token"], config["eos_token"]


def _lay_out(directory: Path, layout: str) -> None:
    """Reshape a transformers 5 save into one of the layouts checkpoints ship."""
    if layout == "chat_template_jinja":
        return
    _template_into_config(directory)
    if layout == "config_added_token_dicts":
        _edit_config(directory, lambda c: c.update(bos_token=_added_token(BOS), eos_token=_added_token(EOS)))
    elif layout == "legacy_special_tokens_map":
        _edit_config(directory, _drop_bos_eos)
        bos = {k: v for k, v in _added_token(BOS).items() if k not in ("__type", "special")}
        (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": bos, "eos_token": EOS}))


@pytest.fixture
def tokenizer_dir(tmp_path: Path, bpe: Any) -> Callable[[str], Path]:
    """Builds the tokenizer directory for a layout; returns its path."""

    def build(layout: str) -> Path:
        from tokenizers import Tokenizer

        # A copy per directory: transformers may rewrite the backend it is given.
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe.to_str()),
                                                    bos_token=BOS, eos_token=EOS)
        fast.chat_template = CHAT_TEMPLATE
        directory = tmp_path / layout
        fast.save_pretrained(directory)
        _lay_out(directory, layout)
        return directory

    return build


def _hf(directory: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(directory)


def _hf_chat_ids(hf: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    # transformers 5 answers a BatchEncoding where 4.x answered the ids.
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("route,key", [("generate", "text"), ("completions", "prompt")])
def test_text_prompt_ids_equal_hf_encode_with_bos(tokenizer_dir, layout: str, text: str, route: str,
                                                  key: str) -> None:
    directory = tokenizer_dir(layout)
    hf = _hf(directory)
    ids = request_tokens({key: text}, route, TextTokenizer(directory))
    assert ids == hf.encode(text)
    assert ids[0] == hf.bos_token_id


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chat_ids_equal_hf_apply_chat_template(tokenizer_dir, layout: str, chat: str) -> None:
    directory = tokenizer_dir(layout)
    hf = _hf(directory)
    ids = request_tokens({"messages": CHATS[chat]}, "chat", TextTokenizer(directory))
    assert ids == _hf_chat_ids(hf, CHATS[chat])
    assert ids.count(hf.bos_token_id) == 1, "the template's BOS, and no second one from the tokenizer"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chat_template_sees_the_tokenizers_eos_string(tokenizer_dir, layout: str) -> None:
    directory = tokenizer_dir(layout)
    hf = _hf(directory)
    ids = request_tokens({"messages": CHATS["multi_turn"]}, "chat", TextTokenizer(directory))
    assert hf.eos_token_id in ids


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_kwargs_reach_the_template(tokenizer_dir, kwargs: dict) -> None:
    directory = tokenizer_dir("chat_template_jinja")
    body = {"messages": CHATS["one_user_turn"], "chat_template_kwargs": kwargs}
    ids = request_tokens(body, "chat", TextTokenizer(directory))
    assert ids == _hf_chat_ids(_hf(directory), CHATS["one_user_turn"], **kwargs)


@pytest.mark.parametrize("bad", [["enable_thinking"], {"messages": []}, {"add_generation_prompt": False}])
def test_chat_template_kwargs_that_are_not_template_variables_are_rejected(tokenizer_dir, bad: Any) -> None:
    body = {"messages": CHATS["one_user_turn"], "chat_template_kwargs": bad}
    with pytest.raises(RequestError, match="chat_template_kwargs"):
        request_tokens(body, "chat", TextTokenizer(tokenizer_dir("chat_template_jinja")))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_final_assistant_turn_is_rendered_as_a_user_turn(tokenizer_dir, layout: str) -> None:
    directory = tokenizer_dir(layout)
    messages = CHATS["system_user"] + [{"role": "assistant", "content": "a partial answer"}]
    as_user = CHATS["system_user"] + [{"role": "user", "content": "a partial answer"}]
    ids = request_tokens({"messages": messages}, "chat", TextTokenizer(directory))
    assert ids == _hf_chat_ids(_hf(directory), as_user)


@pytest.mark.parametrize("prefix", ["the worker", " pulls a page"])
def test_continued_final_assistant_turn_appends_its_ids_without_bos(tokenizer_dir, prefix: str) -> None:
    directory = tokenizer_dir("chat_template_jinja")
    hf = _hf(directory)
    messages = CHATS["system_user"] + [{"role": "assistant", "content": prefix}]
    ids = request_tokens({"messages": messages, "continue_final_message": True}, "chat", TextTokenizer(directory))
    assert ids == _hf_chat_ids(hf, CHATS["system_user"]) + hf.encode(prefix)[1:]


@pytest.mark.parametrize("parts,joined", [
    ([{"type": "text", "text": "the cache"}, {"type": "text", "text": "page"}], "the cache page"),
    ([{"type": "input_text", "text": "a hint"}, {"type": "image_url", "image_url": {"url": "x"}}], "a hint"),
])
def test_content_parts_are_joined_with_spaces(tokenizer_dir, parts: list, joined: str) -> None:
    directory = tokenizer_dir("chat_template_jinja")
    ids = request_tokens({"messages": [{"role": "user", "content": parts}]}, "chat", TextTokenizer(directory))
    assert ids == _hf_chat_ids(_hf(directory), [{"role": "user", "content": joined}])


FEATURE_TEMPLATES = {
    "generation_tag": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                       "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"),
    "tojson_filter": "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}",
    "loop_controls": "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                     "{{ m['content'] }}{% endfor %}",
    "strftime_now": "{{ bos_token }}{{ strftime_now('%Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
}


@pytest.mark.parametrize("feature", sorted(FEATURE_TEMPLATES))
def test_templates_using_transformers_jinja_extras_render_like_hf(tokenizer_dir, feature: str) -> None:
    directory = tokenizer_dir("chat_template_jinja")
    (directory / "chat_template.jinja").write_text(FEATURE_TEMPLATES[feature])
    ids = request_tokens({"messages": CHATS["multi_turn"]}, "chat", TextTokenizer(directory))
    assert ids == _hf_chat_ids(_hf(directory), CHATS["multi_turn"])


def test_template_raising_an_exception_is_a_request_error(tokenizer_dir) -> None:
    directory = tokenizer_dir("chat_template_jinja")
    (directory / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}")
    with pytest.raises(RequestError, match="roles must start with user"):
        request_tokens({"messages": CHATS["system_user"]}, "chat", TextTokenizer(directory))


def test_named_templates_in_the_config_use_the_first(tokenizer_dir) -> None:
    # SGLang's TemplateManager takes the first named template; transformers would take "default".
    directory = tokenizer_dir("config_chat_template")
    named = [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": "{{ bos_token }}tools"}]
    _edit_config(directory, lambda c: c.update(chat_template=named))
    ids = request_tokens({"messages": CHATS["system_user"]}, "chat", TextTokenizer(directory))
    assert ids == _hf_chat_ids(_hf(directory), CHATS["system_user"])


def test_directory_without_chat_template_tokenizes_builtin_prompt_as_text(tokenizer_dir) -> None:
    directory = tokenizer_dir("config_chat_template")
    _edit_config(directory, lambda c: c.pop("chat_template"))
    tok = TextTokenizer(directory)
    messages = CHATS["system_user"]
    ids = request_tokens({"messages": messages}, "chat", tok)
    builtin = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    assert ids == _hf(directory).encode(builtin)


@pytest.mark.parametrize("add_bos_token", [None, True])
def test_llama_class_tokenizer_gets_bos_from_its_flag(tokenizer_dir, add_bos_token: bool | None) -> None:
    # SGLang restores add_bos_token (default true) for Llama-class tokenizers whose tokenizer.json adds none.
    directory = tokenizer_dir("chat_template_jinja")
    raw = json.loads((directory / "tokenizer.json").read_text())
    (directory / "tokenizer.json").write_text(json.dumps(raw | {"post_processor": None}))
    flag = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    _edit_config(directory, lambda c: c.update(tokenizer_class="LlamaTokenizerFast", **flag))
    tok = TextTokenizer(directory)
    plain = tok.tok.encode("the cache page", add_special_tokens=False).ids
    assert tok.encode("the cache page") == [tok.bos_id, *plain]


def test_bundled_tokenizer_adds_no_special_tokens() -> None:
    # The worker's tokenizer has no post-processor: its ids are the same as before the BOS fix.
    tok = TextTokenizer()
    assert tok.tok.post_processor is None
    assert tok.encode("the router") == tok.tok.encode("the router", add_special_tokens=False).ids
    assert tok.eos_id == tok.tok.token_to_id("<|eos|>")
    assert TextTokenizer(DEFAULT_TOKENIZER).encode("a page") == tok.encode("a page")
