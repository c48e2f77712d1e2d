"""Attention calls shared by the blocks: SDPA with grouped-query k/v on every device (:func:`sdpa`), and attention over
packed sequences without a varlen kernel as one operator (:func:`varlen_sdpa`).

Why an operator for the packed fallback: the packed layout ([T, d], sequences end to end, pipeline/models/layers.py
``Varlen``) attends within each sequence. On CUDA, flash-attn's or torch's varlen kernel does that in one call; where
neither runs (the CPU, ``attn_backend: sdpa``) it is one SDPA call per sequence. Written as a Python loop over the
host lengths inside a block, the loop is part of the block: ``torch.compile`` unrolls it, guards on the number of
sequences and recompiles for every microbatch (8 graphs in 12 small batches, then eager). As
``bioseq::varlen_sdpa``, registered with ``torch.library.custom_op``, the loop runs inside one opaque operator that
reads ``cu_seqlens`` itself: the compiled block sees q, k, v [T, H, hd] and cu_seqlens [S + 1] of any size, and
a TorchDispatchMode counts one operator per attention call, as a varlen kernel makes one launch. The forward is
the per-sequence SDPA it replaces, value for value; the backward recomputes each sequence's softmax and applies the
attention gradient formulas in fp32 (equal to autograd through the loop up to rounding,
tests/pipeline/models/test_attention_ops.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# SDPA backends on CUDA: the memory-efficient and flash kernels, never cuDNN's. cuDNN builds an execution plan for
# every new (rows, length, grad mode) at 45-50 ms each, and the wavefront's core calls change their row count at every
# step: on one H200 those builds were 55 % of the step time (docs/performance.md). The memory-efficient kernel takes
# boolean masks and any shape without a build. The list is exclusive, so a call neither kernel takes fails loudly
# instead of falling back to the math kernel.
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, Hkv, L, hd] repeated to q's H heads, head j serving query heads j*g .. j*g + g-1 (SDPA's enable_gqa
    grouping), for kernels that take no grouped-query layout."""
    g = q.shape[1] // k.shape[1]
    return (k, v) if g == 1 else (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention with grouped-query k/v; on CUDA restricted to CUDA_SDPA_BACKENDS (k and v
    expanded to q's heads, which the memory-efficient kernel needs). q: [B, H, L, hd], k/v: [B, Hkv, L, hd]."""
    if q.is_cuda:
        k, v = expand_kv(q, k, v)
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)


def _sequences(cu_seqlens: torch.Tensor):
    """(start, end) of each nonempty sequence (host ints: the operator reads cu_seqlens itself)."""
    bounds = cu_seqlens.tolist()
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _one(q, k, v, a: int, b: int, causal: bool) -> torch.Tensor:
    """Attention of the sequence at tokens a:b: q [T, H, hd], k/v [T, Hkv, hd] -> [b - a, H, hd]."""
    qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, hd]
    return sdpa(qs, ks, vs, is_causal=causal)[0].transpose(0, 1)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
             causal: bool) -> torch.Tensor:
    out = torch.zeros_like(q)  # tokens outside every sequence (none, by construction) stay zero
    for a, b in _sequences(cu_seqlens):
        out[a:b] = _one(q, k, v, a, b, causal)
    return out


def _one_backward(grad, q, k, v, causal: bool):
    """The gradients of :func:`_one` for one sequence, in fp32 (an operator's implementation runs below autograd, so
    it cannot differentiate its own forward): with S = q k^T / sqrt(hd) (causal: -inf above the diagonal),
    P = softmax(S), O = P v: dv = P^T dO, dP = dO v^T, dS = P * (dP - rowsum(dP * P)), dq = dS k / sqrt(hd),
    dk = dS^T q / sqrt(hd); a KV head's gradients summed over the query heads it serves. grad, q: [n, H, hd];
    k, v: [n, Hkv, hd] -> (dq, dk, dv) in their dtypes."""
    n, H, hd = q.shape
    g = H // k.shape[1]
    qh, gh = q.transpose(0, 1).float(), grad.transpose(0, 1).float()  # [H, n, hd]
    kh, vh = (t.transpose(0, 1).float().repeat_interleave(g, dim=0) for t in (k, v))  # [H, n, hd]
    scale = hd ** -0.5
    s = qh @ kh.transpose(1, 2) * scale  # [H, n, n]
    if causal:
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    p = s.softmax(-1)
    dv = p.transpose(1, 2) @ gh
    dp = gh @ vh.transpose(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = ds @ kh * scale
    dk = ds.transpose(1, 2) @ qh * scale
    per_kv = lambda t: t.view(-1, g, n, hd).sum(1).transpose(0, 1)  # noqa: E731  [H, n, hd] -> [n, Hkv, hd]
    return dq.transpose(0, 1).to(q.dtype), per_kv(dk).to(k.dtype), per_kv(dv).to(v.dtype)


def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`_forward`, sequence by sequence (:func:`_one_backward`)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in _sequences(cu_seqlens):
        dq[a:b], dk[a:b], dv[a:b] = _one_backward(grad[a:b], q[a:b], k[a:b], v[a:b], causal)
    return dq, dk, dv


def _register():
    try:  # another copy of this module (an export's shipped code) registered it in this process already
        return torch.ops.bioseq.varlen_sdpa
    except (AttributeError, RuntimeError):
        pass
    fwd = torch.library.custom_op("bioseq::varlen_sdpa", _forward, mutates_args=())
    bwd = torch.library.custom_op("bioseq::varlen_sdpa_backward", _backward, mutates_args=())

    @fwd.register_fake
    def _(q, k, v, cu_seqlens, causal):
        return torch.empty_like(q)

    @bwd.register_fake
    def _(grad, q, k, v, cu_seqlens, causal):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, causal = inputs
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.causal = causal

    def backward(ctx, grad):
        q, k, v, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = torch.ops.bioseq.varlen_sdpa_backward(grad.contiguous(), q, k, v, cu_seqlens, ctx.causal)
        return dq, dk, dv, None, None

    fwd.register_autograd(backward, setup_context=setup_context)
    return torch.ops.bioseq.varlen_sdpa


_OP = _register()


def varlen_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                causal: bool = False) -> torch.Tensor:
    """Attention within each packed sequence, one SDPA call per sequence inside one operator (module docstring).
    q: [T, H, hd]; k/v: [T, Hkv, hd]; cu_seqlens: [S + 1] int32, sequence i at tokens cu[i]:cu[i + 1] (an empty
    sequence allowed) -> [T, H, hd]."""
    return _OP(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, bool(causal))
