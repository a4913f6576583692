"""``LLM``'s arguments, checked on their own (before any file is read): :class:`EngineArgs`.

Every check raises a ValueError naming the field and its limit; what needs the checkpoint's
config (``max_model_len`` against the model, pool sizes) is checked by
:mod:`hisparse.engine.pool_sizing`.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from dataclasses import dataclass

import torch

from hisparse.config import Mode
from hisparse.engine.disagg import check_disagg_args
from hisparse.ops.resolve import HOT_POLICIES
from hisparse.worker.cache import KV_CACHE_DTYPES

# The deprecated ``hisparse=`` keyword's values.
HISPARSE_MODES = {True: Mode.HISPARSE, False: Mode.GPU_ONLY, "always-host": Mode.ALWAYS_HOST}

MAX_SPECULATIVE_TOKENS = 8


def is_int(v) -> bool:
    """An integer that is not a bool (numpy integers included)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_int(name: str, value, minimum: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}"
                         + (" or None" if optional else "") + f", got {value!r}")


def check_real(name: str, value, lo: float, hi: float, lo_open: bool = True) -> None:
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi)
    if not ok:
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], "
                         f"got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def resolve_mode(mode: Mode | str | None, hisparse: bool | str | None) -> Mode:
    """``mode`` (new) or the deprecated ``hisparse`` keyword, mapped once to a :class:`Mode`.
    The deprecation warning points at the caller of the caller (``LLM(...)``'s call site)."""
    if hisparse is not None:
        if mode is not None:
            raise ValueError("pass mode=... only (hisparse=... is its deprecated alias)")
        warnings.warn("LLM(hisparse=...) is deprecated: use mode='hisparse' | 'gpu-only' | "
                      "'always-host'", DeprecationWarning, stacklevel=3)
        if not isinstance(hisparse, (bool, str)) or hisparse not in HISPARSE_MODES:
            raise ValueError(f"hisparse must be True, False or 'always-host', got {hisparse!r}")
        return HISPARSE_MODES[hisparse]
    return Mode.HISPARSE if mode is None else Mode.parse(mode)


def parse_device(device) -> torch.device:
    """``None`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` of a
    device that exists."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine; "
                             "use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA "
                             "device(s) exist")
    return dev


@dataclass
class EngineArgs:
    """The arguments of one :class:`~hisparse.engine.llm.LLM` (its constructor documents them;
    the defaults live there), validated at construction: ``model`` becomes a ``str`` path of
    an existing directory and ``device`` a :class:`torch.device` that exists. ``mode`` is
    already resolved (:func:`resolve_mode`). Read-only after construction: values derived from
    the checkpoint (``max_model_len``'s default, pool sizes) live in the start-up plan."""

    model: str
    device: torch.device | str | None
    dtype: str | None
    block_size: int
    num_gpu_blocks: int | None
    host_pool_gib: float | str
    hot_buffer_size: int | None
    max_model_len: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    num_indexer_blocks: int | None
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    watermark_blocks: int | None
    load_format: str
    host_buffers: tuple[torch.Tensor, torch.Tensor] | None
    enforce_eager: bool
    mode: Mode
    runner_cls: object
    async_scheduling: bool
    kv_cache_dtype: str
    hot_policy: str
    tensor_parallel_size: int
    num_speculative_tokens: int
    staging_rows: int | None
    hot_prefetch_rows: int | None
    gc_freeze: bool
    kv_role: str | None
    kv_host: str
    kv_port: int | None
    kv_load_failure: str
    kv_load_timeout_s: float
    kv_hold_timeout_s: float

    def __post_init__(self) -> None:
        check_disagg_args(self.kv_role, self.kv_host, self.kv_port, self.kv_load_failure,
                          self.kv_load_timeout_s, self.kv_hold_timeout_s)
        kv_role, tp, k_spec = self.kv_role, self.tensor_parallel_size, self.num_speculative_tokens
        if kv_role is not None and self.mode == Mode.GPU_ONLY:
            raise ValueError(f"kv_role={kv_role!r} needs a host tier: mode 'hisparse' or "
                             f"'always-host', not 'gpu-only'")
        if kv_role is not None and tp > 1:
            raise ValueError(f"kv_role={kv_role!r} is not supported with "
                             f"tensor_parallel_size > 1 yet (only rank 0's caches are "
                             f"registered)")
        if self.hot_policy not in HOT_POLICIES:
            raise ValueError(f"hot_policy must be 'lru', 'score' or 'score+prefetch', "
                             f"got {self.hot_policy!r}")
        if not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a checkpoint directory path, got {self.model!r}")
        self.model = os.fspath(self.model)
        if not os.path.isdir(self.model):
            raise ValueError(f"model: no such checkpoint directory {self.model!r}")
        if self.dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        check_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        check_int("num_gpu_blocks", self.num_gpu_blocks, optional=True)
        check_int("hot_buffer_size", self.hot_buffer_size, optional=True)
        check_int("max_model_len", self.max_model_len, minimum=2, optional=True)
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("num_indexer_blocks", self.num_indexer_blocks, optional=True)
        check_int("watermark_blocks", self.watermark_blocks, minimum=0, optional=True)
        check_int("staging_rows", self.staging_rows, minimum=1, optional=True)
        check_int("hot_prefetch_rows", self.hot_prefetch_rows, minimum=0, optional=True)
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "gc_freeze"):
            check_bool(name, getattr(self, name))
        check_int("num_speculative_tokens", k_spec, minimum=0)
        if k_spec > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                             f"got {k_spec}")
        if k_spec >= self.block_size:
            raise ValueError(f"num_speculative_tokens ({k_spec}) must be < "
                             f"block_size ({self.block_size})")
        check_real("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0)
        if self.mode != Mode.GPU_ONLY and self.host_pool_gib != "auto":
            check_real("host_pool_gib", self.host_pool_gib, 0.0, math.inf)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        check_int("tensor_parallel_size", tp)
        if k_spec and tp > 1:
            raise ValueError("num_speculative_tokens > 0 is not supported with "
                             "tensor_parallel_size > 1 yet (the TP workers run the plain step)")
        self.device = parse_device(self.device)
        if tp > 1 and self.device.type == "cuda":
            first = self.device.index or 0
            if first + tp > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={tp} needs CUDA devices {first}.."
                                 f"{first + tp - 1}; only {torch.cuda.device_count()} exist")
