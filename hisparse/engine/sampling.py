"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, per-request seed)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Like vLLM's: ``temperature=0`` is greedy; ``top_k=-1`` and ``top_p=1`` disable those
    filters; ``seed`` makes one request's samples reproducible whatever its batch."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits [n, vocab]`` (fp32)."""
    if not params:
        return []
    tokens = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens
