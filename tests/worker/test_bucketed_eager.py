"""Issue 21, the CPU side: a step's bits must not depend on whether it was captured.

On the H200 a captured decode (or speculative) step computes its batch padded to the graph's
bucket while an eager step of the same batch computed only its real rows; cuBLAS picks its
GEMM by the row count, so the two differed in the last bits, which flipped near-tie indexer
ranks and, through them, the ``score`` policy's victims: the graph runner's hot-buffer state
departed from the eager runner's (``test_spec_gpu`` k = 2 and ``test_cuda_graph_gpu``).

Here every linear layer gets a rounding that depends on its row count (as cuBLAS's does), and
the graphs run uncaptured (``capture=False``: the padded layout over the static buffers). An
eager runner that computes only the real rows departs from them (the hazard is real: this
part shows the check can fail); a bucketed eager runner, what ``enforce_eager`` builds on
CUDA, agrees bit for bit at every step: logits, hot keys, LRU order, flags and counters."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from hisparse import LLM, SamplingParams
from hisparse.models.random_checkpoint import make_random_checkpoint
from hisparse.worker.cache import KVCaches
from hisparse.worker.cuda_graph import DecodeGraphs
from hisparse.worker.model_runner import ModelRunner

pytest.importorskip("transformers")

HOT_STATE = ("hot_keys", "hot_lru", "hot_flags", "counters")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("bucketed"), "deepseek_v32", seed=21,
                                  index_topk=16, num_hidden_layers=2)


def row_count_rounding(model: nn.Module) -> None:
    """Every ``nn.Linear`` output gets a tiny perturbation that is a function of its value and
    of the number of rows computed (the real rows of a bucket see another M than alone)."""
    def hook(mod, inputs, out):
        m = inputs[0].reshape(-1, inputs[0].shape[-1]).shape[0]
        return out + 1e-3 * (m % 5) * torch.sin(out * 997.0)

    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_hook(hook)


def first_divergence(path, bucketed: bool) -> str | None:
    """Run a growing-then-shrinking decode workload through uncaptured graphs (score policy,
    forced spills) and, step by step, an eager runner over its own caches; the first
    difference, or None."""
    llm = LLM(path, device="cpu", dtype="float32", block_size=8, max_model_len=256,
              max_num_seqs=4, num_gpu_blocks=30, hot_buffer_size=32, host_pool_gib=0.02,
              max_num_batched_tokens=128, mode="hisparse", hot_policy="score")
    row_count_rounding(llm.model)
    runner = llm.runner
    assert runner.graphs is None                      # CPU default: no graphs
    graphs = runner.graphs = DecodeGraphs(runner, capture=False)
    mc = llm.model_config
    caches = KVCaches(llm.kv_config, llm.caches.geo, llm.device)
    caches.set_hot_policy(llm.caches.hot_policy)
    eager = ModelRunner(llm.model, caches, mc.index_topk, mc.kv_lora_rank, enforce_eager=True,
                        bucketed=bucketed)
    assert (eager.graphs is not None) == bucketed and (eager.graphs is None or
                                                       not eager.graphs.capture)
    real_execute = runner.execute
    seen = {"graph_steps": 0, "diff": None}

    def execute(plan, input_ids):
        want, _ = eager.execute(plan, input_ids)
        got, acks = real_execute(plan, input_ids)
        seen["graph_steps"] += graphs.supports(plan)
        if seen["diff"] is None:
            if not torch.equal(got, want):
                seen["diff"] = f"step {plan.step_id}: logits"
            for name in HOT_STATE:
                if seen["diff"] is None and not torch.equal(getattr(llm.caches, name),
                                                            getattr(caches, name)):
                    seen["diff"] = f"step {plan.step_id}: {name}"
        eager.drain()
        return got, acks

    runner.execute = execute
    runner.commit_sampled = lambda tokens: (ModelRunner.commit_sampled(runner, tokens),
                                            eager.commit_sampled(tokens))
    rng = random.Random(5)
    for wave in range(3):                             # the batch grows, shrinks, grows
        for _ in range(rng.randrange(2, 5) if wave != 1 else 1):
            ids = [rng.randrange(2, 384) for _ in range(rng.randrange(30, 70))]
            llm.add_request({"prompt_token_ids": ids},
                            SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 11),
                                           ignore_eos=True))
        for _ in range(rng.randrange(6, 12)):
            if llm.has_unfinished_requests() and seen["diff"] is None:
                llm.step()
    while llm.has_unfinished_requests() and seen["diff"] is None:
        llm.step()
    if seen["diff"] is not None:
        llm.shutdown()
        return seen["diff"]
    s = llm.stats()
    assert s["hot_misses"] > 0 and s["spilled_pages"] > 0 and seen["graph_steps"] >= 6
    llm.shutdown()
    return seen["diff"]


def test_unpadded_eager_departs_from_the_graph_layout(path):
    """The hazard: with row-count-dependent rounding, computing only the real rows is not the
    captured step (so the next test can fail)."""
    assert first_divergence(path, bucketed=False) is not None


def test_bucketed_eager_equals_the_graph_layout_bit_for_bit(path):
    assert first_divergence(path, bucketed=True) is None
