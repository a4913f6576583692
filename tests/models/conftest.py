import os

import pytest
import torch

if not torch.cuda.is_available():
    # FP8 / MoE fast-path tests force Triton on CPU: the interpreter must be chosen before any
    # kernel module is imported (see tests/ops/conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_torch_thread):
    yield
