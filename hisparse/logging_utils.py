"""Logging set-up for the command line and the server (the standard ``logging`` module).

Library code logs to the ``hisparse`` logger hierarchy and configures nothing; the CLI calls
:func:`setup_logging` once.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup_logging(debug: bool = False, level: str | None = None) -> None:
    """One stderr handler on the ``hisparse`` logger (INFO, DEBUG with ``debug``)."""
    logger = logging.getLogger("hisparse")
    lvl = logging.DEBUG if debug else getattr(logging, (level or "INFO").upper(), logging.INFO)
    logger.setLevel(lvl)
    if not any(getattr(h, "_hisparse", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler._hisparse = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.propagate = False


def set_cpu_threads(device: str | None, threads: int | None = None) -> int | None:
    """On CPU, set torch's intra-op threads to ``threads`` or a sane default (half the cores,
    at most 4: tiny decode steps lose more to contention than they gain from threads). Returns
    the count set, None on CUDA."""
    import os

    import torch

    if threads is None and (device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu":
        return None
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    n = threads if threads is not None else max(1, min(4, (os.cpu_count() or 2) // 2))
    torch.set_num_threads(n)
    return n
