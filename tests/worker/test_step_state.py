"""Persistent device step state: incremental table updates equal full uploads, row lists and
token inputs arrive intact, and buffers are never reallocated (CPU: same code, no pinning)."""

import numpy as np
import torch

from hisparse.config import KVCacheConfig
from hisparse.kv.plan import ChangedRows, RowCopy, ScheduledSeq, StepPlan
from hisparse.worker.step_state import StepState


def cfg():
    return KVCacheConfig(block_size=4, num_gpu_blocks=64, num_host_blocks=64,
                         num_indexer_blocks=64, max_model_len=40, index_topk=4,
                         hot_buffer_size=8, max_num_seqs=6, max_num_batched_tokens=16)


def random_plan(rng, prev, step):
    tables = {k: v.copy() for k, v in prev.items()}
    for t in tables.values():
        kind = rng.random()
        if kind < 0.5:                      # a few cells change
            for _ in range(rng.integers(0, 4)):
                t[rng.integers(t.shape[0]), rng.integers(t.shape[1])] = rng.integers(-1, 64)
        elif kind < 0.6:                    # a whole row is freed
            t[rng.integers(t.shape[0])] = -1
        elif kind < 0.62:                   # everything changes
            t[:] = rng.integers(-1, 64, size=t.shape)
    # What the KV core reports: every written row (a write of an equal value included), here
    # the rows that differ plus a few untouched ones.
    changed = {}
    for name, t in tables.items():
        rows = set(np.flatnonzero((t != prev[name]).any(axis=1)).tolist())
        rows.update(rng.choice(t.shape[0], rng.integers(0, 2), replace=False).tolist())
        changed[name] = np.array(sorted(rows), dtype=np.int64)

    def copy(n):
        return RowCopy(rng.integers(0, 256, n).astype(np.int64),
                       rng.integers(0, 256, n).astype(np.int64), step)
    plan = StepPlan(step, [], tables["resident"], tables["host"], tables["indexer"],
                    tables["hot"], ChangedRows(**changed),
                    hot_resets=rng.choice(6, rng.integers(0, 3), replace=False).astype(np.int32),
                    restores=copy(rng.integers(0, 5)),
                    indexer_restores=copy(rng.integers(0, 5)), mirrors=copy(rng.integers(0, 9)),
                    indexer_mirrors=copy(rng.integers(0, 9)))
    return plan, tables


def test_changed_rows_keep_device_tables_equal_to_plan_tables_over_thousands_of_plans():
    c = cfg()
    st = StepState(c, torch.device("cpu"), max_tokens=16)
    rng = np.random.default_rng(0)
    prev = {"resident": np.full((6, c.max_pages_per_request), -1, np.int32),
            "host": np.full((6, c.max_pages_per_request), -1, np.int32),
            "indexer": np.full((6, c.max_pages_per_request), -1, np.int32),
            "hot": np.full((6, c.hot_blocks_per_request), -1, np.int32)}
    ptrs = {k: v.data_ptr() for k, v in st.tables.items()}
    reported = 0
    for step in range(3000):
        plan, prev = random_plan(rng, prev, step)
        st.stage_plan(plan)
        for name in prev:
            assert np.array_equal(st.tables[name].numpy(), prev[name]), (step, name)
        reported += sum(r.size for r in vars(plan.changed_rows).values())
        assert st.hot_resets.tolist() == plan.hot_resets.tolist()
        for cname in ("restores", "indexer_restores", "mirrors", "indexer_mirrors"):
            src, dst = st.copies[cname]
            op = getattr(plan, cname)
            assert np.array_equal(src.numpy(), op.src_rows)
            assert np.array_equal(dst.numpy(), op.dst_rows)
    assert {k: v.data_ptr() for k, v in st.tables.items()} == ptrs
    assert st.rows_uploaded == reported               # only the reported rows travel


def test_token_inputs_padded_for_graph_buckets():
    st = StepState(cfg(), torch.device("cpu"), max_tokens=16)
    ptrs = (st.ids.data_ptr(), st.positions.data_ptr(), st.slots.data_ptr())
    seqs = [ScheduledSeq("a", 3, 10, 2, False, True), ScheduledSeq("b", 1, 0, 3, False, False),
            ScheduledSeq("c", 0, 7, 1, True, True)]
    T, S = st.stage_tokens(seqs, [5, 6, 7, 8, 9, 10], pad_to=8)
    assert (T, S) == (6, 2)
    assert st.ids[:8].tolist() == [5, 6, 7, 8, 9, 10, 0, 0]
    assert st.positions[:8].tolist() == [10, 11, 0, 1, 2, 7, 0, 0]
    assert st.slots[:8].tolist() == [3, 3, 1, 1, 1, 0, -1, -1]
    assert st.sample_idx[:2].tolist() == [1, 5]
    for _ in range(5):                                # staging alternates, buffers stay
        st.stage_tokens(seqs[:1], [1, 2], pad_to=4)
    assert st.slots[:4].tolist() == [3, 3, -1, -1]
    assert (st.ids.data_ptr(), st.positions.data_ptr(), st.slots.data_ptr()) == ptrs
