"""``hisparse demo``: a random-weight DeepSeek-V3.2-architecture model, long prompts, a GPU pool
too small to hold them, and a check that every output equals an unconstrained run."""

from __future__ import annotations

import os
import random
import time

from hisparse.engine.llm import LLM
from hisparse.engine.sampling import SamplingParams

# vocab_size: DeepSeek-V3.2's, so DeepSeek's own tokenizer (written into the checkpoint) fits.
DEMO_CONFIG = dict(num_hidden_layers=3, index_topk=32, max_position_embeddings=4096,
                   vocab_size=129280)


def demo_checkpoint(cache_dir: str | None = None) -> str:
    """Build (once) and return the demo checkpoint directory: random weights plus DeepSeek's
    tokenizer and a chat template, so ``hisparse serve`` on it answers text and chat requests.
    A cached checkpoint from before the tokenizer is rebuilt."""
    from hisparse.models.random_checkpoint import make_random_checkpoint

    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "hisparse")
    path = os.path.join(cache_dir, "demo-deepseek_v32-random")
    if not all(os.path.exists(os.path.join(path, f))
               for f in ("config.json", "tokenizer.json", "tokenizer_config.json")):
        make_random_checkpoint(path, "deepseek_v32", seed=0, tokenizer=True, **DEMO_CONFIG)
    return path


def run_demo(num_prompts: int = 16, prompt_len: tuple[int, int] = (400, 700),
             max_tokens: int = 32, device: str | None = None, seed: int = 0,
             kv_cache_dtype: str = "auto") -> bool:
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts must be an integer >= 1, got {num_prompts!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    path = demo_checkpoint()
    print(f"Model: {path}\n  DeepSeek-V3.2 architecture (MLA + lightning indexer + MoE) with "
          "RANDOM weights: the text is meaningless; the point is the KV tiering and that "
          "outputs are lossless.")
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 384)
                                     for _ in range(rng.randrange(*prompt_len))]}
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    common = dict(device=device, dtype="float32", block_size=16, max_model_len=1024,
                  max_num_seqs=num_prompts, max_num_batched_tokens=512,
                  kv_cache_dtype=kv_cache_dtype)
    total_tokens = sum(len(p["prompt_token_ids"]) for p in prompts) + num_prompts * max_tokens
    gpu_blocks = 96  # ~1.5k token rows of GPU KV for ~10k tokens of live context
    print(f"\n{num_prompts} prompts of {prompt_len[0]}-{prompt_len[1]} tokens, {max_tokens} new "
          f"tokens each: {total_tokens} tokens of KV; HiSparse GPU pool: {gpu_blocks} blocks x 16 "
          f"= {gpu_blocks * 16} rows (index_topk 32, hot buffer 64 rows per request and layer).")
    t0 = time.perf_counter()
    llm = LLM(path, mode="hisparse", num_gpu_blocks=gpu_blocks, host_pool_gib=0.05, **common)
    outs = llm.generate(prompts, params, use_tqdm=True)
    t_hs = time.perf_counter() - t0
    stats = llm.stats()
    print(f"\nHiSparse run: {t_hs:.1f} s on {llm.device}")
    for key in ("peak_running", "host_read_switches", "spilled_pages", "lost_pages",
                "hot_hits", "hot_misses", "h2d_bytes", "d2h_bytes", "restored_pages",
                "prefix_hit_tokens", "num_preempted"):
        print(f"  {key:<20} {stats[key]}")
    print("\nUnconstrained run (GPU-only, a pool that holds everything) for comparison ...")
    ref = LLM(path, mode="gpu-only", **common)
    ref_outs = ref.generate(prompts, params, use_tqdm=True)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, ref_outs))
    ok = same == num_prompts
    print(f"\nOutputs identical to the unconstrained run: {same}/{num_prompts} "
          f"{'(lossless)' if ok else '(MISMATCH)'}")
    return ok
