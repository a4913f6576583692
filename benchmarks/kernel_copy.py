"""A kernel module of ``hisparse.ops`` loaded from another file or from edited source, beside
the package's own (benchmarks that time two versions of a kernel in one process)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from hisparse.bench import scratch_dir


def load_ops_module(name: str, path: str | Path | None = None,
                    text: str | None = None) -> ModuleType:
    """Module ``hisparse.ops.<name>`` from the file ``path``, or from ``text`` written to a
    temporary file (Triton reads a jit function's source from its file). Its relative imports
    resolve against this tree's package; it is registered in ``sys.modules`` (dataclasses look
    their module up there)."""
    if (path is None) == (text is None):
        raise ValueError("load_ops_module: give path or text")
    if text is not None:
        path = Path(scratch_dir("hisparse-kernel-")) / f"{name}.py"
        path.write_text(text)
    full = f"hisparse.ops.{name}"
    spec = importlib.util.spec_from_file_location(full, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "hisparse.ops"
    sys.modules[full] = mod
    spec.loader.exec_module(mod)
    return mod
