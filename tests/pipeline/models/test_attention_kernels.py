"""The attention kernels' contract on CPU: no kernel ever sees an empty batch, the CUDA-only paths (grouped-query k/v
expanded for the memory-efficient kernel, torch's varlen kernel) equal plain SDPA, through stand-ins where the kernel
itself needs CUDA.

On the GPU, cuDNN's SDPA returned an undefined tensor for a zero-row batch (training crashed with "'NoneType' object
has no attribute 'transpose'" at a wavefront step with no active row); CPU SDPA accepts an empty batch, so only a
kernel that refuses one, as here, shows that no path reaches it.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pipeline.models import layers
from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state
from test_layers import qkv, varlen_attention_stand_in


class EmptyBatchCall(AssertionError):
    pass


def refuse_empty(monkeypatch) -> list:
    """Every attention kernel layers can reach (SDPA, flash-attn's and torch's varlen kernels, the latter two through
    CPU stand-ins) raises on an empty batch; returns the list of batch sizes they were called with."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def guarded_sdpa(q, k, v, *args, **kwargs):
        calls.append(q.shape[0])
        if q.numel() == 0 or k.numel() == 0:
            raise EmptyBatchCall(f"SDPA called with q {tuple(q.shape)}")
        return sdpa(q, k, v, *args, **kwargs)

    def guarded_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, **kwargs):
        calls.append(q.shape[0])
        if q.shape[0] == 0:
            raise EmptyBatchCall(f"varlen kernel called with q {tuple(q.shape)}")
        return varlen_attention_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)

    monkeypatch.setattr(F, "scaled_dot_product_attention", guarded_sdpa)
    monkeypatch.setattr(layers, "flash_attn_varlen_func", guarded_varlen)
    return calls


def tiny_eco(**kw):
    torch.manual_seed(0)
    return EcoRNA(EcoRNAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1, n_core=2, n_coda=1, **kw))


@pytest.mark.parametrize("backend,unpad", [("sdpa", False), ("sdpa", True), ("flash", False), ("flash", True)])
def test_no_attention_kernel_is_called_with_an_empty_batch(monkeypatch, backend, unpad):
    """Eco-RNA's wavefront with k_max above every depth (the leading core calls have zero rows, as on a rank whose
    depths are below another rank's K_max, or under fixed_wavefront) and an anchor depth no row exceeds (a zero-row
    readout), forward and backward, in both layouts; then every branch of layers.attend on zero rows."""
    calls = refuse_empty(monkeypatch)
    if backend == "flash":
        monkeypatch.setattr(layers, "use_flash", lambda b, x: b == "flash")
    m = tiny_eco(attn_backend=backend, unpad=unpad)
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(8)[None] < torch.tensor([[8], [5], [3]])
    tokens = torch.randint(6, 12, (3, 8), generator=g)
    out = m(tokens, mask, torch.tensor([1, 2, 2]), initial_state(m.cfg, mask, generator=g), k_max=6,
            backward_window=4, anchor_depth=3)
    (out.logits.sum() + out.state.sum()).backward()
    assert calls and 0 not in calls
    assert out.anchor_logits.shape[0] == 0 and out.core_calls == 6

    q, k, v = qkv(0, 5, seed=2)
    key_mask = torch.zeros(0, 5, dtype=torch.bool)
    for kwargs in ({}, {"causal": True}, {"segments": torch.zeros(0, 5, dtype=torch.long)},
                   {"causal": True, "segments": torch.zeros(0, 5, dtype=torch.long)}):
        out = layers.attend(q, k, v, key_mask, backend=backend, **kwargs)
        assert out.shape == q.shape and not out.any()
        grads = torch.autograd.grad(out.sum(), (q, k, v))  # autograd still reaches q, k and v (ZeRO-3 symmetry)
        assert all(gr.shape == t.shape for gr, t in zip(grads, (q, k, v)))


def test_grouped_query_expansion_equals_sdpa_gqa():
    """The CUDA path expands k/v to q's heads (the memory-efficient kernel takes no grouped-query layout): with a
    padding mask, outputs and gradients equal SDPA's own enable_gqa, head j of k/v serving query heads 2j, 2j+1."""
    q, k, v = qkv(3, 7, seed=4, H=6, Hkv=3)
    mask = (torch.arange(7)[None] < torch.tensor([[7], [4], [1]]))[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ke, ve = layers.expand_kv(q, k, v)
    assert ke.shape == q.shape
    got = F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)
    torch.testing.assert_close(got, want)
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa_keyword", [True, False])
def test_torch_varlen_call_equals_the_per_sequence_path(monkeypatch, causal, gqa_keyword):
    """layers.torch_varlen maps the packed sequences onto torch.nn.attention.varlen.varlen_attn (CUDA only, so a
    stand-in with its signature here, in either torch version's keywords): the result equals varlen_attend's
    per-sequence SDPA path, lengths 5, 1, 3 with grouped-query heads."""
    seen = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1),
                    **kwargs):
        seen.append((window_size, kwargs))
        if "enable_gqa" not in kwargs:
            assert key.shape[1] == query.shape[1], "grouped-query k/v given to a kernel without enable_gqa"
        return varlen_attention_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                         causal=window_size == (-1, 0))

    if not gqa_keyword:  # an older signature: no enable_gqa, so k/v must arrive expanded
        def older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
            return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size)
        kernel = older
    else:
        def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
            return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                               enable_gqa=enable_gqa)
    monkeypatch.setattr(layers, "torch_varlen_attn", kernel)
    layers._varlen_params.cache_clear()
    try:
        g = torch.Generator().manual_seed(5)
        q = torch.randn(9, 4, 8, generator=g)
        k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(2))
        seqs = layers.Varlen((5, 1, 0, 3), torch.device("cpu"))
        got = layers.torch_varlen(q, k, v, seqs.cu_seqlens, seqs.max_len, causal)
        want = layers.varlen_attend(q, k, v, seqs, backend="sdpa", causal=causal)
        torch.testing.assert_close(got, want)
        assert seen[0][0] == ((-1, 0) if causal else (-1, -1))
        assert ("enable_gqa" in seen[0][1]) == gqa_keyword
    finally:
        layers._varlen_params.cache_clear()


def test_packed_layout_runs_torch_varlen_when_it_works(monkeypatch):
    """With attn_backend auto and torch's varlen kernel working (a stand-in; the real one needs CUDA), the packed
    layout's attention goes through it and the model equals the padded model at real tokens."""
    calls = []

    def kernel(q, k, v, cu, max_len, causal):
        calls.append(q.shape[0])
        return varlen_attention_stand_in(q, k, v, cu, cu, max_len, max_len, causal=causal)

    monkeypatch.setattr(layers, "torch_varlen_available", lambda x: True)
    monkeypatch.setattr(layers, "torch_varlen", kernel)
    m_pad = tiny_eco(unpad=False)
    m_pack = EcoRNA(dataclasses.replace(m_pad.cfg, unpad=True))
    m_pack.load_state_dict(m_pad.state_dict())
    g = torch.Generator().manual_seed(3)
    mask = torch.arange(6)[None] < torch.tensor([[6], [2]])
    tokens = torch.randint(6, 12, (2, 6), generator=g)
    s0 = initial_state(m_pad.cfg, mask, generator=g)
    a, b = (m(tokens, mask, torch.tensor([2, 3]), s0).logits for m in (m_pack, m_pad))
    torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=1e-5)
    assert calls and 0 not in calls


# ---- on a GPU (bash bench/gpu.sh runs the gpu-marked tests) ---------------------------------------------------------
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("unpad", [False, True])
def test_wavefront_with_zero_row_steps_on_gpu(unpad):
    """The first GPU run's crash: bf16 padded SDPA on CUDA at wavefront steps with no active row. Now zeros, and the
    same outputs as the CPU model at real tokens (bf16 tolerance)."""
    m = tiny_eco(unpad=unpad)
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(8)[None] < torch.tensor([[8], [5], [3]])
    tokens = torch.randint(6, 12, (3, 8), generator=g)
    s0 = initial_state(m.cfg, mask, generator=g)
    ref = m(tokens, mask, torch.tensor([1, 2, 2]), s0, k_max=6, backward_window=4, anchor_depth=3)
    gm = tiny_eco(unpad=unpad).cuda().bfloat16()
    gm.load_state_dict(m.state_dict())
    out = gm(tokens.cuda(), mask.cuda(), torch.tensor([1, 2, 2]), s0.cuda(), k_max=6, backward_window=4,
             anchor_depth=3, host_mask=mask)
    out.logits.float().sum().backward()
    torch.testing.assert_close(out.logits.float().cpu()[mask], ref.logits.detach()[mask], atol=0.1, rtol=0.1)


@pytest.mark.gpu
@CUDA
def test_initial_state_drawn_on_the_device_replays():
    """state_on_device: the same generator state gives the same bf16 state on the GPU, zero at padding."""
    cfg = tiny_eco().cfg
    mask = (torch.arange(6)[None] < torch.tensor([[6], [2]])).cuda()
    a, b = (initial_state(cfg, mask, torch.Generator().manual_seed(5), dtype=torch.bfloat16, on_device=True)
            for _ in range(2))
    assert a.is_cuda and a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert not a[~mask].any() and a[mask].float().std() > 0.1


@pytest.mark.gpu
@CUDA
@pytest.mark.skipif(layers.torch_varlen_attn is None, reason="torch has no varlen_attn")
@pytest.mark.parametrize("causal", [False, True])
def test_torch_varlen_kernel_matches_the_per_sequence_path_on_gpu(causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(13, 4, 64, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(13, 2, 64, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqs = layers.Varlen((5, 7, 0, 1), torch.device("cuda"))
    assert layers.torch_varlen_available(q)
    got = layers.varlen_attend(q, k, v, seqs, backend="auto", causal=causal)
    want = layers.varlen_attend(q, k, v, seqs, backend="sdpa", causal=causal)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("unpad", [False, True])
def test_the_wavefront_never_waits_for_the_device(unpad):
    """Forward and backward of a wavefront with idle steps, an anchor readout and (unpad) a packed layout whose
    row count changes at every step: no operation synchronizes with the device (torch's sync debug mode turns each
    one into an error). A blocking host-to-device copy of an index (``torch.tensor(..., device=cuda)``, a pageable
    ``.to(cuda)``) fails it: each stalled the host once per wavefront row count (layers.host_tensor)."""
    m = tiny_eco(unpad=unpad).cuda().bfloat16()
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(8)[None] < torch.tensor([[8], [5], [3], [7]])
    tokens = torch.randint(6, 12, (4, 8), generator=g).cuda()
    s0 = initial_state(m.cfg, mask, generator=g).cuda()
    dev_mask = mask.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = m(tokens, dev_mask, [1, 2, 4, 3], s0, k_max=6, backward_window=4, anchor_depth=2, host_mask=mask)
        out.logits.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None for p in m.core.parameters())
