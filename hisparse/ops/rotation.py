"""The indexer rotation: the scaled Walsh-Hadamard transform applied to the lightning indexer's
keys and queries before their FP8 quantization.

DeepSeek-V3.2's reference (``inference/model.py``, ``Indexer.forward``: ``rotate_activation``,
i.e. ``fast_hadamard_transform.hadamard_transform(x, scale=d ** -0.5)`` on bf16) and SGLang's
DSA indexer (``nsa_indexer.py``, also serving GLM-5) rotate the whole ``d = 128`` head, RoPE
part included, after RoPE and before ``act_quant``, for the query and the key alike; the key
cache holds the rotated key's e4m3 values. The rotation is orthogonal, so ``(H q) . (H k) = q .
k`` exactly in real arithmetic; it spreads a key's outliers over all its values, so the one
power-of-two scale per 128 values loses less. transformers' bf16 models (no FP8) skip it, as
hisparse does for bf16 keys; vLLM's FP8 indexer does not rotate either.

Definition (the spec, :func:`indexer_rotation`)::

    indexer_rotation(x) = round_to(x.dtype, (H_d @ x.float()) * d ** -0.5)     (last dim)

``H_d`` Sylvester's ``d x d`` Hadamard matrix (``H[i, j] = (-1) ** popcount(i & j)``; symmetric,
``H @ H = d * I``), ``d`` a power of two. ``H_d @ x`` is computed as a fp32 butterfly, stages
``h = 1, 2, .., d / 2`` in that order, each mapping the pairs ``(x[i], x[i + h])`` (``i & h ==
0``) to ``(x[i] + x[i + h], x[i] - x[i + h])``; the scale multiplies last, then the value is
rounded to the input's dtype (bf16 in a bf16 model: what ``rotate_activation`` returns). The
Triton kernels run the same butterfly in the same order (``_quant_triton._hadamard``), so they
equal this bit for bit. Rotating twice gives ``x`` back up to that rounding (exactly for
``d = 4 ** m`` and inputs whose sums are exact: small integers).

Where it applies (:mod:`hisparse.ops.quant`, :mod:`hisparse.ops.indexer`): an FP8 indexer key
is the quantization of the rotated key (every writer rotates: the fused key write, the
quantize-and-write op); scoring against FP8 keys rotates the queries first (then quantizes them
on the FP8-query path). bf16 / fp32 keys are stored and scored unrotated.
"""

from __future__ import annotations

import torch

from ._common import check_rotation_dim


def indexer_rotation(x: torch.Tensor) -> torch.Tensor:
    """``x [..., d]`` (any float dtype, any device) -> the rotated ``[..., d]`` in ``x.dtype``
    (module docstring: butterfly in fp32, stages ``h = 1, 2, ..``, times ``d ** -0.5``)."""
    d = x.shape[-1]
    check_rotation_dim(d)
    n = x.numel() // d
    y = x.float().reshape(n, d)
    h = 1
    while h < d:
        y4 = y.view(n, d // (2 * h), 2, h)
        a, b = y4[:, :, 0], y4[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).view(n, d)
        h *= 2
    return (y * d ** -0.5).to(x.dtype).view(x.shape)
