import pytest


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_torch_thread):
    yield
