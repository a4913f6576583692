import os

# Without CUDA, one torch intra-op thread per test process (below) and one numpy BLAS thread (the
# Triton interpreter's; set before numpy loads): the models and kernel tiles are tiny, and the CI
# box runs two pytest-xdist workers on its two cores, where a second spinning thread per worker
# made torch ops up to 100x slower (measured: tests/worker/test_bucketed_eager.py, 0.8 s alone,
# 160 s next to another busy worker).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def single_torch_thread():
    """Tiny models: intra-op threading only adds contention on small CI machines."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    yield
