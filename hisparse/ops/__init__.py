"""Data-plane ops of hisparse: each = PyTorch reference (the spec, any device) + Triton kernel
(CUDA, or the CPU interpreter with HISPARSE_FORCE_TRITON=1 and TRITON_INTERPRET=1) + dispatcher."""

from .attention import (
    flashmla_available,
    sparse_mla_attention,
    sparse_mla_attention_fp8,
    sparse_mla_attention_fp8_reference,
    sparse_mla_attention_reference,
)
from .copy import (
    copy_index_keys,
    copy_index_keys_reference,
    copy_rows,
    copy_rows_reference,
    gather_rows,
)
from .gemm import (
    dequantize_fp8_weight,
    fp8_block_linear,
    fp8_block_linear_reference,
    fp32_linear,
    quantize_fp8_act,
    quantize_fp8_weight,
)
from .glue import (
    add_rms_norm,
    mla_q_latent,
    resident_rows,
    rope_heads,
    write_index_keys,
    write_mla_rows,
)
from .indexer import IndexerQueries, IndexerWorkspace, indexer_topk, indexer_topk_reference
from .moe import fused_moe, fused_moe_reference, moe_align
from .quant import (
    FP8KeyLayout,
    dequantize_index_keys_reference,
    dequantize_mla_rows_reference,
    index_key_bytes,
    mla_row_bytes,
    quantize_index_keys_reference,
    quantize_mla_rows_reference,
    quantize_write_index_keys,
    quantize_write_mla_rows,
)
from .resolve import (
    ResolveWorkspace,
    prefetch_copy,
    prefetch_copy_reference,
    resolve_rows,
    resolve_rows_reference,
)
from .stage import stage_groups, stage_rows, stage_rows_reference, staging_union_size
from .topk import TopkLaunch, TopkScratch, orderable_keys, topk_select, topk_select_reference

__all__ = [
    "indexer_topk", "indexer_topk_reference", "IndexerWorkspace", "IndexerQueries",
    "topk_select", "topk_select_reference", "TopkScratch", "TopkLaunch", "orderable_keys",
    "resolve_rows", "resolve_rows_reference", "ResolveWorkspace", "prefetch_copy",
    "prefetch_copy_reference",
    "sparse_mla_attention", "sparse_mla_attention_reference", "flashmla_available",
    "copy_rows", "copy_rows_reference", "gather_rows", "copy_index_keys",
    "copy_index_keys_reference",
    "stage_rows", "stage_rows_reference", "stage_groups", "staging_union_size",
    "sparse_mla_attention_fp8", "sparse_mla_attention_fp8_reference",
    "quantize_write_mla_rows", "quantize_write_index_keys", "quantize_mla_rows_reference",
    "dequantize_mla_rows_reference", "quantize_index_keys_reference",
    "dequantize_index_keys_reference", "mla_row_bytes", "index_key_bytes", "FP8KeyLayout",
    "fp8_block_linear", "fp8_block_linear_reference", "fp32_linear", "quantize_fp8_act",
    "quantize_fp8_weight", "dequantize_fp8_weight", "fused_moe", "fused_moe_reference", "moe_align",
    "add_rms_norm", "write_mla_rows", "write_index_keys", "rope_heads", "mla_q_latent",
    "resident_rows",
]
