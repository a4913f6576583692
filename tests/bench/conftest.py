import importlib.util
import os

import pytest

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
