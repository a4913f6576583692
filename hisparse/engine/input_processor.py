"""A request's inputs, checked before anything is queued: :class:`InputProcessor` turns a
prompt (text or token ids) and its :class:`~hisparse.engine.sampling.SamplingParams` into the
token ids and the engine's own validated copy of the params, or raises a ValueError naming the
field (nothing is queued then)."""

from __future__ import annotations

import dataclasses

import torch

from hisparse.engine.core import EngineCore
from hisparse.engine.engine_args import is_int
from hisparse.engine.sampling import SamplingParams


class InputProcessor:
    """Validation against one engine: the model's vocabulary (``model_config``),
    ``max_model_len``, what ``core`` supports (speculative decoding refuses logprobs and
    structured output) and the ``tokenizer`` (``None``: token-id prompts only). The
    structured-output backend is built here at the first constrained request and kept in
    ``core.grammar`` (the core masks logits with it)."""

    def __init__(self, model_config, max_model_len: int, tokenizer, core: EngineCore,
                 max_num_seqs: int, device: torch.device) -> None:
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.core = core
        self.max_num_seqs = max_num_seqs
        self.device = device

    def process(self, prompt, params: SamplingParams | None
                ) -> tuple[str | None, list[int], SamplingParams]:
        """``(prompt text or None, prompt token ids, validated params)``."""
        text, ids = self.prompt_ids(prompt)
        return text, ids, self.check_request(ids, params)

    def prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """A text prompt (tokenized) or ``{"prompt_token_ids": [...]}`` as ``(text, ids)``."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer in the model directory; "
                                 "pass {'prompt_token_ids': [...]} instead")
            try:
                ids = list(self.tokenizer.encode(prompt))
            except Exception as e:  # noqa: BLE001 - the tokenizer's own error, reported
                raise ValueError(f"prompt: the tokenizer failed: {e}") from e
            return prompt, [int(t) for t in ids]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            raw = prompt["prompt_token_ids"]
            if hasattr(raw, "tolist"):
                raw = raw.tolist()
            if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {raw!r}")
            raw = list(raw)
            bad = [t for t in raw if not is_int(t)]
            if bad:
                raise ValueError(f"prompt_token_ids: token id {bad[0]!r} is not an integer")
            return None, [int(t) for t in raw]
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids'")

    def check_request(self, ids: list[int], params) -> SamplingParams:
        """Validate one request; return the engine's own validated copy of its params (bad
        words tokenized into ``bad_words_token_ids``, a grammar compiled: later a cache hit)."""
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: length {len(ids)} must be < max_model_len "
                             f"({self.max_model_len})")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        params = dataclasses.replace(params)   # re-validates fields mutated after construction
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        if params.logprobs is not None and self.core.num_speculative_tokens:
            raise ValueError("logprobs: not supported with num_speculative_tokens > 0 (the "
                             "verify step does not report them yet)")
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab})")
        words = list(params.bad_words_token_ids or [])
        bad = [t for w in words for t in w if t >= vocab]
        if bad:
            raise ValueError(f"bad_words_token_ids: token id {bad[0]} is outside the "
                             f"vocabulary [0, {vocab})")
        if params.bad_words:
            words += self._bad_word_ids(params.bad_words)
            params = dataclasses.replace(params, bad_words_token_ids=words, bad_words=None)
        if params.kv_transfer_params:
            # the prefill samples the first token without the grammar, and the decode side
            # adds it without its logprobs entry: refused until both carry across
            for name, given in (("structured_outputs", params.structured_outputs is not None),
                                ("logprobs", params.logprobs is not None)):
                if given:
                    raise ValueError(f"{name}: not supported with kv_transfer_params "
                                     "(prefill/decode disaggregation)")
        if params.structured_outputs is not None:
            if self.core.num_speculative_tokens:
                raise ValueError("structured_outputs: not supported with "
                                 "num_speculative_tokens > 0 (drafts are not run through the "
                                 "grammar)")
            self.grammar("structured_outputs").compile(params.structured_outputs)
        return params

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word alone and after a space (a word-start
        token often differs), without special tokens; the token sequences, deduplicated."""
        if self.tokenizer is None:
            raise ValueError("bad_words: needs a tokenizer in the model directory; use "
                             "bad_words_token_ids")
        vocab = self.model_config.vocab_size
        out: list[list[int]] = []
        for w in words:
            for text in (w, " " + w.lstrip()):
                ids = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
                if ids and ids not in out and all(t < vocab for t in ids):
                    out.append(ids)
        # same limits as token-id words (SamplingParams names them)
        return SamplingParams(bad_words_token_ids=out or None).bad_words_token_ids or []

    def grammar(self, field: str):
        """The structured-output backend (built at the first constrained request: xgrammar's
        tokenizer info over the engine's tokenizer); a ValueError naming ``field`` when it
        cannot be built."""
        if self.core.grammar is None:
            if self.tokenizer is None:
                raise ValueError(f"{field}: structured output needs a tokenizer in the model "
                                 "directory")
            try:
                from hisparse.engine.structured import GrammarBackend
            except ImportError as e:
                raise ValueError(f"{field}: structured output needs xgrammar (pip install "
                                 f"'hisparse[structured]'): {e}") from None
            self.core.grammar = GrammarBackend(
                self.tokenizer, self.model_config.vocab_size,
                sorted(self.model_config.eos_token_ids), self.max_num_seqs, self.device)
        return self.core.grammar
