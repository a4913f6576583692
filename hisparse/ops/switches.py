"""The kernel switches: every ``HISPARSE_*`` environment variable that picks an op's path.

This module is the one place that knows their names, allowed values and defaults. The ops read
:func:`current` (one attribute read per call, no ``os.environ`` lookup in a step). Unset or
empty means the default; any other value outside the allowed ones is a ``ValueError`` naming
the variable and its allowed values.

========================  ============================  ==========  ===========================
variable (field)          values                        default     what it picks
========================  ============================  ==========  ===========================
HISPARSE_FORCE_TRITON     ``0``, ``1``                  ``0``       Triton on CPU tensors too
(``force_triton``)                                                  (the interpreter tests)
HISPARSE_TOPK (``topk``)  fused, phased, legacy         fused       :mod:`~hisparse.ops.topk`'s
                                                                    launches
HISPARSE_TOPK_SHORT       ``0``, ``4096``, ``8192``     ``0``       column order's rows of at
(``topk_short``)                                                    most that many columns by
                                                                    one program a row
                                                                    (``TopkLaunch.short_rows``;
                                                                    no step gain measured)
HISPARSE_TOPK_ORDER       positions, ranked             positions   the engine's selection order:
(``topk_order``)                                                    ``positions`` ascending (no
                                                                    ranking pass; a forward that
                                                                    selects a hot policy's band
                                                                    ranks k + band, then counts
                                                                    its k into position order);
                                                                    ``ranked`` score order
HISPARSE_FUSED_GLUE       ``0``, ``1``                  ``1``       ``0``: every glue op runs its
(``fused_glue``)                                                    reference (``ops.glue``), the
                                                                    indexer's queries are roped
                                                                    and scaled before scoring and
                                                                    the top-k zeroes its scratch
HISPARSE_FUSED_SUMS       ``0``, ``1``                  ``1``       ``0``: split-K and MoE sums
(``fused_sums``)                                                    in their own launches, not
                                                                    in the next norm (``ops.
                                                                    pending``; bit-neutral)
HISPARSE_FUSED_MOE        ``0``, ``1``                  ``1``       ``0``: the MoE layer unfused
(``fused_moe``)                                                     (``ops.moe_layer``)
HISPARSE_MOE_ALIGN        experts, single               experts     the fused layer's alignment
(``moe_align``)
HISPARSE_MOE_QUANT        router, fused, gate_up,       router      where the fused FP8 layer
(``moe_quant``)           kernel                                    quantizes activations
HISPARSE_FP8_GEMM         auto, reference, triton,      auto        ``ops.gemm``'s backend (a
(``fp8_gemm``)            triton_stream, triton_tile,               call's ``backend=`` wins)
                          scaled_mm
HISPARSE_TRITON_AUTOTUNE  ``0``, ``1``                  ``1``       ``0``: the Triton GEMMs'
(``triton_autotune``)                                               first config (CUDA)
HISPARSE_FP8_INDEXER      ``0``, ``1``                  ``1``       ``0``: FP8 keys scored
(``fp8_indexer``)                                                   against unquantized queries
HISPARSE_ATTENTION        auto, triton, flashmla,       auto        a forced backend (CUDA,
(``attention``)           reference                                 ``backend="auto"`` calls)
HISPARSE_FP8_CONVERT      native, int                   native      the Triton FP8 attention's
(``fp8_convert``)                                                   e4m3 -> bf16: conversion
                                                                    instructions, or integer
                                                                    ones (the same bits)
========================  ============================  ==========  ===========================

**When they are read.** Once per process: on the first :func:`current`, and again by
:func:`reload`, which the engine calls when it starts (``hisparse.engine.startup``), before it
loads weights or captures CUDA graphs, and passes on to its tensor-parallel ranks (they
:func:`install` rank 0's switches, they do not parse their own environment). So a variable
changed while an engine runs changes nothing, eager or replayed; engines built one after
another in one process (tests, ``hisparse bench``) each follow the environment at their start.
The snapshot is per process, not per engine: engines alive at once in one process share the
switches of the last one started, so they must be started under the same environment.

Tests and benchmarks that switch paths inside one process use :func:`override` (a context
manager; it survives :func:`reload`, so an engine started inside it runs with it). What an
override is active around must also run inside it: an engine started inside an override and
stepped after it would mix paths. An override entered while an engine steps on another thread
(the async engine) or runs tensor-parallel ranks (they keep rank 0's switches of the start)
makes the ranks or the step's layers disagree: switch between steps, on the stepping thread,
with one rank. The engine logs a warning when it starts under switches that differ from those
of another engine still alive in the process.

Changed from the per-call reads this replaced: flags take ``0`` or ``1`` only (any other value
used to mean on for ``HISPARSE_FORCE_TRITON`` and off-unless-``0`` for the ``1``-default
flags; they are refused now), an empty ``HISPARSE_TRITON_AUTOTUNE`` is the default (on; it
used to turn autotuning off), an empty mode variable is its default, and a bad
``HISPARSE_TOPK`` is refused at engine start instead of at the first Triton top-k.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

TOPK_MODES = ("fused", "phased", "legacy")
TOPK_ORDERS = ("positions", "ranked")
MOE_ALIGN_MODES = ("experts", "single")
MOE_QUANT_MODES = ("router", "fused", "gate_up", "kernel")
FP8_GEMM_BACKENDS = ("auto", "reference", "triton", "triton_stream", "triton_tile", "scaled_mm")
ATTENTION_BACKENDS = ("auto", "triton", "flashmla", "reference")
FP8_CONVERT_MODES = ("native", "int")
TOPK_SHORT_ROWS = ("0", "4096", "8192")
FLAG_VALUES = ("0", "1")

# field -> (variable, allowed values: a mode tuple, or FLAG_VALUES for a bool field)
VARIABLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "force_triton": ("HISPARSE_FORCE_TRITON", FLAG_VALUES),
    "topk": ("HISPARSE_TOPK", TOPK_MODES),
    "topk_order": ("HISPARSE_TOPK_ORDER", TOPK_ORDERS),
    "topk_short": ("HISPARSE_TOPK_SHORT", TOPK_SHORT_ROWS),
    "fused_glue": ("HISPARSE_FUSED_GLUE", FLAG_VALUES),
    "fused_sums": ("HISPARSE_FUSED_SUMS", FLAG_VALUES),
    "fused_moe": ("HISPARSE_FUSED_MOE", FLAG_VALUES),
    "moe_align": ("HISPARSE_MOE_ALIGN", MOE_ALIGN_MODES),
    "moe_quant": ("HISPARSE_MOE_QUANT", MOE_QUANT_MODES),
    "fp8_gemm": ("HISPARSE_FP8_GEMM", FP8_GEMM_BACKENDS),
    "triton_autotune": ("HISPARSE_TRITON_AUTOTUNE", FLAG_VALUES),
    "fp8_indexer": ("HISPARSE_FP8_INDEXER", FLAG_VALUES),
    "attention": ("HISPARSE_ATTENTION", ATTENTION_BACKENDS),
    "fp8_convert": ("HISPARSE_FP8_CONVERT", FP8_CONVERT_MODES),
}


@dataclass(frozen=True)
class KernelSwitches:
    """One value per switch (module docstring's table); flags are bools, modes strings.
    Construction checks every field (``ValueError`` naming the field and its variable)."""

    force_triton: bool = False
    topk: str = "fused"
    topk_order: str = "positions"
    topk_short: str = "0"
    fused_glue: bool = True
    fused_sums: bool = True
    fused_moe: bool = True
    moe_align: str = "experts"
    moe_quant: str = "router"
    fp8_gemm: str = "auto"
    triton_autotune: bool = True
    fp8_indexer: bool = True
    attention: str = "auto"
    fp8_convert: str = "native"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            env, allowed = VARIABLES[f.name]
            v = getattr(self, f.name)
            if allowed is FLAG_VALUES:
                if not isinstance(v, bool):
                    raise ValueError(f"{f.name} ({env})={v!r}: want True or False")
            elif v not in allowed:
                raise ValueError(f"{f.name} ({env})={v!r}: want one of {allowed}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelSwitches:
        """The switches ``environ`` (default ``os.environ``) sets; a bad value is a
        ``ValueError`` ``"VARIABLE='value': want one of (...)"``."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, (env, allowed) in VARIABLES.items():
            raw = environ.get(env, "")
            if raw == "":
                continue
            if raw not in allowed:
                raise ValueError(f"{env}={raw!r}: want one of {allowed}")
            values[name] = raw == "1" if allowed is FLAG_VALUES else raw
        return cls(**values)


_base: KernelSwitches | None = None          # the environment's (reload) or rank 0's (install)
_overrides: list[dict[str, object]] = []     # active override() blocks, innermost last
_current: KernelSwitches | None = None       # _base with the overrides applied
_lock = threading.RLock()                    # the three above change together


def _apply() -> KernelSwitches:
    global _current
    with _lock:
        s = _base
        for changes in _overrides:
            s = dataclasses.replace(s, **changes)
        _current = s
        return s


def current() -> KernelSwitches:
    """The switches the ops follow now (the environment's, parsed on the first call)."""
    s = _current
    return s if s is not None else reload()


def reload() -> KernelSwitches:
    """Parse the environment again and follow it (active overrides still apply); returns the
    switches now current. The engine's start-up snapshot."""
    return install(KernelSwitches.from_env())


def install(switches: KernelSwitches) -> KernelSwitches:
    """Follow ``switches`` instead of the environment (a tensor-parallel rank: rank 0's)."""
    global _base
    if not isinstance(switches, KernelSwitches):
        raise TypeError(f"install: want KernelSwitches, got {type(switches).__name__}")
    with _lock:
        _base = switches
        return _apply()


@contextlib.contextmanager
def override(**changes: object) -> Iterator[KernelSwitches]:
    """Within the block, the given fields (``override(topk="phased", fused_glue=False)``) replace
    the environment's; checked before the block runs (an unknown field is a ``TypeError``, a
    bad value a ``ValueError``). Nests; :func:`reload` keeps it. Yields the switches."""
    dataclasses.replace(current(), **changes)       # check before anything changes
    with _lock:
        _overrides.append(changes)
        applied = _apply()
    try:
        yield applied
    finally:
        with _lock:
            del _overrides[next(i for i, c in enumerate(_overrides) if c is changes)]
            _apply()


def active_overrides() -> int:
    """How many :func:`override` blocks are open (tests check none leaks past a test)."""
    return len(_overrides)
