"""Incremental detokenization: every text extends the previous one and the last equals a full
decode (byte-level BPE with multi-byte characters split across tokens, and word-level)."""

from __future__ import annotations

import random

import pytest

from hisparse.engine.detokenizer import IncrementalDetokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

CORPUS = [
    "Sparse attention keeps long contexts cheap: 2048 rows of 131072.",
    "Les caches de clés et valeurs débordent vers la mémoire de l'hôte — naïvement ?",
    "稀疏注意力只读取被选中的行。长上下文解码需要更多内存。",
    "Emoji 🚀🔥 and symbols ∑ ∫ ≤ ≥ travel as several UTF-8 bytes each 🤖.",
    "def resolve(rows):\n    return [r for r in rows if r >= 0]  # -1 skips\n",
]


def byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel
                                  .alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def word_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = sorted({w for line in CORPUS for w in line.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("make", [byte_level_bpe, word_level], ids=["bpe", "word"])
@pytest.mark.parametrize("seed", range(4))
def test_streamed_texts_extend_each_other_and_end_at_the_full_decode(make, seed):
    tok = make()
    rng = random.Random(seed)
    text = " ".join(rng.sample(CORPUS, len(CORPUS)))
    ids = tok.encode(text)
    assert len(ids) > 20
    if make is byte_level_bpe:   # multi-byte characters really are split across tokens
        assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids)))
    detok = IncrementalDetokenizer(tok)
    seen, n = [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.randrange(1, 4))      # 1-3 new tokens per step
        seen.append(detok.update(ids[:n], final=n == len(ids)))
    for a, b in zip(seen, seen[1:]):
        assert b.startswith(a)
    assert seen[-1] == tok.decode(ids)
    assert "\ufffd" not in "".join(seen[:-1])          # incomplete characters are held back
    assert detok.prefix_offset <= detok.read_offset == len(ids)


def test_each_update_decodes_a_short_window():
    tok = byte_level_bpe()
    ids = tok.encode(" ".join(CORPUS * 8))
    calls = []
    real = tok.decode

    def counting(x, *a, **kw):
        calls.append(len(x))
        return real(x, *a, **kw)

    tok.decode = counting
    detok = IncrementalDetokenizer(tok)
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n], final=n == len(ids))
    assert detok.text == real(ids)
    assert max(calls[-200:]) < 16       # a few tokens, not the whole output


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_stay_out_of_the_text_unless_asked(skip):
    tok = byte_level_bpe()
    tok.add_special_tokens({"eos_token": "<|end|>"})
    ids = tok.encode("Sparse attention keeps long contexts cheap") + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    for n in range(1, len(ids) + 1):
        text = detok.update(ids[:n], final=n == len(ids))
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert text.endswith("<|end|>") != skip
