import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny models: intra-op threading only adds contention on small CI machines."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
