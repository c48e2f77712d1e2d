"""layers.flash_varlen (the flash-attn path of layers.attend) on CPU, through a stand-in for flash-attn's kernel.

flash-attn builds only against CUDA, so on CPU hosts its varlen kernel is replaced by ``varlen_attention_stand_in``:
the same attention computed directly per sequence. Everything around the kernel (unpadding, cu_seqlens, the scatter
back to [B, H, L, hd], the zero-token case) is then the production code. ``use_cpu_flash`` is also imported by
test_wavefront.py.
"""
import math

import pytest
import torch

from pipeline.models import layers


def varlen_attention_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                              softmax_scale=None, causal=False):
    """flash_attn_varlen_func's contract on CPU: softmax attention within each cu_seqlens segment.

    q: [T, H, hd]; k, v: [T, Hkv, hd] with Hkv dividing H (query head h reads kv head h // (H / Hkv), as in
    flash-attn); cu_seqlens_*: [n_seq + 1] int32 offsets into T; ``causal``: position i of a sequence sees its
    positions j <= i (q and k lengths are equal here, so flash-attn's bottom-right alignment is the usual one).
    -> [T, H, hd]. Checks what the real kernel requires and would not report as clearly: at least one sequence,
    no empty sequence, int32 offsets and max_seqlen equal to the longest one.
    """
    T, H, hd = q.shape
    Hkv = k.shape[1]
    assert k.shape == v.shape == (T, Hkv, hd) and H % Hkv == 0 and dropout_p == 0.0
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    lengths = cu_seqlens_q.diff()
    assert len(lengths) >= 1 and int(lengths.min()) >= 1 and int(cu_seqlens_q[-1]) == T
    assert max_seqlen_q == max_seqlen_k == int(lengths.max())
    scale = 1 / math.sqrt(hd) if softmax_scale is None else softmax_scale
    outs = []
    for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        qs = q[a:b]  # [n, H, hd]
        ks, vs = (t[a:b].repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # [n, H, hd]
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale  # [H, n, n]
        if causal:
            scores = scores.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        outs.append(torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs))
    return torch.cat(outs)


def use_cpu_flash(monkeypatch) -> list:
    """Run backend 'flash' on CPU tensors through the stand-in kernel, for one test. Only the device check is lifted
    (``use_flash`` is replaced, the production function is untouched); 'sdpa' keeps SDPA. Returns the list of token
    counts T the kernel was called with, so a test can tell the flash path really ran."""
    calls = []

    def kernel(q, *args, **kwargs):
        calls.append(q.shape[0])
        return varlen_attention_stand_in(q, *args, **kwargs)

    monkeypatch.setattr(layers, "flash_attn_varlen_func", kernel)
    monkeypatch.setattr(layers, "use_flash", lambda backend, x: backend == "flash")
    return calls


def qkv(B, L, seed, H=4, Hkv=2, hd=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, L, hd, generator=g).requires_grad_() for h in (H, Hkv, Hkv)]


def test_flash_backend_still_needs_cuda_outside_the_stand_in(monkeypatch):
    """The stand-in is test-only: with a kernel present, production 'flash' on CPU tensors is still refused."""
    monkeypatch.setattr(layers, "flash_attn_varlen_func", varlen_attention_stand_in)
    with pytest.raises(RuntimeError, match="needs flash-attn and CUDA"):
        layers.use_flash("flash", torch.zeros(1))
    assert not layers.use_flash("auto", torch.zeros(1, dtype=torch.bfloat16)) and not layers.use_flash("sdpa", None)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_varlen_matches_sdpa(monkeypatch, causal, packed):
    """Padded rows (one with no real token) and packed documents: flash_varlen with the stand-in equals SDPA at every
    real position, forward and backward, and is zero at padding."""
    calls = use_cpu_flash(monkeypatch)
    B, L = 3, 7
    key_mask = torch.arange(L)[None] < torch.tensor([[7], [4], [0]])  # [B, L]; row 2 is all padding
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, -1, -1, -1], [-1] * 7]) if packed else None
    q, k, v = qkv(B, L, seed=int(causal) + 2 * int(packed))
    w = torch.randn(B, 4, L, 8, generator=torch.Generator().manual_seed(9)) * key_mask[:, None, :, None]
    outs, grads = [], []
    for backend in ("flash", "sdpa"):
        out = layers.attend(q, k, v, key_mask, backend=backend, causal=causal, segments=segments)  # [B, H, L, hd]
        outs.append(out)
        grads.append(torch.autograd.grad((out * w).sum(), (q, k, v)))
    assert calls == [11], "the flash path ran once on the 11 real tokens"
    real = key_mask[:, None, :, None].expand_as(outs[0])
    torch.testing.assert_close(outs[0][real], outs[1][real], atol=1e-6, rtol=1e-5)
    assert torch.all(outs[0][~real] == 0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("B", [0, 2])
def test_flash_varlen_without_a_real_token_returns_zeros_without_the_kernel(monkeypatch, B):
    """B = 0 (a zero-row core call, an anchor readout with no eligible row) and B rows of padding only: the kernel
    cannot take an empty batch, so it is not called; the result is zero and autograd still reaches q, k and v."""
    calls = use_cpu_flash(monkeypatch)
    q, k, v = qkv(B, 5, seed=3)
    key_mask = torch.zeros(B, 5, dtype=torch.bool)
    for segments in (None, torch.full((B, 5), -1)):
        out = layers.attend(q, k, v, key_mask, backend="flash", segments=segments)
        assert out.shape == q.shape and torch.all(out == 0)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(g.shape == t.shape and torch.all(g == 0) for g, t in zip(grads, (q, k, v)))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not layers.flash_available(), reason="needs flash-attn and CUDA")
@pytest.mark.parametrize("causal", [False, True])
def test_stand_in_matches_flash_attn_and_empty_batches_skip_it_on_gpu(causal):
    """The CPU tests are only as good as the stand-in: here it meets the real kernel (bf16, GQA, three sequences of
    lengths 5, 7, 1). Then flash_varlen on CUDA with no real token (zero rows, rows of padding only) returns zeros."""
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0, 5, 12, 13], dtype=torch.int32, device="cuda")
    q = torch.randn(13, 4, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(13, 2, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = layers.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=causal)
    ref = varlen_attention_stand_in(q.float(), k.float(), v.float(), cu, cu, 7, 7, causal=causal)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for B in (0, 2):
        q, k, v = (t.cuda().bfloat16().detach().requires_grad_() for t in qkv(B, 5, seed=3))
        out = layers.attend(q, k, v, torch.zeros(B, 5, dtype=torch.bool, device="cuda"), backend="flash")
        assert out.shape == q.shape and torch.all(out == 0)
        out.sum().backward()
        assert q.grad is not None and k.grad is not None and v.grad is not None
