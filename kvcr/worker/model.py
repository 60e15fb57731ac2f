"""A small decoder-only transformer in torch on the CPU, random weights from a fixed seed.

Prefill always runs in page-aligned chunks, so a page's K/V is computed by the same operations
whoever computes it: K/V pulled from a peer then give bitwise the logits a local run would.
"""

from __future__ import annotations

import math

import torch

from .options import ModelConfig

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V, each [tokens, hidden]


class TinyLM:
    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden {cfg.hidden} is not a multiple of heads {cfg.heads}")
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        h = cfg.hidden

        def weight(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * scale

        self.embed = weight(cfg.vocab_size, h, scale=1.0)
        self.pos = weight(cfg.max_positions, h, scale=0.1)
        self.blocks = [(weight(h, 3 * h, scale=h ** -0.5), weight(h, h, scale=h ** -0.5),
                        weight(h, 4 * h, scale=h ** -0.5), weight(4 * h, h, scale=(4 * h) ** -0.5))
                       for _ in range(cfg.layers)]
        self.unembed = weight(h, cfg.vocab_size, scale=h ** -0.5)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        t, s, nh = q.shape[0], k.shape[0], self.cfg.heads
        hd = self.cfg.hidden // nh
        q, k, v = (x.view(x.shape[0], nh, hd).transpose(0, 1) for x in (q, k, v))
        scores = q @ k.transpose(1, 2) / math.sqrt(hd)
        causal = torch.arange(s).unsqueeze(0) > (start + torch.arange(t)).unsqueeze(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        return (probs @ v).transpose(0, 1).reshape(t, self.cfg.hidden)

    @torch.inference_mode()
    def forward(self, tokens: list[int], start: int, past: KV | None) -> tuple[torch.Tensor, KV]:
        """Logits [len(tokens), vocab] for tokens at positions start.., and the K/V including them."""
        if start + len(tokens) > self.cfg.max_positions:
            raise ValueError(f"{start + len(tokens)} tokens exceed the model's {self.cfg.max_positions} positions")
        ids = torch.tensor(tokens, dtype=torch.long)
        x = self.embed[ids] + self.pos[start:start + len(tokens)]
        kv: KV = []
        for i, (wqkv, wo, w1, w2) in enumerate(self.blocks):
            q, k, v = (self._norm(x) @ wqkv).split(self.cfg.hidden, dim=-1)
            if past is not None:
                k, v = torch.cat([past[i][0], k]), torch.cat([past[i][1], v])
            kv.append((k, v))
            x = x + self._attend(q, k, v, start) @ wo
            x = x + torch.nn.functional.gelu(self._norm(x) @ w1) @ w2
        return self._norm(x) @ self.unembed, kv

    def prefill(self, tokens: list[int], page_size: int, past: KV | None = None, start: int = 0
                ) -> tuple[torch.Tensor, KV]:
        """Page-aligned chunked prefill of tokens[start:] over `past` (which covers tokens[:start])."""
        if start % page_size:
            raise ValueError(f"a prefill resumes on a page boundary, not at token {start}")
        logits = None
        kv = past
        for lo in range(start, len(tokens), page_size):
            logits, kv = self.forward(tokens[lo:lo + page_size], lo, kv)
        if logits is None:
            raise ValueError("nothing to prefill: the cached prefix covers every token")
        return logits[-1], kv


def pack_pages(kv: KV, first: int, count: int, page_size: int) -> torch.Tensor:
    """Pages [first, first+count) as one contiguous [count, layers, 2, page_size, hidden] tensor."""
    lo, hi = first * page_size, (first + count) * page_size
    stacked = torch.stack([torch.stack([k[lo:hi], v[lo:hi]]) for k, v in kv])  # [L, 2, T, H]
    layers, _, _, hidden = stacked.shape
    return stacked.view(layers, 2, count, page_size, hidden).permute(2, 0, 1, 3, 4).contiguous()


def unpack_pages(pages: torch.Tensor) -> KV:
    """The inverse of pack_pages: [count, L, 2, P, H] back to per-layer K/V of count*P tokens."""
    count, layers, _, page_size, hidden = pages.shape
    flat = pages.permute(1, 2, 0, 3, 4).reshape(layers, 2, count * page_size, hidden)
    return [(flat[i, 0], flat[i, 1]) for i in range(layers)]
