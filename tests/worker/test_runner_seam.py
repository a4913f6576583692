"""The worker's one extension seam, ``LLM(runner_cls=...)``: the benchmark's synthetic-prefill
runner and top-k override run through it on CPU, with only the public engine API."""

import pytest
import torch

from hisparse import LLM, SamplingParams
from hisparse.bench.synthetic import TokenClock, synthetic_runner
from hisparse.models.random_checkpoint import make_random_checkpoint
from hisparse.worker.model_runner import ModelRunner, PagedContext

TOPK = 16


@pytest.fixture(scope="module")
def path(tmp_path_factory, single_torch_thread):
    return make_random_checkpoint(tmp_path_factory.mktemp("seam"), "deepseek_v32", seed=3,
                                  index_topk=TOPK, num_hidden_layers=2)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_synthetic_runner_through_the_public_api(path, kv_cache_dtype):
    clock = TokenClock()
    calls = []

    def override(layer, token_slot, positions, computed):
        calls.append(layer)
        assert computed.shape == (token_slot.shape[0], TOPK)
        return computed          # same selection: outputs stay those of the real indexer

    llm = LLM(path, device="cpu", block_size=8, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, mode="always-host", host_pool_gib=0.01,
              hot_buffer_size=32, kv_cache_dtype=kv_cache_dtype,
              runner_cls=synthetic_runner(clock=clock, topk_override=override))
    assert type(llm.runner).__name__ == "SyntheticPrefillRunner"
    assert isinstance(llm.runner, ModelRunner) and isinstance(llm.runner.ctx, PagedContext)
    llm.capture_cuda_graphs()   # no graphs on CPU: a no-op
    ids = [llm.add_request({"prompt_token_ids": list(range(2, 2 + n))},
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
           for n in (40, 57, 23)]
    done = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            done[out.request_id] = out
    assert set(done) == set(ids)
    for r in ids:
        assert len(done[r].outputs[0].token_ids) == 5
        assert len(clock.times[r]) == 5 and clock.times[r] == sorted(clock.times[r])
    assert calls and set(calls) == {0, 1}


def test_default_runner_is_model_runner(path):
    llm = LLM(path, device="cpu", block_size=8, max_model_len=64, max_num_seqs=2,
              mode="gpu-only")
    assert type(llm.runner) is ModelRunner
    out = llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert torch.equal(llm.caches.counters[2], torch.zeros((), dtype=torch.int64))
