"""Host cost of building one streaming output per running request per step (CPU): copying every
request's prompt (what LLM.step() did until it shared the prompt list) against sharing it, at the
one-rank benchmark's largest point (147 requests x 32k-token prompts, 64 output tokens).

    python benchmarks/output_copy_cost.py
"""

import random
import time


def main() -> None:
    prompts = [[random.randrange(2, 120000) for _ in range(32768)] for _ in range(147)]
    toks = [p + [5] * 64 for p in prompts]
    t = time.perf_counter()
    for _ in range(20):
        [(list(p), list(tk[len(p):])) for p, tk in zip(prompts, toks)]
    print("copy prompt + outputs per step: %.2f ms" % ((time.perf_counter() - t) / 20 * 1e3))
    t = time.perf_counter()
    for _ in range(20):
        [(p, list(tk[len(p):])) for p, tk in zip(prompts, toks)]
    print("share prompt, copy outputs per step: %.3f ms" % ((time.perf_counter() - t) / 20 * 1e3))


if __name__ == "__main__":
    main()
