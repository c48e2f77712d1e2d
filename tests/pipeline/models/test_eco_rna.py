import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.config import load_config
from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state
from pipeline.models.layers import Attention, apply_rope, rope_cache

REPO = Path(__file__).resolve().parents[3]


def small_cfg(**kw):
    return EcoRNAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1, n_core=2, n_coda=1, **kw)


def test_80m_config_counts_match_built_model_and_paper():
    cfg = load_config(REPO / "launchers/configs/eco_rna_80m.yaml").model
    model = EcoRNA(cfg)
    built = sum(p.numel() for p in model.parameters())
    assert cfg.num_params() == built
    assert abs(built - 80.8e6) / 80.8e6 < 0.01
    assert cfg.d_kv == 384 and cfg.head_dim == 64


def test_80m_forward_flops_equal_paper_A9():
    cfg = load_config(REPO / "launchers/configs/eco_rna_80m.yaml").model
    got = [round(cfg.forward_flops(k, 512) / 1e9, 3) for k in (1, 4, 8)]
    assert got == [90.011, 180.608, 301.404]


def test_boundary_maps_start_as_identity_and_retention_in_bounds():
    m = EcoRNA(small_cfg())
    assert torch.equal(m.core.inject.B.weight, torch.eye(32))
    assert torch.equal(m.readout.W_o.weight, torch.eye(32))
    alpha, delta = m.core.inject.coefficients()
    assert torch.all((alpha > 0.1) & (alpha < 0.9)) and torch.allclose(delta, torch.ones(32))


def test_tied_head_is_embedding():
    m = EcoRNA(small_cfg())
    captured = []
    m.readout.register_forward_hook(lambda mod, inp, out: captured.append(out))
    tokens = torch.randint(6, 10, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    logits = m(tokens, mask, 2, initial_state(m.cfg, mask, torch.Generator().manual_seed(0))).logits
    torch.testing.assert_close(logits, captured[0] @ m.embed.weight.T)


def test_padding_does_not_change_real_positions():
    """A row padded to a longer batch gives the same logits at its real positions as alone."""
    torch.manual_seed(0)
    m = EcoRNA(small_cfg())
    short = torch.randint(6, 12, (1, 7))
    padded = torch.cat([short, torch.zeros(1, 5, dtype=torch.long)], 1)
    mask_s, mask_p = torch.ones(1, 7, dtype=torch.bool), torch.arange(12)[None] < 7
    table = torch.randn(12, 32)
    out_s = m(short, mask_s, 3, initial_state(m.cfg, mask_s, table=table)).logits
    out_p = m(padded, mask_p, 3, initial_state(m.cfg, mask_p, table=table)).logits
    torch.testing.assert_close(out_p[:, :7], out_s, atol=1e-5, rtol=1e-5)


def test_initial_state_zero_at_padding_and_seeded():
    cfg = small_cfg(sigma_init=0.5)
    mask = torch.arange(10)[None].expand(3, 10) < torch.tensor([[10], [4], [7]])
    a = initial_state(cfg, mask, torch.Generator().manual_seed(3))
    b = initial_state(cfg, mask, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and torch.all(a[~mask] == 0) and torch.all(a[mask].abs().sum(-1) > 0)
    assert abs(a[mask].std().item() - 0.5) < 0.05


def test_attention_matches_explicit_gqa_softmax():
    """SDPA path against a hand-written bidirectional GQA with padding mask, QK-norm and RoPE."""
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 1e-6, backend="sdpa")
    x = torch.randn(2, 6, 32)
    key_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    rope = rope_cache(6, 8, 10000.0, "cpu")
    got = attn(x, rope, key_mask)
    q = attn.q_norm(attn.q_proj(x).view(2, 6, 4, 8)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(2, 6, 2, 8)).transpose(1, 2)
    v = attn.v_proj(x).view(2, 6, 2, 8).transpose(1, 2)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # query head h uses kv head h // 2
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    ref = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_rope_is_relative():
    """<R_m q, R_n k> depends only on m - n."""
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    cos, sin = rope_cache(20, 8, 10000.0, "cpu")
    dot = lambda m, n: (apply_rope(q, cos[m:m + 1], sin[m:m + 1]) * apply_rope(k, cos[n:n + 1], sin[n:n + 1])).sum()
    torch.testing.assert_close(dot(3, 1), dot(15, 13))


def test_backward_reaches_every_parameter():
    m = EcoRNA(small_cfg())
    tokens = torch.randint(6, 12, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    logits = m(tokens, mask, 2, initial_state(m.cfg, mask, torch.Generator().manual_seed(0))).logits
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.any(p.grad != 0)]
    assert not missing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_backend_matches_sdpa_on_gpu():
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    cfg_s, cfg_f = small_cfg(attn_backend="sdpa"), small_cfg(attn_backend="flash")
    m_s = EcoRNA(cfg_s).cuda().bfloat16()
    m_f = EcoRNA(cfg_f).cuda().bfloat16()
    m_f.load_state_dict(m_s.state_dict())
    tokens = torch.randint(6, 12, (3, 40), device="cuda")
    mask = torch.arange(40, device="cuda")[None] < torch.tensor([[40], [25], [9]], device="cuda")
    s0 = initial_state(cfg_s, mask, torch.Generator().manual_seed(0))
    out_s, out_f = m_s(tokens, mask, 3, s0).logits, m_f(tokens, mask, 3, s0).logits
    torch.testing.assert_close(out_f[mask].float(), out_s[mask].float(), atol=3e-2, rtol=3e-2)
