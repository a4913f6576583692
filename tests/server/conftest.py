import json
import os

import pytest

from hisparse.models.random_checkpoint import make_random_checkpoint

TOPK = 16
VOCAB = 384
CHAT_TEMPLATE = ("{% for m in messages %}t2 {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")


def write_word_tokenizer(path, vocab_size: int = VOCAB) -> None:
    """A real (WordLevel) tokenizer over the model's ids, built offline: token ``i`` is the word
    ``t<i>``, except 0 (``<s>``: bos, unk) and 1 (``</s>``: eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<s>",
                   "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
                   "model_max_length": 1024}, f)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = make_random_checkpoint(tmp_path_factory.mktemp("srv"), "deepseek_v32", seed=13,
                                  index_topk=TOPK, num_hidden_layers=2)
    write_word_tokenizer(path)
    return path


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_torch_thread):
    yield
