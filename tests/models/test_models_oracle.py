"""Oracle: our DSA model + DenseReferenceContext vs transformers' DeepseekV32 / GlmMoeDsa (fp32)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hisparse.models.context import DenseReferenceContext, materialize  # noqa: E402
from hisparse.models.loader import load_model  # noqa: E402
from hisparse.models.random_checkpoint import make_random_checkpoint  # noqa: E402

ARCH_OVERRIDES = {
    "deepseek_v32": dict(num_hidden_layers=3),
    # layers 1 and 3 reuse the previous full layer's top-k; layer 3 follows a full layer 2.
    "glm_moe_dsa": dict(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"]),
}
TOPK = 16


@pytest.fixture(scope="module", params=sorted(ARCH_OVERRIDES))
def pair(request, tmp_path_factory):
    arch = request.param
    path = make_random_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=7, index_topk=TOPK,
                                  **ARCH_OVERRIDES[arch])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, cfg = load_model(path, torch.float32)
    return arch, hf, ours, cfg


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g)


def _ours_logits(model, cfg, ids: torch.Tensor,
                 **ctx_kw) -> tuple[torch.Tensor, DenseReferenceContext]:
    ctx = DenseReferenceContext.from_config(cfg, **ctx_kw)
    pos = ctx.begin(["s"], [ids.numel()])
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, ctx)), ctx


def test_prompt_logits_match(pair):
    arch, hf, ours, cfg = pair
    ids = _prompt(64, cfg.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    out, _ = _ours_logits(ours, cfg, ids)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # non-degenerate random model: distinct greedy tokens and well-spread logits
    assert ref.std() > 0.3 and ref.argmax(-1).unique().numel() > 20


def test_indexer_selection_matches_transformers(pair):
    """Our top-k sets equal transformers' indexer output, layer by layer (shared layers reuse)."""
    arch, hf, ours, cfg = pair
    ids = _prompt(72, cfg.vocab_size, seed=2)
    captured = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda mod, args, out, i=i: captured.__setitem__(i, out[0].long())))
    try:
        with torch.no_grad():
            hf(ids[None])
    finally:
        for h in hooks:
            h.remove()
    _, ctx = _ours_logits(ours, cfg, ids)
    n = ids.numel()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    last_full = None
    for layer in range(cfg.num_layers):
        if cfg.layer_has_indexer(layer):
            assert layer in captured
            last_full = layer
            want = torch.zeros(n, n, dtype=torch.bool).scatter_(1, captured[layer], True) & causal
        else:
            assert (layer not in captured
                    and not hasattr(hf.model.layers[layer].self_attn.indexer, "wk"))
            want = (torch.zeros(n, n, dtype=torch.bool).scatter_(1, captured[last_full], True)
                    & causal)
        got = ctx.selections[layer]["s"]
        assert torch.equal(got, want), (f"layer {layer}: {int((got != want).sum())} "
                                        "selection mismatches")
        # sparsity is real: late tokens select exactly index_topk of their history
        assert int(got[-1].sum()) == TOPK and int(got[TOPK - 1].sum()) == TOPK


def test_sparsity_changes_the_output(pair):
    """The same model with an unbounded top-k (dense attention) gives different logits."""
    arch, hf, ours, cfg = pair
    ids = _prompt(64, cfg.vocab_size, seed=3)
    sparse, _ = _ours_logits(ours, cfg, ids)
    dense = DenseReferenceContext(cfg.num_layers, 10**6, cfg.kv_lora_rank,
                                  [cfg.layer_has_indexer(i) for i in range(cfg.num_layers)])
    pos = dense.begin(["s"], [ids.numel()])
    with torch.no_grad():
        dense_logits = ours.compute_logits(ours(ids, pos, dense))
    torch.testing.assert_close(sparse[:TOPK], dense_logits[:TOPK], rtol=1e-5, atol=1e-5)
    assert (sparse[TOPK:] - dense_logits[TOPK:]).abs().max() > 1e-2


def _greedy_ours(model, cfg, prompt: torch.Tensor, n_new: int) -> list[int]:
    ctx = DenseReferenceContext.from_config(cfg, record_selections=False)
    pos = ctx.begin(["s"], [prompt.numel()])
    out = []
    with torch.no_grad():
        h = model(prompt, pos, ctx)
        tok = int(model.compute_logits(h[-1:]).argmax(-1))
        out.append(tok)
        for _ in range(n_new - 1):
            pos = ctx.begin(["s"], [1])
            h = model(torch.tensor([tok]), pos, ctx)
            tok = int(model.compute_logits(h).argmax(-1))
            out.append(tok)
    return out


def test_greedy_generation_matches_transformers(pair):
    arch, hf, ours, cfg = pair
    prompt = _prompt(40, cfg.vocab_size, seed=4)
    n_new = 20
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, prompt.numel():].tolist()
    got = _greedy_ours(ours, cfg, prompt, n_new)
    assert got == ref
    assert len(set(got)) > 3  # not a degenerate repeat of one token


def test_batched_flat_forward_matches_separate(pair):
    """Two sequences of different lengths in one flat forward == separate runs; then mixed
    decode + chunked-prefill steps in one forward stay equal as well."""
    arch, hf, ours, cfg = pair
    a, b = _prompt(50, cfg.vocab_size, seed=5), _prompt(23, cfg.vocab_size, seed=6)
    sep_a, _ = _ours_logits(ours, cfg, a)
    sep_b, _ = _ours_logits(ours, cfg, b)

    ctx = DenseReferenceContext.from_config(cfg)
    pos = ctx.begin(["a", "b"], [50, 23])
    assert pos.tolist() == list(range(50)) + list(range(23))
    with torch.no_grad():
        both = ours.compute_logits(ours(torch.cat([a, b]), pos, ctx))
    torch.testing.assert_close(both[:50], sep_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[50:], sep_b, rtol=1e-5, atol=1e-5)

    # Step 2: "a" decodes one token while "b" prefills a chunk of 30 more; compare to one-shot runs.
    a2 = torch.cat([a, torch.tensor([11])])
    b2 = torch.cat([b, _prompt(30, cfg.vocab_size, seed=8)])
    pos = ctx.begin(["a", "b"], [1, 30])
    assert pos.tolist() == [50] + list(range(23, 53))
    with torch.no_grad():
        step = ours.compute_logits(ours(torch.cat([a2[50:], b2[23:]]), pos, ctx))
    full_a, _ = _ours_logits(ours, cfg, a2)
    full_b, _ = _ours_logits(ours, cfg, b2)
    torch.testing.assert_close(step[0], full_a[50], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step[1:], full_b[23:], rtol=1e-4, atol=1e-4)


def test_index_scores_equal_transformers_values(pair):
    """Folded ``index_weights`` reproduce transformers' index scores in value, not just in order."""
    import importlib

    arch, hf, ours, cfg = pair
    mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    ids = _prompt(30, cfg.vocab_size, seed=10)
    layer = 2  # a full layer in both architectures, past the dense-MLP layer
    idx_mod = hf.model.layers[layer].self_attn.indexer
    cap = {}
    hooks = [getattr(idx_mod, n).register_forward_hook(lambda m, a, o, n=n: cap.__setitem__(n, o))
             for n in ("wq_b", "k_norm", "weights_proj")]
    try:
        with torch.no_grad():
            hf(ids[None])
    finally:
        for h in hooks:
            h.remove()
    n, Hi, Di, r = ids.numel(), cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    cos, sin = hf.model.rotary_emb(cap["k_norm"], torch.arange(n)[None])
    q = cap["wq_b"].view(1, n, Hi, Di)
    k = cap["k_norm"].unsqueeze(2)
    rope = (mod.apply_rotary_pos_emb_interleave if cfg.indexer_rope_interleaved
            else mod.apply_rotary_pos_emb)
    q_rot, k_rot = rope(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., r:]], -1)[0]
    k = torch.cat([k_rot, k[..., r:]], -1)[0, :, 0]
    ref = torch.einsum("shd,td->sht", q.float(), k.float()).mul(Di ** -0.5).relu()
    ref = ((cap["weights_proj"][0].float() * Hi ** -0.5)[:, :, None] * ref).sum(1)    # [n, n]

    got = {}

    class Spy(DenseReferenceContext):
        def attend(self, layer_idx, q_latent, kv_new, index_q, index_weights, index_k_new,
                   sm_scale):
            if layer_idx == layer:
                got.update(q=index_q, w=index_weights, k=materialize(index_k_new))
            return super().attend(layer_idx, q_latent, kv_new, index_q, index_weights,
                                  index_k_new, sm_scale)

    ctx = Spy.from_config(cfg)
    with torch.no_grad():
        ours(ids, ctx.begin(["s"], [n]), ctx)
    assert got["w"].dtype == torch.float32 and got["w"].shape == (n, Hi)
    score = (got["w"][:, :, None] * torch.einsum("shd,td->sht", got["q"], got["k"]).relu()).sum(1)
    torch.testing.assert_close(score, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
