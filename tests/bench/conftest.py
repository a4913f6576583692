import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # benchmarks' kernel copies run under the interpreter here: chosen before triton.language is
    # imported (its own jit functions, tl.sum among them, are made then; tests/ops/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.fixture
def load_bench():
    """``load_bench(name)``: the module ``benchmarks/<name>.py`` (not a package: by path)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS,
                                                                         f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load
