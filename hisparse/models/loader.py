"""Load an HF-format DSA checkpoint (config.json + safetensors) into :class:`DSAForCausalLM`.

Checkpoint names are transformers' names; ours are identical except:

- ``...self_attn.kv_b_proj.weight`` ``[H*(nope+v), R]`` -> ``w_uk [H, nope, R]`` and
  ``w_uv [H, v, R]``;
- routed experts may be stored per expert
  (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, the on-disk format) or fused
  (``mlp.experts.gate_up_proj`` / ``down_proj``, transformers' in-memory format); both fill
  our fused ``gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``;
- ``lm_head.weight`` may be absent when embeddings are tied.

MTP layers (``model.layers.{l}`` with ``l >= num_hidden_layers``) are skipped unless
``load_model(..., num_mtp_layers=n)`` asks for the first ``n`` (speculative decoding): then
``model.layers.{L+i}.{enorm,hnorm,eh_proj}`` -> ``mtp.{i}.*``, ``...shared_head.norm`` ->
``mtp.{i}.shared_head_norm``, the decoder-layer tensors (``self_attn``, ``mlp``, the two layer
norms) -> ``mtp.{i}.layer.*``; the MTP copies of ``embed_tokens`` and ``shared_head.head`` are
not read (the main embedding and ``lm_head`` are used, as DeepSeek shares them).

FP8 block-quantized checkpoints (``quantization_config: {quant_method: fp8, weight_block_size}``;
a ``weight`` in float8_e4m3fn with a ``weight_scale_inv`` companion): tensors the model keeps in
FP8 (see :mod:`hisparse.models.dsa`) are copied as they are, FP8 with their scales (never
materialised in bf16); a per-expert gate/up pair fills ``gate_up_proj`` and the gate and up
halves of ``gate_up_proj_scale_inv``. An FP8 tensor whose parameter is not FP8 (``kv_b_proj``,
or any tensor when the config carries no fp8 quantization_config) is dequantized; a bf16
tensor whose parameter is FP8 is block-quantized at load.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from contextlib import ExitStack

import torch
from safetensors import safe_open

from ..ops.gemm import FP8_DTYPE, cdiv, quantize_fp8_weight
from .config import DSAConfig, parse_dtype
from .dsa import DSAForCausalLM

log = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(
    r"^((?:model\.layers\.\d+|mtp\.\d+\.layer)\.mlp\.experts)\.(\d+)\."
    r"(gate_proj|up_proj|down_proj)\.weight$")
_MTP_LAYER_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight",
            "shared_head.norm.weight": "shared_head_norm.weight"}


def mtp_name(name: str, num_layers: int, num_mtp: int) -> str | None:
    """Our parameter name of checkpoint tensor ``name`` of a loaded MTP layer (``None``: not an
    MTP tensor we read, e.g. its ``embed_tokens`` / ``shared_head.head`` copies); ``name`` itself
    when it is not an MTP layer's."""
    m = _LAYER_RE.match(name)
    if not m or not num_layers <= int(m.group(1)) < num_layers + num_mtp:
        return name
    i, rest = int(m.group(1)) - num_layers, name[m.end():]
    if rest in _MTP_OWN:
        return f"mtp.{i}.{_MTP_OWN[rest]}"
    if rest.startswith(_MTP_LAYER_PARTS):
        return f"mtp.{i}.layer.{rest}"
    return None


class CheckpointError(ValueError):
    pass


class _TensorSource:
    """name -> tensor over one or many safetensors files."""

    def __init__(self, path: str, stack: ExitStack):
        index_file = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_file):
            with open(index_file) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors file (and no "
                                      f"model.safetensors.index.json) in {path}")
            weight_map = None
        self.handles = {}
        for fname in files:
            fpath = os.path.join(path, fname)
            if not os.path.exists(fpath):
                raise CheckpointError(f"shard {fname} listed in model.safetensors.index.json "
                                      f"is missing from {path}")
            self.handles[fname] = stack.enter_context(
                safe_open(fpath, framework="pt", device="cpu"))
        if weight_map is None:
            weight_map = {k: fname for fname, h in self.handles.items() for k in h.keys()}
        self.weight_map = weight_map

    def keys(self):
        return self.weight_map.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        return self.handles[self.weight_map[name]].get_tensor(name)


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    s = s[:rows, :cols]
    return w.float() * s


def _scale_float(s: torch.Tensor) -> torch.Tensor:
    """Block scales as fp32 (``ue8m0`` scales stored as bytes are ``2 ** (b - 127)``)."""
    if s.dtype == torch.uint8:
        return torch.exp2(s.float() - 127.0)
    return s.float()


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))


def load_state(model: DSAForCausalLM, get: Callable[[str], torch.Tensor], names, *,
               fp8_block: tuple[int, int] = (128, 128)) -> None:
    """Fill every parameter of ``model`` from checkpoint tensors ``get(name)``; ``names`` lists
    the available names. Raises :class:`CheckpointError` naming what is missing or mis-shaped."""
    num_mtp = len(getattr(model, "mtp", ()))
    if num_mtp:     # read the loaded MTP layers' tensors under our names
        ours = {}
        for n in names:
            o = mtp_name(n, model.config.num_layers, num_mtp)
            if o is not None:
                ours[o] = n
        raw_get = get

        def get(name: str) -> torch.Tensor:
            return raw_get(ours.get(name, name))

        names = ours.keys()
    loader = _StateLoader(model, get, set(names), fp8_block)
    experts = loader.load_plain_tensors()
    loader.load_experts(experts)
    loader.check_complete()


class _StateLoader:
    """The sections of :func:`load_state`: plain tensors (and the split ``kv_b_proj``), fused
    routed experts, and the completeness check."""

    def __init__(self, model: DSAForCausalLM, get: Callable[[str], torch.Tensor],
                 names: set[str], fp8_block: tuple[int, int]) -> None:
        self.cfg = model.config
        self.get = get
        self.names = names
        self.fp8_block = fp8_block
        self.params = dict(model.named_parameters())
        self.filled: set[str] = set()
        self.used: set[str] = set()

    def read(self, name: str) -> torch.Tensor:
        """One checkpoint tensor, FP8 block-dequantized when it has a scale companion."""
        t = self.get(name)
        self.used.add(name)
        if t.dtype in (getattr(torch, "float8_e4m3fn", None),
                       getattr(torch, "float8_e5m2", None)):
            sname = name + "_scale_inv"
            if sname not in self.names:
                raise CheckpointError(f"{name} is FP8 but {sname} is missing")
            self.used.add(sname)
            t = _dequant_fp8(t, _scale_float(self.get(sname)), self.fp8_block)
        return t

    def read_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One checkpoint weight as (float8_e4m3fn, fp32 scale_inv): as stored when FP8,
        block-quantized here otherwise."""
        t = self.get(name)
        self.used.add(name)
        if t.dtype == FP8_DTYPE:
            sname = name + "_scale_inv"
            if sname not in self.names:
                raise CheckpointError(f"{name} is FP8 but {sname} is missing")
            self.used.add(sname)
            return t, _scale_float(self.get(sname))
        if _is_fp8(t):
            t = self.read(name)
        return quantize_fp8_weight(t, self.fp8_block)

    def put_fp8(self, ours: str, q: torch.Tensor, s: torch.Tensor, src: str) -> None:
        """Copy an FP8 weight and its scales into ``ours`` / ``ours + "_scale_inv"``."""
        self.put(ours, q, src)
        self.put(ours + "_scale_inv", s, src + "_scale_inv")

    def put(self, ours: str, t: torch.Tensor, src: str) -> None:
        p = self.params.get(ours)
        if p is None:
            raise CheckpointError(f"checkpoint tensor {src} maps to {ours}, "
                                  "which the model does not have")
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{src}: shape {tuple(t.shape)} does not match {ours} "
                                  f"{tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        self.filled.add(ours)

    def load_plain_tensors(self) -> dict[str, dict[int, dict[str, str]]]:
        """Every non-expert tensor; returns per-expert tensor names grouped by MoE prefix."""
        cfg = self.cfg
        experts: dict[str, dict[int, dict[str, str]]] = {}
        for name in sorted(self.names):
            if name.endswith("_scale_inv") or name in self.used:
                continue
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= cfg.num_layers:
                continue  # MTP (next-n prediction) layers
            if "rotary_emb" in name:
                continue
            em = _EXPERT_RE.match(name)
            if em:
                experts.setdefault(em.group(1), {}).setdefault(
                    int(em.group(2)), {})[em.group(3)] = name
            elif name.endswith("self_attn.kv_b_proj.weight"):
                self.load_kv_b_proj(name)
            elif name in self.params and self.params[name].dtype == FP8_DTYPE:
                self.load_fp8_param(name)
            elif name in self.params:
                self.put(name, self.read(name), name)
            elif not (name == "lm_head.weight" and cfg.tie_word_embeddings):
                log.warning("ignoring checkpoint tensor %s (no such parameter)", name)
        return experts

    def load_fp8_param(self, name: str) -> None:
        """An FP8 parameter from a checkpoint tensor of the same name (fused ``gate_up_proj``
        from a bf16 checkpoint: gate and up halves quantized separately)."""
        if name.endswith("experts.gate_up_proj") and not _is_fp8(self.get(name)):
            t = self.read(name)
            I = t.shape[-2] // 2
            gq, gs = quantize_fp8_weight(t[..., :I, :], self.fp8_block)
            uq, us = quantize_fp8_weight(t[..., I:, :], self.fp8_block)
            self.put_fp8(name, torch.cat([gq, uq], -2), torch.cat([gs, us], -2), name)
            return
        q, s = self.read_fp8(name)
        self.put_fp8(name, q, s, name)

    def load_kv_b_proj(self, name: str) -> None:
        """``kv_b_proj [H*(nope+v), R]`` -> our absorbed ``w_uk`` and ``w_uv``."""
        cfg = self.cfg
        base = name[: -len("kv_b_proj.weight")]
        H, nope, v, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        w = self.read(name)
        if tuple(w.shape) != (H * (nope + v), R):
            raise CheckpointError(f"{name}: shape {tuple(w.shape)} does not match "
                                  f"({H}*({nope}+{v}), {R})")
        w = w.view(H, nope + v, R)
        self.put(base + "w_uk", w[:, :nope], name)
        self.put(base + "w_uv", w[:, nope:], name)

    def load_experts(self, experts: dict[str, dict[int, dict[str, str]]]) -> None:
        """Per-expert on-disk tensors into our fused ``gate_up_proj`` / ``down_proj``."""
        E = self.cfg.n_routed_experts
        for prefix, per_expert in experts.items():
            missing = [f"{prefix}.{e}.{k}.weight" for e in range(E)
                       for k in ("gate_proj", "up_proj", "down_proj")
                       if k not in per_expert.get(e, {})]
            if missing:
                raise CheckpointError(f"missing expert tensors: {missing[:8]}"
                                      + (f" (+{len(missing) - 8} more)"
                                         if len(missing) > 8 else ""))
            gu = self.params.get(prefix + ".gate_up_proj")
            down = self.params.get(prefix + ".down_proj")
            if gu is None:
                raise CheckpointError(f"{prefix}.*: the model has no routed experts there "
                                      "(dense layer?)")
            with torch.no_grad():
                if gu.dtype == FP8_DTYPE:
                    self.fill_fp8_experts(prefix, per_expert, gu, down)
                else:
                    for e in range(E):
                        g, u, d = (self.read(per_expert[e][k])
                                   for k in ("gate_proj", "up_proj", "down_proj"))
                        gu[e].copy_(torch.cat([g, u], dim=0).to(gu.dtype))
                        down[e].copy_(d.to(down.dtype))
            self.filled.update({prefix + ".gate_up_proj", prefix + ".down_proj"})

    def fill_fp8_experts(self, prefix: str, per_expert: dict[int, dict[str, str]],
                         gu: torch.Tensor, down: torch.Tensor) -> None:
        """Per-expert FP8 tensors (and scales) into the fused FP8 experts, expert by expert."""
        gus = self.params[prefix + ".gate_up_proj_scale_inv"]
        dns = self.params[prefix + ".down_proj_scale_inv"]
        I = down.shape[-1]
        nbi = cdiv(I, self.fp8_block[0])
        for e in range(gu.shape[0]):
            parts = {k: self.read_fp8(per_expert[e][k])
                     for k in ("gate_proj", "up_proj", "down_proj")}
            for k, (q, s) in parts.items():
                if k == "down_proj":
                    want, swant = tuple(down.shape[1:]), tuple(dns.shape[1:])
                else:
                    want, swant = (I, gu.shape[-1]), (nbi, gus.shape[-1])
                if tuple(q.shape) != want or tuple(s.shape) != swant:
                    raise CheckpointError(f"{per_expert[e][k]}: shape {tuple(q.shape)} / scale "
                                          f"{tuple(s.shape)} does not match {want} / {swant}")
            (gq, gs), (uq, us), (dq, ds) = (parts[k]
                                            for k in ("gate_proj", "up_proj", "down_proj"))
            gu[e, :I].copy_(gq)
            gu[e, I:].copy_(uq)
            gus[e, :nbi].copy_(gs)
            gus[e, nbi:].copy_(us)
            down[e].copy_(dq)
            dns[e].copy_(ds)
        self.filled.update({prefix + ".gate_up_proj_scale_inv", prefix + ".down_proj_scale_inv"})

    def check_complete(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.filled.add("lm_head.weight")  # shares the embedding tensor
        missing = sorted(set(self.params) - self.filled)
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s) for: "
                                  f"{missing[:10]}" + (" ..." if len(missing) > 10 else ""))


def load_config(path: str) -> DSAConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise CheckpointError(f"no config.json in {path}")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: cannot read it as JSON: {e}") from e
    try:
        return DSAConfig.from_hf(raw)
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e


def model_bytes(cfg: DSAConfig, dtype: torch.dtype | str | None = None,
                num_mtp_layers: int = 0) -> int:
    """Bytes of the parameters and buffers :func:`load_model` puts on the device for ``cfg``
    (built on the meta device: nothing is allocated)."""
    dtype = parse_dtype(dtype, "dtype") if dtype is not None else cfg.dtype
    with torch.device("meta"):
        model = DSAForCausalLM(cfg, dtype=dtype, num_mtp_layers=num_mtp_layers)
    return sum(t.numel() * t.element_size()
               for t in (*model.parameters(), *model.buffers()))


def load_model(path: str, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu",
               load_format: str = "auto",
               config: DSAConfig | None = None,
               num_mtp_layers: int = 0) -> tuple[DSAForCausalLM, DSAConfig]:
    """Build our model from an HF-format directory; ``dtype`` defaults to the config's dtype.

    ``load_format="dummy"`` reads only config.json and initialises random weights on ``device``
    (benchmarks of production geometry without a checkpoint, like vLLM's dummy format).
    ``config``: the already parsed config.json (skips reading it again).
    ``num_mtp_layers``: also load the first MTP layers (``model.mtp``; speculative decoding).
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    cfg = config if config is not None else load_config(path)
    dtype = parse_dtype(dtype, "dtype") if dtype is not None else cfg.dtype
    if load_format == "dummy":
        with torch.device(device):
            model = DSAForCausalLM(cfg, dtype=dtype, num_mtp_layers=num_mtp_layers)
        return model.requires_grad_(False).eval(), cfg
    with torch.device("meta"):
        model = DSAForCausalLM(cfg, dtype=dtype, num_mtp_layers=num_mtp_layers)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    block = cfg.fp8_block or tuple((cfg.quantization_config or {}).get("weight_block_size",
                                                                       (128, 128)))
    with ExitStack() as stack:
        src = _TensorSource(path, stack)
        load_state(model, src.get, src.keys(), fp8_block=block)
    model.requires_grad_(False)
    model.eval()
    return model, cfg
