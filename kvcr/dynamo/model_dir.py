"""The HF-style model directory Dynamo's frontend reads (tokenizer and config, no weights)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def write_model_dir(parent: str | Path | None, *, tokenizer_json: str | Path, vocab_size: int, max_positions: int,
                    bos_id: int | None, eos_id: int | None, special: dict[str, str]) -> Path:
    """Write what the frontend needs to tokenize for a `kvcr worker` exactly as the worker does.

    Dynamo admits a second worker for a model only if its model card matches the first one's, the
    directory's path included: the directory is named by its content, so equal workers share it."""
    files = _files(vocab_size, max_positions, bos_id, eos_id, special)
    digest = hashlib.sha256(Path(tokenizer_json).read_bytes())
    digest.update(json.dumps(files, sort_keys=True).encode())
    out = Path(parent or tempfile.gettempdir()) / f"kvcr-dynamo-model-{digest.hexdigest()[:16]}"
    if out.exists():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
    for name, body in files.items():
        (tmp / name).write_text(json.dumps(body, indent=1))
    try:
        os.rename(tmp, out)
    except OSError:  # another worker wrote the same directory first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _files(vocab_size: int, max_positions: int, bos_id: int | None, eos_id: int | None,
           special: dict[str, str]) -> dict[str, dict]:
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    return {
        "config.json": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
                        "max_position_embeddings": max_positions, **ids},
        "generation_config.json": ids,
        # No tokenizer_class that adds BOS: the frontend's ids must equal the worker's own encode().
        "tokenizer_config.json": {"model_max_length": max_positions, "chat_template": CHAT_TEMPLATE, **special},
    }
