"""EcoRNA.adaptive: per-row stopping on the relative displacement (Eq. 9) against straightforward references."""
import pytest
import torch

from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state, relative_displacement

MAX_DEPTH = 6


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = EcoRNAConfig(d_model=16, n_heads=2, n_kv_heads=1, d_ff=32, n_prelude=1, n_core=1, n_coda=1,
                       sigma_init=0.3, unpad=False)
    model = EcoRNA(cfg).eval()
    lengths = torch.tensor([12, 5, 9, 7, 12, 3, 10, 6])
    B, L = len(lengths), int(lengths.max())
    tokens = torch.randint(4, cfg.vocab_size, (B, L))
    mask = torch.arange(L)[None] < lengths[:, None]  # [B, L] right-padded rows of different lengths
    tokens = tokens.masked_fill(~mask, 0)
    s0 = initial_state(cfg, mask, torch.Generator().manual_seed(1))
    with torch.no_grad():  # reference displacement r_k [B] after each k, one fixed-depth forward per k
        r = torch.stack([relative_displacement(o.state, o.prev_state, mask, 1e-6)
                         for o in (model(tokens, mask, k, s0) for k in range(1, MAX_DEPTH + 1))], 1)  # [B, K]
    return model, tokens, mask, s0, lengths, r


def test_tol_zero_equals_fixed_max_depth(setup):
    model, tokens, mask, s0, _, _ = setup
    with torch.no_grad():
        out = model.adaptive(tokens, mask, s0, tol=0.0, max_depth=MAX_DEPTH)
        ref = model.logits_at_depths(tokens, mask, [MAX_DEPTH], s0)[MAX_DEPTH]
    assert out.depths.tolist() == [MAX_DEPTH] * len(tokens)
    assert out.row_iterations == MAX_DEPTH * len(tokens)
    torch.testing.assert_close(out.logits[mask], ref[mask], rtol=0, atol=1e-5)


def test_rows_stop_at_their_first_small_displacement_with_the_fixed_depth_logits(setup):
    model, tokens, mask, s0, lengths, r = setup
    tol = float(r[:, 2].sort().values[len(r) // 2])  # splits the rows: about half stop after 3 iterations
    below = r < tol  # [B, K]
    below[:, -1] = True  # max depth ends every row
    expected = (below.float().argmax(1) + 1).tolist()  # first k with r_k < tol
    with torch.no_grad():
        out = model.adaptive(tokens, mask, s0, tol=tol, max_depth=MAX_DEPTH)
    assert out.depths.tolist() == expected
    assert len(set(expected)) > 1  # depths vary per sequence
    assert out.row_iterations == sum(expected) < MAX_DEPTH * len(tokens)  # finished rows get no more core calls
    for i, (k, n) in enumerate(zip(expected, lengths.tolist())):  # per sequence, alone, unpadded, fixed depth k
        with torch.no_grad():
            ref = model.logits_at_depths(tokens[i:i + 1, :n], mask[i:i + 1, :n], [k], s0[i:i + 1, :n])[k][0]
        torch.testing.assert_close(out.logits[i, :n], ref, rtol=0, atol=1e-5)
        assert float(out.displacement[i]) == pytest.approx(float(r[i, k - 1]), rel=1e-4)


def test_core_runs_only_on_active_rows(setup):
    model, tokens, mask, s0, _, r = setup
    tol = float(r[:, 2].sort().values[len(r) // 2])
    seen = []  # rows the core is applied to, per call
    handle = model.core.register_forward_hook(lambda mod, args, out: seen.append(out.shape[0]))
    try:
        with torch.no_grad():
            out = model.adaptive(tokens, mask, s0, tol=tol, max_depth=MAX_DEPTH)
    finally:
        handle.remove()
    depths = out.depths.tolist()
    assert seen == [sum(d >= k for d in depths) for k in range(1, max(depths) + 1)]


@pytest.mark.parametrize("kw,msg", [({"tol": -1.0, "max_depth": 2}, "tol"), ({"tol": 0.1, "max_depth": 0},
                                                                              "max_depth")])
def test_bad_arguments(setup, kw, msg):
    model, tokens, mask, s0, _, _ = setup
    with pytest.raises(ValueError, match=msg):
        model.adaptive(tokens, mask, s0, **kw)
