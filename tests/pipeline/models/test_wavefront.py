"""The right-aligned wavefront against the straightforward reference: each sequence alone for its own K_i."""
import dataclasses

import pytest
import torch

from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state
from test_layers import use_cpu_flash  # the CPU stand-in for flash-attn's varlen kernel (same folder)


def small_model(seed=0):
    torch.manual_seed(seed)
    return EcoRNA(EcoRNAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1, n_core=2, n_coda=1))


def assert_near(got, want, name="", atol=1e-5, rtol=1e-5):
    """Both an absolute and a relative bound: max |got - want| <= atol, and ||got - want|| <= rtol ||want||.

    The absolute bound alone passes any tensor whose entries are all below atol, and some gradients here are: the
    coda's norm gains get |grad| ~ 1e-5, so a zero or halved gradient would pass it. The relative bound is taken on
    the norm of the tensor, not per element, so that entries near zero do not need an absolute floor of their own.
    """
    err = (got - want).abs().max().item()
    rel = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
    assert err <= atol and rel <= rtol, f"{name}: max abs error {err:.2e} (atol {atol}), relative {rel:.2e} (rtol {rtol})"


def reference_row(m, tokens, s0, depth, window):
    """One unpadded sequence [1, n]: prelude, K core applications with autograd only in the last W, readout."""
    mask = torch.ones_like(tokens, dtype=torch.bool)
    rope = m.rope(tokens.shape[1], "cpu", torch.float32)
    e = m.prelude_norm(m.prelude(m.embed(tokens), rope, mask))
    s, prev, states = s0, s0, [s0]
    for k in range(1, depth + 1):
        if k == depth - window + 1 and window < depth:
            s = s.detach()
        with torch.set_grad_enabled(k > depth - window):
            s_next = m.core(s, e, rope, mask)
        prev, s = s, s_next
        states.append(s)
    return m.embed(m.readout(s, rope, mask), as_head=True), s, prev, states


@pytest.mark.parametrize("seed,window,extra_kmax", [(0, 100, 0), (1, 2, 0), (2, 3, 2), (3, 1, 1)])
def test_wavefront_equals_per_sequence_loop(seed, window, extra_kmax):
    m = small_model(seed)
    g = torch.Generator().manual_seed(seed)
    B, L = 5, 11
    lengths = torch.tensor([11, 7, 9, 4, 11])
    depths = torch.randint(1, 7, (B,), generator=g)
    tokens = torch.randint(6, 12, (B, L), generator=g)
    mask = torch.arange(L)[None] < lengths[:, None]
    tokens[~mask] = 0
    s0 = initial_state(m.cfg, mask, generator=g)
    # A loss of the scale of a token-mean cross-entropy that touches every valid logit and state differently.
    weights = torch.randn(B, L, 23, generator=g) / (B * L)
    sweights = torch.randn(B, L, 32, generator=g) / (B * L)

    out = m(tokens, mask, depths, s0, k_max=int(depths.max()) + extra_kmax, backward_window=window)
    assert out.row_iterations == int(depths.sum()) and out.core_calls == int(depths.max()) + extra_kmax
    loss = sum(((out.logits[i, :n] * weights[i, :n]).sum() + (out.state[i, :n] * sweights[i, :n]).sum()
                + (out.prev_state[i, :n] * sweights[i, :n]).sum() * (depths[i] >= 2))
               for i, n in enumerate(lengths.tolist()))
    grads = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)

    ref_loss = 0
    for i, n in enumerate(lengths.tolist()):
        logits, s, prev, _ = reference_row(m, tokens[i:i + 1, :n], s0[i:i + 1, :n], int(depths[i]), window)
        assert_near(out.logits[i, :n], logits[0], f"logits row {i}")
        assert_near(out.state[i, :n], s[0], f"state row {i}")
        if depths[i] >= 2:
            assert_near(out.prev_state[i, :n], prev[0], f"prev_state row {i}")
        ref_loss = ref_loss + (logits[0] * weights[i, :n]).sum() + (s[0] * sweights[i, :n]).sum() + (
            (prev[0] * sweights[i, :n]).sum() if depths[i] >= 2 else 0)
    ref_grads = torch.autograd.grad(ref_loss, list(m.parameters()), allow_unused=True)
    for (name, _), a, b in zip(m.named_parameters(), grads, ref_grads):
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        assert_near(a, b, name)


def test_anchor_state_is_the_state_after_K_a_iterations():
    m = small_model(4)
    g = torch.Generator().manual_seed(4)
    B, L, K_a = 6, 8, 2
    depths = torch.tensor([1, 2, 3, 5, 4, 6])
    tokens = torch.randint(6, 12, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    s0 = initial_state(m.cfg, mask, generator=g)
    out = m(tokens, mask, depths, s0, k_max=7, backward_window=2, anchor_depth=K_a)
    assert out.anchor_rows.tolist() == [2, 3, 4, 5]  # K_i > K_a
    assert not out.anchor_logits.requires_grad
    direct = m(tokens, mask, K_a, s0).logits
    torch.testing.assert_close(out.anchor_logits, direct[out.anchor_rows], atol=1e-5, rtol=0)


def test_rows_without_work_still_call_the_core():
    """k_max above every local depth (another rank's maximum): the core is called k_max times, some on zero rows."""
    m = small_model(5)
    calls = []
    m.core.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    mask = torch.ones(2, 6, dtype=torch.bool)
    s0 = initial_state(m.cfg, mask, generator=torch.Generator().manual_seed(0))
    out = m(torch.randint(6, 12, (2, 6)), mask, torch.tensor([1, 2]), s0, k_max=5)
    assert calls == [0, 0, 0, 1, 2] and out.row_iterations == 3


@pytest.mark.parametrize("unpad,core_units", [(False, [0, 0, 0, 1, 3, 4]), ("auto", [0, 0, 0, 0, 11, 21])])
def test_flash_wavefront_with_idle_steps_and_no_anchor_row_matches_sdpa(monkeypatch, unpad, core_units):
    """Backend 'flash' (the CPU stand-in kernel) against 'sdpa' with the same weights, forward and backward, where
    flash-attn would get no token: k_max = 6 above every depth (steps 1-3 call the core on zero rows, step 3 of them
    inside the backward window), a row of padding only (at step 4 it is the one active row) and K_a = 3 >= every K_i
    (the anchor readout runs on zero rows). The CUDA version with the real kernel is
    test_eco_rna.py::test_flash_backend_matches_sdpa_on_gpu. unpad false runs flash inside padded blocks (the core
    sees rows), "auto" with flash runs the blocks on packed real tokens (the core sees the active rows' tokens:
    lengths 0, 3, 8 and 10 in depth order)."""
    kernel_tokens = use_cpu_flash(monkeypatch)
    m_s = small_model(7)
    m_f = EcoRNA(dataclasses.replace(m_s.cfg, attn_backend="flash", unpad=unpad))
    m_f.load_state_dict(m_s.state_dict())
    core_rows = []
    m_f.core.register_forward_hook(lambda mod, inp, out: core_rows.append(inp[0].shape[0]))
    g = torch.Generator().manual_seed(7)
    B, L = 4, 10
    lengths, depths = torch.tensor([10, 0, 3, 8]), torch.tensor([1, 3, 2, 2])
    mask = torch.arange(L)[None] < lengths[:, None]  # [B, L]
    tokens = torch.randint(6, 12, (B, L), generator=g).masked_fill(~mask, 0)
    s0 = initial_state(m_s.cfg, mask, generator=g)
    # Weights zero at padding: the backends differ there by design (flash leaves padded positions at zero).
    weights = torch.randn(B, L, 23, generator=g) / (B * L) * mask[..., None]
    sweights = torch.randn(B, L, 32, generator=g) / (B * L) * mask[..., None]

    results = []
    for m in (m_f, m_s):
        out = m(tokens, mask, depths, s0, k_max=6, backward_window=4, anchor_depth=3)
        loss = ((out.logits * weights).sum() + (out.state * sweights).sum()
                + (out.prev_state * sweights)[depths >= 2].sum())
        results.append((out, torch.autograd.grad(loss, list(m.parameters()))))
    (out_f, grads_f), (out_s, grads_s) = results
    assert core_rows == core_units
    assert kernel_tokens and 0 not in kernel_tokens  # the flash path ran, and never on an empty batch
    assert out_f.anchor_rows.numel() == 0 and out_f.anchor_logits.shape == (0, L, 23)
    for name in ("logits", "state", "prev_state"):
        assert_near(getattr(out_f, name)[mask], getattr(out_s, name)[mask], name)
    for (name, _), a, b in zip(m_s.named_parameters(), grads_f, grads_s):
        assert_near(a, b, name)


def test_depths_outside_k_max_are_refused():
    m = small_model()
    mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="depths must lie in"):
        m(torch.randint(6, 12, (1, 4)), mask, torch.tensor([3]), torch.zeros(1, 4, 32), k_max=2)


def test_one_trajectory_read_out_at_each_depth_equals_a_forward_per_depth():
    """logits_at_depths (the depth sweeps) against forward(K) for each K, on a padded batch; max(depths) core calls."""
    m = small_model(6)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False
    tokens = torch.randint(6, 12, (3, 9)).masked_fill(~mask, 0)
    s0 = initial_state(m.cfg, mask, generator=torch.Generator().manual_seed(1))
    calls = []
    m.core.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
    with torch.no_grad():
        swept = m.logits_at_depths(tokens, mask, [4, 1, 2], s0)
        assert sorted(swept) == [1, 2, 4] and len(calls) == 4
        for k, logits in swept.items():
            assert torch.equal(logits, m(tokens, mask, k, s0).logits), k
    with pytest.raises(ValueError, match="depths must be >= 1"):
        m.logits_at_depths(tokens, mask, [0, 2], s0)


def test_fixed_depth_control_sweep_is_its_one_forward():
    from pipeline.models.fixed_depth import FixedDepthConfig, FixedDepthMLM

    torch.manual_seed(0)
    m = FixedDepthMLM(FixedDepthConfig(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1, n_core=1, n_coda=1))
    mask = torch.ones(2, 5, dtype=torch.bool)
    tokens = torch.randint(6, 12, (2, 5))
    with torch.no_grad():
        swept = m.logits_at_depths(tokens, mask, [1, 3], None)
        ref = m(tokens, mask).logits
    assert sorted(swept) == [1, 3] and all(torch.equal(v, ref) for v in swept.values())
