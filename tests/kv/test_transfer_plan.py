"""Descriptor plans of a KV transfer (pure numpy): coalesced runs, per-layer addresses."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hisparse.kv.transfer_plan import (
    RegionLayout,
    RemotePrefill,
    block_runs,
    run_descriptors,
    transfer_descriptors,
)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_block_runs_are_maximal_and_reassemble(pairs):
    src = [a for a, _ in pairs]
    dst = [b for _, b in pairs]
    runs = block_runs(src, dst)
    got_src = [s + i for s, _, n in runs for i in range(n)]
    got_dst = [d + i for _, d, n in runs for i in range(n)]
    assert got_src == src and got_dst == dst
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):   # no two runs could merge
        assert not (s1 == s0 + n0 and d1 == d0 + n0)


def test_one_descriptor_per_layer_and_run():
    local = RegionLayout(base=1000, layer_stride=10_000, block_bytes=100, num_layers=3,
                         num_blocks=50, mem="DRAM")
    remote = RegionLayout(base=7, layer_stride=20_000, block_bytes=100, num_layers=3,
                          num_blocks=90, mem="DRAM")
    ld, rd = transfer_descriptors(local, remote, [4, 5, 6, 9], [30, 31, 32, 33])
    assert ld.shape == rd.shape == (6, 3)   # runs (4..6 <- 30..32) and (9 <- 33), x 3 layers
    for layer in range(3):
        assert tuple(ld[2 * layer]) == (1000 + layer * 10_000 + 400, 300, 0)
        assert tuple(ld[2 * layer + 1]) == (1000 + layer * 10_000 + 900, 100, 0)
        assert tuple(rd[2 * layer]) == (7 + layer * 20_000 + 3000, 300, 0)
        assert tuple(rd[2 * layer + 1]) == (7 + layer * 20_000 + 3300, 100, 0)
    with pytest.raises(ValueError, match="exceed"):
        run_descriptors(local, np.array([49]), np.array([2]))
    with pytest.raises(ValueError, match="layouts differ"):
        transfer_descriptors(local, RegionLayout(0, 1, 64, 3, 9, "DRAM"), [0], [0])


def params(**over):
    kv = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
          "remote_block_ids": {"host": [3, 4]}, "remote_host": "127.0.0.1",
          "remote_port": 5000, "num_remote_tokens": 12, "first_token": 9,
          "compat_hash": "h", "remote_layout": {
              "host": RegionLayout(0, 10, 5, 1, 9, "DRAM").to_dict(),
              "host_indexer": RegionLayout(0, 10, 5, 1, 9, "DRAM").to_dict()}}
    kv.update(over)
    return kv


def test_remote_prefill_params_are_validated():
    rp = RemotePrefill.parse(params(), block_size=8)
    assert rp.host_blocks == (3, 4) and rp.num_tokens == 12 and rp.first_token == 9
    for over, field in [({"remote_block_ids": {"host": [3]}}, "cannot hold"),
                        ({"remote_port": 0}, "remote_port"),
                        ({"first_token": -1}, "first_token"),
                        ({"remote_engine_id": 5}, "remote_engine_id"),
                        ({"remote_layout": {"host": {}}}, "remote_layout.host: bad"),
                        ({"remote_layout": {"host": params()["remote_layout"]["host"]}},
                         "lacks 'host_indexer'"),
                        ({"remote_block_ids": {"host": [-1, 2]}}, "remote_block_ids")]:
        with pytest.raises(ValueError, match=field):
            RemotePrefill.parse(params(**over), block_size=8)
