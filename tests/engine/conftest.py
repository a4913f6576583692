import pytest

from hisparse.models.random_checkpoint import make_random_checkpoint

TOPK = 16


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_torch_thread):
    yield


@pytest.fixture(scope="session")
def dsv32_path(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("dsv32"), "deepseek_v32", seed=11,
                                  index_topk=TOPK, num_hidden_layers=3)


@pytest.fixture(scope="session")
def glm_path(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("glm"), "glm_moe_dsa", seed=12,
                                  index_topk=TOPK, num_hidden_layers=4,
                                  indexer_types=["full", "shared", "full", "shared"])
