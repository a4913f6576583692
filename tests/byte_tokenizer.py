"""A byte-level BPE tokenizer for random checkpoints, built offline (tests of text and
structured output: every string is expressible, one token per byte)."""

import json
import os


def write_byte_tokenizer(path) -> None:
    """``<s>`` 0 (bos), ``</s>`` 1 (eos), then the 256 byte symbols (no merges); a chat
    template that joins the messages' contents with newlines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "model_max_length": 1024,
                   "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"},
                  f)
