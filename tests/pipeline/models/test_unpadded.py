"""Eco-RNA's packed (unpadded) layout against its padded one: same weights, same batch, same outputs and gradients.

The padded path with SDPA is the reference. The packed path runs the blocks on the real tokens only, [T, d], with
varlen attention: through flash-attn's kernel ("flash", here the CPU stand-in from test_layers.py, so everything but
the kernel is the production GPU code) and through one SDPA call per sequence ("sdpa" with unpad true). Outputs are
compared at real positions (the packed path leaves padding at zero), gradients everywhere, in fp32 to 1e-5.
"""
import dataclasses

import pytest
import torch

from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state, token_bucket
from test_layers import use_cpu_flash
from test_wavefront import assert_near


def run(m, tokens, mask, depths, s0, weights, sweights, **kw):
    out = m(tokens, mask, depths, s0, **kw)
    loss = (out.logits * weights).sum() + (out.state * sweights).sum() + (out.prev_state * sweights)[depths >= 2].sum()
    if out.anchor_logits is not None and out.anchor_rows.numel():  # no-grad readout: compared, not differentiated
        loss = loss + 0 * out.anchor_logits.sum()
    return out, torch.autograd.grad(loss, list(m.parameters()))


@pytest.mark.parametrize("quantum", [None, 64])
@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("seed,window,extra_kmax,anchor", [(0, 100, 0, None), (1, 2, 0, 2), (2, 3, 2, 1),
                                                            (3, 1, 1, 4)])
def test_packed_layout_equals_padded(monkeypatch, backend, seed, window, extra_kmax, anchor, quantum):
    """quantum: token buckets (a half-octave grid below one quantum here): the later rows' tokens and padding ride
    along in sequences of their own and change nothing at the active rows."""
    kernel_tokens = use_cpu_flash(monkeypatch)
    torch.manual_seed(seed)
    cfg = EcoRNAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1, n_core=2, n_coda=1,
                       attn_backend="sdpa", unpad=False)
    padded = EcoRNA(cfg)
    packed = EcoRNA(dataclasses.replace(cfg, attn_backend=backend, unpad=True))
    packed.load_state_dict(padded.state_dict())
    g = torch.Generator().manual_seed(seed)
    B, L = 6, 13
    lengths = torch.tensor([13, 5, 9, 1, 13, 7])
    mask = torch.arange(L)[None] < lengths[:, None]  # [B, L], right-padded
    if seed == 2:
        mask[2, 3] = False  # a hole: a masked position inside a row keeps its neighbours' positions
    depths = torch.randint(1, 7, (B,), generator=g)
    tokens = torch.randint(6, 12, (B, L), generator=g).masked_fill(~mask, 0)
    s0 = initial_state(cfg, mask, generator=g)
    weights = torch.randn(B, L, 23, generator=g) / (B * L) * mask[..., None]
    sweights = torch.randn(B, L, 32, generator=g) / (B * L) * mask[..., None]
    kw = dict(k_max=int(depths.max()) + extra_kmax, backward_window=window, anchor_depth=anchor)

    out_p, grads_p = run(padded, tokens, mask, depths, s0, weights, sweights, **kw)
    out_u, grads_u = run(packed, tokens, mask, depths, s0, weights, sweights, token_quantum=quantum, **kw)
    assert bool(kernel_tokens) == (backend == "flash")  # the flash stand-in ran exactly when selected
    if quantum:  # every call on a bucket; seed 2's 47 real tokens end in a padding token (48)
        assert all(n == token_bucket(n, quantum) for n in kernel_tokens)
        assert backend != "flash" or seed != 2 or 48 in kernel_tokens
    assert out_u.row_iterations == out_p.row_iterations == int(depths.sum())
    assert out_u.core_calls == out_p.core_calls
    for name in ("logits", "state"):
        assert_near(getattr(out_u, name)[mask], getattr(out_p, name)[mask], name)
        assert not getattr(out_u, name)[~mask].any(), f"{name} is not zero at padding"
    deep = mask & (depths >= 2)[:, None]
    assert_near(out_u.prev_state[deep], out_p.prev_state[deep], "prev_state")
    if anchor is None:
        assert out_u.anchor_logits is None
    else:
        assert torch.equal(out_u.anchor_rows, out_p.anchor_rows)
        rows_mask = mask[out_p.anchor_rows]
        assert_near(out_u.anchor_logits[rows_mask], out_p.anchor_logits[rows_mask], "anchor_logits")
    for (name, _), a, b in zip(padded.named_parameters(), grads_u, grads_p):
        assert_near(a, b, name)


def test_unpad_auto_follows_the_attention_backend():
    """auto packs exactly where flash-attn runs: never on CPU tensors unless the backend is 'flash' explicitly."""
    cfg = EcoRNAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1, n_core=1, n_coda=1)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    assert not EcoRNA(cfg).unpadded(tokens)
    assert EcoRNA(dataclasses.replace(cfg, attn_backend="flash")).unpadded(tokens)
    assert EcoRNA(dataclasses.replace(cfg, unpad=True)).unpadded(tokens)
    assert not EcoRNA(dataclasses.replace(cfg, attn_backend="flash", unpad=False)).unpadded(tokens)
    for bad in ("yes", "on", 1):
        with pytest.raises(ValueError, match="model.unpad"):
            EcoRNAConfig(unpad=bad)


def test_packed_calls_run_on_bucketed_token_counts():
    """With a token quantum the core only ever sees multiples of it, across batches of other lengths and depths:
    at most budget / quantum + 1 sizes."""
    from pipeline.models.eco_rna import Core, token_bucket

    cfg = EcoRNAConfig(d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, n_prelude=1, n_core=1, n_coda=1,
                       attn_backend="sdpa", unpad=True)
    m = EcoRNA(cfg)
    seen = []
    m.core.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    g = torch.Generator().manual_seed(0)
    for B, L in ((9, 40), (5, 70), (12, 33)):
        mask = torch.arange(L)[None] < torch.randint(L // 2, L + 1, (B, 1), generator=g)
        tokens = torch.randint(6, 12, (B, L), generator=g)
        m(tokens, mask, torch.randint(1, 6, (B,), generator=g), initial_state(cfg, mask, generator=g),
          token_quantum=50)
    assert seen and all(n == token_bucket(n, 50) for n in seen), seen  # every call on a bucket
    # a bucket holds its count, is its own bucket and grows with it: multiples of the quantum above it, a
    # half-octave grid from quantum / 16 below (3, 4, 6, 8, 12, 16, 24, 32, 48, 50 here)
    buckets = [token_bucket(n, 50) for n in range(1, 401)]
    assert all(b >= n and token_bucket(b, 50) == b for n, b in enumerate(buckets, 1))
    assert buckets == sorted(buckets) and len(set(buckets)) == 10 + 7, sorted(set(buckets))
    assert token_bucket(0, 50) == 0 and token_bucket(401, 50) == 450 and token_bucket(5, 50) == 6
    assert isinstance(m.core, Core)
