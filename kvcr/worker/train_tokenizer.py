"""Train the small BPE tokenizer `kvcr worker` and the demo use (run once; the result is committed).

    python -m kvcr.worker.train_tokenizer            # writes kvcr/worker/assets/tokenizer.json

The corpus is this repository's own README and docs, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[2]
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus_files() -> list[str]:
    return [str(p) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.exists()]


def train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files(), trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", default=str(Path(__file__).parent / "assets" / "tokenizer.json"))
    args = parser.parse_args()
    train(args.vocab_size).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
