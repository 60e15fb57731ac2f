"""A tiny random Llama (and a tiny MLA DeepSeek-V2) with a byte-level BPE tokenizer, built
locally (nothing downloaded).

One 16-token page of K and V is 2 layers x 2 KV heads x 16 dims x bf16 x 2 x 16 = 4096 bytes.
The tokenizer adds a BOS token, as Llama's does, so a router that forgets it cannot match.
"""

from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
VOCAB = 512
WORDS = ["cache", "page", "prefix", "router", "worker", "token", "block", "hint", "pull", "claim", "event",
         "store", "tier", "host", "peer", "model", "layer", "the", "a", "of", "and", "to", "is", "on"]


def _corpus(n: int = 2000) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice([".", "!", "?", "\n"]) for _ in range(n)]


def build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
# KV bytes per token of Llama-3-8B (32 layers x 8 KV heads x 128 dims x K,V x bf16 = 128 KiB), with
# a narrow residual stream so a CPU prefills it: for benchmarks, where transfer sizes must be real.
KV_LIKE_8B = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 32, "num_attention_heads": 8,
              "num_key_value_heads": 8, "head_dim": 128}


def build_model(directory: Path, *, seed: int = 0, shape: dict | None = None, max_tokens: int = 4096,
                init_std: float = 0.02) -> Path:
    """Write the model and tokenizer into `directory` (created); returns it. A larger `init_std`
    makes outputs sensitive to every prompt token (the demo's oracle needs that)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=max_tokens, bos_token_id=0, eos_token_id=1,
                         tie_word_embeddings=False, torch_dtype="bfloat16", initializer_range=init_std,
                         **(shape or TINY))
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


# A tiny DeepSeek-V2 (MLA: one latent KV row of kv_lora_rank + rope dims per token and layer,
# 16 x 2 x 48 x bf16 = 3072 bytes a page), every layer dense so no MoE kernel is needed.
MLA_TINY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "first_k_dense_replace": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
            "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}
MLA_PAGE_BYTES = 16 * 2 * (32 + 16) * 2
# Read by SGLang's DeepSeek code but not written by transformers 5 (its CPU rope wants a
# rope_scaling; yarn at factor 1 is plain rope).
_SGLANG_DEEPSEEK_KEYS = {"moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "scoring_func": "softmax",
                         "rope_theta": 10000.0,
                         "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 1.0, "beta_fast": 32,
                                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 4096}}


def build_mla_model(directory: Path, *, seed: int = 0, init_std: float = 0.3) -> Path:
    """Write a tiny MLA model (DeepSeek-V2 architecture) and the tokenizer into `directory`."""
    import json

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    config = DeepseekV2Config(vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                              tie_word_embeddings=False, torch_dtype="bfloat16", initializer_range=init_std,
                              **MLA_TINY)
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **_SGLANG_DEEPSEEK_KEYS}, indent=1))
    return directory


def prompt_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))
