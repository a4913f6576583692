"""hisparse: lossless tiered KV (GPU pages, pinned host, per-request hot buffers) for DSA decode."""

from hisparse.engine.llm import LLM, CompletionOutput, RequestOutput
from hisparse.engine.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
