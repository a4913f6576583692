"""Shared workload helpers of the engine tests (random prompts, output tokens)."""

from __future__ import annotations

import random


def prompts(n, lo, hi, vocab=384, seed=0):
    """``n`` prompts of ``lo..hi-1`` random token ids in ``[2, vocab)`` (deterministic)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(rng.randrange(lo, hi))]}
            for _ in range(n)]


def tokens(outs):
    """The output token ids of each ``RequestOutput``."""
    return [o.outputs[0].token_ids for o in outs]
