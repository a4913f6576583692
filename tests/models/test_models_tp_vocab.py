"""The vocabulary split of tensor parallelism (``hisparse.models.tp``): each rank's embedding and
``lm_head`` rows, the embedding's all-reduce and the logits' all-gather, against the whole
tables; two gloo ranks on CPU."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")

from hisparse.models.config import DSAConfig  # noqa: E402
from hisparse.models.dsa import DSAForCausalLM  # noqa: E402
from hisparse.models.random_checkpoint import make_hf_config  # noqa: E402
from hisparse.models.tp import (  # noqa: E402
    VocabShardEmbedding,
    VocabShardHead,
    _vocab_rows,
    shard_model_,
    vocab_shard_rows,
)

WORLD = 2
VOCAB = 383            # not a multiple of WORLD: the last shard holds one padding row


def _model(tied: bool) -> DSAForCausalLM:
    cfg = DSAConfig.from_hf(make_hf_config("deepseek_v32", vocab_size=VOCAB,
                                           tie_word_embeddings=tied).to_dict())
    torch.manual_seed(0)
    return DSAForCausalLM(cfg, dtype=torch.float32)


def _rank(rank: int, store_path: str, tied: bool, out_path: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank,
                            world_size=WORLD)
    try:
        full = _model(tied)
        model = shard_model_(_model(tied), rank, WORLD, dist.group.WORLD)
        g = torch.Generator().manual_seed(1)
        rows = vocab_shard_rows(VOCAB, WORLD)
        ids = torch.cat([torch.tensor([0, rows - 1, rows, VOCAB - 1]),
                         torch.randint(0, VOCAB, (60,), generator=g)])
        hidden = torch.randn(7, full.config.hidden_size, generator=g)
        with torch.no_grad():
            emb = model.model.embed_tokens(ids)
            logits = model.compute_logits(hidden)
            want_emb = full.model.embed_tokens(ids)
            want_logits = full.compute_logits(hidden)
        if rank == 0:
            torch.save({"emb": emb, "want_emb": want_emb, "logits": logits,
                        "want_logits": want_logits,
                        "head_is_embedding": model.lm_head.weight is
                        model.model.embed_tokens.weight,
                        "head_rows": tuple(model.lm_head.weight.shape)}, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_shards_give_the_whole_tables_embedding_and_logits(tmp_path, tied):
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_rank, args=(str(tmp_path / "store"), tied, out), nprocs=WORLD, join=True)
    r = torch.load(out)
    assert torch.equal(r["emb"], r["want_emb"])            # one rank contributes each row
    assert r["logits"].shape == r["want_logits"].shape == (7, VOCAB)
    torch.testing.assert_close(r["logits"], r["want_logits"], rtol=1e-5, atol=1e-5)
    assert r["head_rows"] == (vocab_shard_rows(VOCAB, WORLD), r["emb"].shape[1])
    assert r["head_is_embedding"] == tied


def test_vocab_rows_pad_the_last_shard_and_cover_the_table():
    w = torch.randn(10, 4)
    parts = [_vocab_rows(w, r, 3) for r in range(3)]
    assert [tuple(p.shape) for p in parts] == [(4, 4)] * 3
    assert torch.equal(torch.cat(parts)[:10], w) and not parts[2][2:].any()


def test_shards_refuse_to_run_without_their_group():
    emb = VocabShardEmbedding(torch.randn(4, 3), start=4)
    head = VocabShardHead(torch.randn(4, 3), vocab_size=8, world=2)
    with pytest.raises(RuntimeError, match="set_tp_group"):
        emb(torch.tensor([1, 5]))
    with pytest.raises(RuntimeError, match="set_tp_group"):
        head(torch.randn(2, 3))
