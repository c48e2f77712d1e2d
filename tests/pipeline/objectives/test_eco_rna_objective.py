import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import load_config
from pipeline.data.batch import Batch
from pipeline.models.eco_rna import EcoRNA, initial_state
from pipeline.objectives.eco_rna import EcoRNAObjectiveConfig, Plan, per_row_ce, recurrent_loss, sample_depths
from pipeline.objectives.masking import IGNORE_INDEX

SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64", "model.n_prelude=1",
         "model.n_core=2", "model.n_coda=1"]


def test_depth_law_matches_poisson_lognormal():
    cfg = EcoRNAObjectiveConfig(mu_k=4.0, sigma_k=0.5, k_min=2, k_cap=None)
    k = sample_depths(200_000, cfg, torch.Generator().manual_seed(0)).double()
    # E[K~] = E[e^tau] = mu; K = max(K_min, K~); simulate the same law with numpy for the clipped moments
    rng = np.random.default_rng(0)
    tau = rng.normal(math.log(4.0) - 0.125, 0.5, 400_000)
    ref = np.maximum(2, rng.poisson(np.exp(tau)))
    assert abs(k.mean().item() - ref.mean()) < 0.03 and abs(k.var().item() - ref.var()) < 0.15
    assert k.min().item() == 2
    assert torch.equal(sample_depths(10, cfg, torch.Generator().manual_seed(7)),
                       sample_depths(10, cfg, torch.Generator().manual_seed(7)))
    capped = sample_depths(10_000, EcoRNAObjectiveConfig(mu_k=8.0, k_cap=9), torch.Generator().manual_seed(0))
    assert capped.max().item() == 9


def make_batch(seed, B=6, L=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 10, (B, L), generator=g)
    lengths = torch.randint(5, L + 1, (B,), generator=g)
    mask = torch.arange(L)[None] < lengths[:, None]
    ids[~mask] = 0
    labels = torch.where(mask & (torch.rand(B, L, generator=g) < 0.4), ids, torch.full_like(ids, IGNORE_INDEX))
    labels[0] = IGNORE_INDEX  # a row without supervision: excluded from I_a
    return Batch(ids, labels, mask, [str(i) for i in range(B)])


def test_anchor_gradient_is_indicator_times_terminal_gradient():
    """Eq. 11: grad r_i = 1{l_i(K_i) > l_i(K_a) + m_a} grad l_i(K_i), with l_i(K_a) from a separate depth-K_a run."""
    # init_std 0.3: chaotic enough at init that deeper rows are sometimes worse than the reference, sometimes not
    cfg = load_config(None, SMALL + ["model.init_std=0.3", "objective.lambda_fp=0", "objective.lambda_anchor=1",
                                     "objective.anchor_depth=2", "objective.anchor_margin=0.01"])
    torch.manual_seed(0)
    model = EcoRNA(cfg.model)
    batch = make_batch(1)
    depths = torch.tensor([4, 1, 3, 2, 5, 3])
    p = Plan(depths, None, {"k_max": 5},
             init_state=initial_state(cfg.model, batch.attention_mask, torch.Generator().manual_seed(2)))
    params = list(model.parameters())

    out = recurrent_loss(model, batch, cfg, p)
    m = out.num_tokens
    g_total = torch.autograd.grad(out.sum_loss, params)
    cfg0 = load_config(None, SMALL + ["model.init_std=0.3", "objective.lambda_fp=0", "objective.lambda_anchor=0"])
    g_mlm = torch.autograd.grad(recurrent_loss(model, batch, cfg0, p).sum_loss, params)

    # Reference: l_i(K_i) from the wavefront with the loss's backward window, l_i(K_a) from an independent
    # fixed-depth forward. test_anchor_gradient_under_truncated_backprop has rows where the window matters.
    term = model(batch.input_ids, batch.attention_mask, depths, p.init_state, k_max=5,
                 backward_window=cfg.objective.backward_window)
    ce_k, m_row = per_row_ce(term.logits, batch.labels)
    ell_k = ce_k / m_row.clamp(min=1)
    with torch.no_grad():
        ref = model(batch.input_ids, batch.attention_mask, 2, p.init_state)
        ce_a, _ = per_row_ce(ref.logits, batch.labels)
        ell_a = ce_a / m_row.clamp(min=1)
    eligible = (depths > 2) & (m_row > 0)
    active = eligible & (ell_k > ell_a + 0.01)
    assert 0 < int(active.sum()) < int(eligible.sum()), "pick a seed where the hinge is on for some rows only"
    expected = torch.autograd.grad((ell_k * active).sum() / eligible.sum(), params)
    for a, b, c in zip(g_total, g_mlm, expected):
        torch.testing.assert_close((a - b) / m, c, atol=1e-6, rtol=1e-4)
    assert out.stats["anchor_active"] == (int(active.sum()), int(eligible.sum()))


def row_loss_by_hand(model, batch, i, s0, depth, window):
    """l_i(K) of row i alone, unpadded: prelude, then K core applications of which the first K - W run without
    autograd and hand a detached state to the last min(K, W) (A.2), readout, mean CE over the row's targets."""
    n = int(batch.attention_mask[i].sum())
    tokens, labels, s = batch.input_ids[i:i + 1, :n], batch.labels[i, :n], s0[i:i + 1, :n]  # [1, n], [n], [1, n, d]
    mask = torch.ones(1, n, dtype=torch.bool)
    rope = model.rope(n, "cpu", torch.float32)
    e = model.prelude_norm(model.prelude(model.embed(tokens), rope, mask))
    with torch.no_grad():
        for _ in range(depth - min(depth, window)):
            s = model.core(s, e, rope, mask)
    for _ in range(min(depth, window)):
        s = model.core(s, e, rope, mask)
    logits = model.embed(model.readout(s, rope, mask), as_head=True)[0]  # [n, V]
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / (labels != IGNORE_INDEX).sum()


def test_anchor_gradient_under_truncated_backprop():
    """Eq. 11 together with the backward window: rows with K_i > W_bwd (and > K_a) differentiate only their last W
    iterations, in the anchor term as in the MLM term. The reference computes every row alone with the same
    truncation; l_i(K_a) from a separate no-grad depth-K_a run of the row (the same s0, so the same state)."""
    W, K_a, margin = 2, 2, 0.01
    common = SMALL + ["model.init_std=0.3", "objective.lambda_fp=0", f"objective.backward_window={W}"]
    cfg = load_config(None, common + ["objective.lambda_anchor=1", f"objective.anchor_depth={K_a}",
                                      f"objective.anchor_margin={margin}"])
    cfg0 = load_config(None, common + ["objective.lambda_anchor=0"])
    torch.manual_seed(0)
    model = EcoRNA(cfg.model)
    batch = make_batch(1)
    # k_max 6: one idle step. Row 4 (K=5) reaches K_a at step 3, before the window (steps 5-6); rows 2, 5 (K=3)
    # reach it at step 5, inside the window.
    depths = torch.tensor([4, 1, 3, 2, 5, 3])
    s0 = initial_state(cfg.model, batch.attention_mask, torch.Generator().manual_seed(2))
    p = Plan(depths, None, {"k_max": 6}, init_state=s0)
    params = list(model.parameters())

    out = recurrent_loss(model, batch, cfg, p)
    g_anchor = [(a - b) / out.num_tokens for a, b in zip(torch.autograd.grad(out.sum_loss, params),
                                                         torch.autograd.grad(recurrent_loss(model, batch, cfg0, p)
                                                                             .sum_loss, params))]

    m_row = (batch.labels != IGNORE_INDEX).sum(1)
    eligible = [i for i in range(len(depths)) if depths[i] > K_a and m_row[i] > 0]
    with torch.no_grad():
        ell_a = {i: row_loss_by_hand(model, batch, i, s0, K_a, K_a) for i in eligible}
    ell_k = {i: row_loss_by_hand(model, batch, i, s0, int(depths[i]), W) for i in eligible}
    active = [i for i in eligible if ell_k[i] > ell_a[i] + margin]
    assert 0 < len(active) < len(eligible) and all(depths[i] > W for i in active), "pick a seed: hinge on for some"
    expected = torch.autograd.grad(sum(ell_k[i] for i in active) / len(eligible), params)
    for a, c in zip(g_anchor, expected):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-4)
    assert out.stats["anchor_active"] == (len(active), len(eligible))

    # The window matters here: differentiating all K_i iterations gives a gradient far outside the tolerance.
    full = torch.autograd.grad(sum(row_loss_by_hand(model, batch, i, s0, int(depths[i]), int(depths[i]))
                                   for i in active) / len(eligible), params)
    assert max(float((f - c).abs().max()) for f, c in zip(full, expected)) > 1e-2  # measured 0.08


def test_displacement_term_and_empty_sets():
    cfg = load_config(None, SMALL + ["objective.lambda_fp=1", "objective.lambda_anchor=1", "objective.anchor_depth=3"])
    torch.manual_seed(0)
    model = EcoRNA(cfg.model)
    batch = make_batch(3)
    s0 = initial_state(cfg.model, batch.attention_mask, torch.Generator().manual_seed(0))
    # every row at depth 1: I_fp and I_a are empty, both auxiliary means are 0 and the loss is the MLM sum
    ones = Plan(torch.ones(6, dtype=torch.long), None, {"k_max": 1}, init_state=s0)
    out = recurrent_loss(model, batch, cfg, ones)
    assert out.stats["displacement"] == (0.0, 0) and "anchor_hinge" not in out.stats
    torch.testing.assert_close(out.sum_loss.detach(), torch.as_tensor(out.stats["mlm_loss"][0]))
    # displacement: relative squared change of the last update over attention-valid positions, K_i >= 2 only
    depths = torch.tensor([2, 1, 3, 2, 1, 4])
    out = recurrent_loss(model, batch, load_config(None, SMALL + ["objective.lambda_anchor=0"]),
                         Plan(depths, None, {"k_max": 4}, init_state=s0))
    res = model(batch.input_ids, batch.attention_mask, depths, s0, k_max=4)
    v = batch.attention_mask[..., None].float()
    r = ((res.state - res.prev_state) ** 2 * v).sum((1, 2)) / (res.prev_state ** 2 * v).sum((1, 2))
    num, den = out.stats["displacement"]
    assert den == 4 and num == pytest.approx(float(r[depths >= 2].detach().sum()), rel=1e-5)
    assert out.totals["row_iterations"] == int(depths.sum())


def test_the_control_family_refuses_an_anchor_at_configuration():
    from pipeline.config import ConfigError

    cfg = load_config(None, ["family=eco_rna_control"])
    assert (cfg.objective.depth_law, cfg.objective.lambda_fp, cfg.objective.lambda_anchor) == ("fixed", 0.0, 0.0)
    with pytest.raises(ConfigError, match="objective.lambda_anchor: the fixed-depth control"):
        load_config(None, ["family=eco_rna_control", "objective.lambda_anchor=0.1"])


def test_fixed_wavefront_runs_k_cap_steps_with_the_same_update():
    """objective.fixed_wavefront: the plan asks for k_cap wavefront steps whatever the drawn depths; the leading steps
    have no active row, so loss and gradients equal those of the microbatch's own K_max (all three loss terms on)."""
    common = SMALL + ["objective.lambda_fp=0.5", "objective.lambda_anchor=0.7", "objective.backward_window=2",
                      "objective.k_cap=9", "objective.mu_k=3.0"]
    batch = make_batch(3)
    cfg = load_config(None, common)
    torch.manual_seed(0)
    model = EcoRNA(cfg.model)
    params = list(model.parameters())
    from pipeline.objectives.eco_rna import plan

    own = plan(batch, cfg, step=3, stream=0, index=1)
    fixed = plan(batch, load_config(None, common + ["objective.fixed_wavefront=true"]), step=3, stream=0, index=1)
    assert own.depths == fixed.depths and own.sync_max["k_max"] == max(own.depths) < 9
    assert fixed.sync_max == {"k_max": 9}
    results = []
    for p in (own, fixed):
        out = recurrent_loss(model, batch, cfg, p)
        results.append((out.sum_loss.detach(), torch.autograd.grad(out.sum_loss, params)))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    with pytest.raises(Exception, match="objective.fixed_wavefront"):
        load_config(None, SMALL + ["objective.fixed_wavefront=true", "objective.k_cap=null"])


def test_the_fixed_depth_control_trains_through_the_same_loss():
    """The control (launchers/configs/eco_rna_control_*.yaml) takes the recurrent objective's model call, host mask
    included: its loss is its plain masked-LM cross-entropy."""
    from pipeline.families import get_family
    from pipeline.objectives.eco_rna import plan

    cfg = load_config("launchers/configs/eco_rna_control_demo.yaml", [])
    torch.manual_seed(0)
    model = get_family(cfg.family).build_model(cfg.model)
    batch = make_batch(3)
    out = recurrent_loss(model, batch, cfg, plan(batch, cfg, step=0, stream=0, index=0))
    ce, m_row = per_row_ce(model(batch.input_ids, batch.attention_mask).logits, batch.labels)
    torch.testing.assert_close(out.sum_loss, ce.sum())
    assert out.num_tokens == int(m_row.sum()) > 0
