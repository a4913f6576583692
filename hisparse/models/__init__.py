"""DSA models (DeepSeek-V3.2, GLM-5): config, our model, the attention-context contract, loader."""

from .config import SUPPORTED_ARCHITECTURES, DSAConfig
from .context import DenseReferenceContext, SparseAttentionContext
from .dsa import DSAForCausalLM
from .linear import FP8Linear
from .loader import CheckpointError, load_model

__all__ = [
    "SUPPORTED_ARCHITECTURES", "DSAConfig", "DenseReferenceContext", "SparseAttentionContext",
    "DSAForCausalLM", "FP8Linear", "CheckpointError", "load_model",
]
