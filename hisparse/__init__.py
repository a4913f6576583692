"""hisparse: lossless tiered KV (GPU pages, pinned host, per-request hot buffers) for DSA decode.

The engine API is imported lazily (PEP 562), so ``import hisparse.kv`` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hisparse.engine.llm import LLM, CompletionOutput, RequestOutput
    from hisparse.engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_LAZY = {"LLM": "hisparse.engine.llm", "RequestOutput": "hisparse.engine.llm",
         "CompletionOutput": "hisparse.engine.llm", "SamplingParams": "hisparse.engine.sampling"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
