"""ProtLingo (paper 002): the ESM2 backbone against Hugging Face EsmForMaskedLM, the upcycled MoE against the dense
FFN, the router's straight-through gradient and losses against hand computations, the latent N-gram memory's
addresses and residual against Eq. 2-12 written out by hand, and the parameter accounting."""
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO
from pipeline.checkpoint import load_hf_directory, load_trained_model
from pipeline.config import load_config
from pipeline.models.protlingo import (FFN, LatentNgramMemory, ProtLingo, ProtLingoConfig, UpcycledMoE,
                                       config_from_hf, hf_to_protlingo, upcycle_ffn)

ESM_8M = ["--size", "8M"]


@pytest.fixture(scope="module")
def esm8m(tmp_path_factory):
    """A random ESM2 of the real 8M shape (6/320/20/1280), saved by transformers as a HF directory."""
    out = tmp_path_factory.mktemp("esm") / "esm2_8M"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_random_esm2.py"), *ESM_8M, "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True)
    return out


def padded_batch(seed=1, lengths=(40, 31, 12), n_mask=3):
    """<cls> residues <eos> <pad>..., a few <mask> tokens (token dropout rescales by the observed mask ratio)."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(lengths), max(lengths)
    tokens = torch.randint(4, 24, (B, L), generator=g)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, n in enumerate(lengths):
        tokens[i, 0], tokens[i, n - 1], tokens[i, n:] = 0, 2, 1
        mask[i, :n] = True
        tokens[i, torch.randint(1, n - 1, (n_mask,), generator=g)] = 32
    return tokens, mask


def hf_logits(hf_dir, tokens, mask):
    from transformers import EsmForMaskedLM

    hf = EsmForMaskedLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        return hf(tokens, attention_mask=mask.long()).logits


def test_plain_esm2_equals_hf(esm8m):
    hf_cfg, state = load_hf_directory(esm8m)
    cfg = config_from_hf(hf_cfg, attn_backend="sdpa")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_ff) == (6, 320, 20, 1280)
    model = ProtLingo(cfg).eval()
    model.load_state_dict(hf_to_protlingo(state, cfg.n_layers), strict=True)
    tokens, mask = padded_batch()
    with torch.no_grad():
        ours = model(tokens, mask)
    assert ours.moe_aux is None and not ours.memory
    diff = (ours.logits - hf_logits(esm8m, tokens, mask))[mask].abs().max()
    assert diff <= 1e-5, diff


def test_upcycled_export_still_equals_hf(esm8m, tmp_path):
    out = tmp_path / "up"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "upcycle_esm2.py"), "--esm", str(esm8m), "--out",
                           str(out), "--moe-layers", "all", "--num-experts", "4", "--memory-layers", "0,3,5"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "upcycle: 100%" in proc.stderr and " 3/3 " in proc.stderr  # the bar on stderr
    trained = load_trained_model(out)
    cfg = trained.cfg.model
    assert cfg.moe_layers == list(range(6)) and cfg.memory_layers == [0, 3, 5] and cfg.num_experts == 4
    tokens, mask = padded_batch()
    with torch.no_grad():
        ours = trained.model(tokens, mask)
    assert set(ours.routing) == set(range(6)) and set(ours.memory) == {0, 3, 5}
    # tokens do go to different experts, so exactness does not rest on one expert
    assert sum(int((r.counts > 0).sum()) > 1 for r in ours.routing.values()) >= 3
    diff = (ours.logits - hf_logits(esm8m, tokens, mask))[mask].abs().max()
    assert diff <= 1e-5, diff


def test_upcycle_tool_errors_name_the_flag(esm8m, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, str(REPO / "tools" / "upcycle_esm2.py"), "--esm", str(esm8m),  # noqa: E731
                                     "--out", str(tmp_path / "x"), *a], cwd=REPO, capture_output=True, text=True)
    proc = run("--moe-layers", "3-9")
    assert proc.returncode == 2 and "--moe-layers '3-9': layers must lie in 0..5" in proc.stderr
    proc = run("--config", str(REPO / "launchers" / "configs" / "protlingo_150m.yaml"))
    assert proc.returncode == 2 and "model.d_ff is 2560 but" in proc.stderr and "gives 1280" in proc.stderr
    assert not (tmp_path / "x").exists()


# ---- upcycled MoE --------------------------------------------------------------------------------------------------
def tiny_cfg(**kw):
    base = dict(d_model=16, n_layers=2, n_heads=2, d_ff=24, moe_layers=[0], num_experts=3, moe_shared_hidden=10)
    return ProtLingoConfig(**{**base, **kw})


def dense_and_moe(cfg, perturb=0.0):
    torch.manual_seed(0)
    dense = FFN(cfg.d_model, cfg.d_ff)
    moe = UpcycledMoE(cfg)
    state = upcycle_ffn({f"ffn.{k}": v for k, v in dense.state_dict().items()}, "ffn.", cfg, perturb,
                        torch.Generator().manual_seed(1))
    missing, unexpected = moe.load_state_dict({k[4:]: v for k, v in state.items()}, strict=False)
    assert missing == ["router.weight"] and not unexpected
    return dense, moe


def test_split_reproduces_the_dense_ffn_for_every_expert():
    cfg = tiny_cfg()
    dense, moe = dense_and_moe(cfg)
    x = torch.randn(50, cfg.d_model)
    for e in range(cfg.num_experts):
        got = moe.shared(x) + moe.experts[e](x)
        assert torch.allclose(got, dense(x), atol=1e-6), e
    _, noisy = dense_and_moe(cfg, perturb=0.1)
    assert torch.equal(noisy.experts[0].fc1.weight, moe.experts[0].fc1.weight)  # the primary stays exact
    assert not torch.equal(noisy.experts[1].fc1.weight, moe.experts[1].fc1.weight)
    assert torch.equal(noisy.experts[1].fc1.bias, moe.experts[1].fc1.bias)  # biases are not perturbed


def test_one_expert_equals_dense_ffn_in_outputs_and_gradients():
    cfg = tiny_cfg(num_experts=1)
    dense, moe = dense_and_moe(cfg)
    x = torch.randn(3, 7, cfg.d_model, requires_grad=True)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[2, 4:] = False
    y, info = moe(x, mask)
    g = torch.randn_like(y)
    (y[mask] * g[mask]).sum().backward()
    x_grad, x.grad = x.grad.clone(), None
    yd = dense(x)
    (yd[mask] * g[mask]).sum().backward()
    assert torch.allclose(y[mask], yd[mask], atol=1e-6)
    assert torch.allclose(x_grad, x.grad, atol=1e-6)
    S = cfg.shared_hidden
    w1 = torch.cat([moe.shared.fc1.weight.grad, moe.experts[0].fc1.weight.grad])
    assert torch.allclose(w1, dense.fc1.weight.grad, atol=1e-6)
    w2 = torch.cat([moe.shared.fc2.weight.grad, moe.experts[0].fc2.weight.grad], 1)
    assert torch.allclose(w2, dense.fc2.weight.grad, atol=1e-6)
    assert torch.allclose(moe.shared.fc2.bias.grad, dense.fc2.bias.grad, atol=1e-6)
    assert dense.fc1.weight.grad[:S].abs().sum() > 0
    assert float(info.counts.sum()) == int(mask.sum()) and float(info.aux.detach()) == pytest.approx(1.0)


def test_router_gradient_is_the_straight_through_form():
    """d/dW_r of <G, y> equals the finite difference of sum_t <G_t, routed_{e_t}(x_t)> p_{e_t}(W) / p_{e_t}(W_0)
    with the selections e_t held at W_0: the selected expert is unscaled, its probability carries the gradient."""
    cfg = tiny_cfg()
    torch.manual_seed(3)
    moe = UpcycledMoE(cfg).double()
    nn_init = torch.nn.init
    for e in moe.experts:  # distinct experts, so the router gradient is not zero
        nn_init.normal_(e.fc1.weight)
    nn_init.normal_(moe.router.weight)
    x = torch.randn(1, 40, cfg.d_model, dtype=torch.float64)
    mask = torch.ones(1, 40, dtype=torch.bool)
    G = torch.randn(1, 40, cfg.d_model, dtype=torch.float64)
    y, _ = moe(x, mask)
    (y * G).sum().backward()
    W0 = moe.router.weight.detach().clone()
    flat = x[0]
    with torch.no_grad():
        chosen = (flat @ W0.T).argmax(-1)
        routed = torch.stack([moe.experts[int(e)](flat[t]) for t, e in enumerate(chosen)])
        c = (routed * G[0]).sum(-1)  # [T]

    def surrogate(W):
        logp = torch.log_softmax(flat @ W.T, -1).gather(1, chosen[:, None]).squeeze(1)
        logp0 = torch.log_softmax(flat @ W0.T, -1).gather(1, chosen[:, None]).squeeze(1)
        return float((c * torch.exp(logp - logp0)).sum())

    fd = torch.zeros_like(W0)
    eps = 1e-6
    for i in range(W0.shape[0]):
        for j in range(W0.shape[1]):
            d = torch.zeros_like(W0)
            d[i, j] = eps
            fd[i, j] = (surrogate(W0 + d) - surrogate(W0 - d)) / (2 * eps)
    assert fd.abs().max() > 1e-2
    # The router runs in fp32 (kept so under bf16 too), hence the tolerance of a float64 finite difference.
    assert torch.allclose(moe.router.weight.grad, fd, atol=1e-5, rtol=1e-4)
    assert torch.allclose(y, y.detach())  # the forward output is the unscaled shared + selected expert
    with torch.no_grad():
        assert torch.allclose(y[0], moe.shared(flat) + routed, atol=1e-12)


def test_load_balancing_and_z_loss_by_hand():
    cfg = tiny_cfg(num_experts=2)
    moe = UpcycledMoE(cfg)
    with torch.no_grad():  # logits = [x_0, -x_0]: the router reads the first channel only
        moe.router.weight.zero_()
        moe.router.weight[0, 0], moe.router.weight[1, 0] = 1.0, -1.0
    x = torch.zeros(4, cfg.d_model)
    x[:, 0] = torch.tensor([1.0, 2.0, -0.5, 0.0])
    expert, weight, info = moe.route(x)
    logits = torch.tensor([[1.0, -1.0], [2.0, -2.0], [-0.5, 0.5], [0.0, 0.0]])
    p = logits.softmax(-1)
    assert expert.tolist() == [0, 0, 1, 0]  # argmax; a tie goes to the first expert
    f = torch.tensor([3 / 4, 1 / 4])
    assert float(info.aux) == pytest.approx(float(2 * (f * p.mean(0)).sum()), abs=1e-6)
    lse = [math.log(math.exp(a) + math.exp(-a)) for a in (1.0, 2.0, 0.5, 0.0)]
    assert float(info.z) == pytest.approx(sum(v * v for v in lse) / 4, abs=1e-6)
    assert torch.equal(weight, torch.ones(4)) and info.counts.tolist() == [3.0, 1.0]


# ---- latent N-gram memory ------------------------------------------------------------------------------------------
def memory_cfg(**kw):
    base = dict(d_model=8, n_layers=1, n_heads=2, d_ff=16, memory_layers=[0], memory_bits=2, memory_radius=1,
                memory_dim=3, memory_latent=5)
    return ProtLingoConfig(**{**base, **kw})


def test_addresses_are_the_mixed_radix_window_of_route_symbols():
    cfg = memory_cfg()  # R = 4 routes of 2 bits, N = 3: (2^2 + 1)^3 = 125 exact rows
    mem = LatentNgramMemory(cfg)
    assert cfg.exact_addresses and cfg.table_rows == 125
    torch.manual_seed(0)
    h = torch.randn(2, 6, cfg.d_model)
    residue = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)  # <cls> .. <eos> <pad>
    h_bar = mem.norm(h)
    rows, _ = mem.addresses(h_bar, residue)
    q = (h_bar @ mem.W_q.weight.T).view(2, 6, 4, 2)
    for b in range(2):
        for i in range(6):
            for r in range(4):
                def sym(j):  # Eq. 4, and 0 outside the sequence / at special tokens and padding
                    if not 0 <= j < 6 or not residue[b, j]:
                        return 0
                    return 1 + int(q[b, j, r, 0] > 0) + 2 * int(q[b, j, r, 1] > 0)
                want = sym(i - 1) + 5 * sym(i) + 25 * sym(i + 1)
                assert int(rows[b, i, r]) == want, (b, i, r)


def test_hashed_addresses_stay_in_the_table_and_collisions_are_counted():
    cfg = memory_cfg(memory_radius=3, memory_table_size=40)  # 5^7 windows into 40 rows
    assert not cfg.exact_addresses and cfg.table_rows == 40
    mem = LatentNgramMemory(cfg).train()
    h = torch.randn(3, 30, cfg.d_model)
    real = torch.ones(3, 30, dtype=torch.bool)
    _, info = mem(h, real, real)
    assert info.distinct_keys > info.distinct_addresses  # more windows than rows must collide
    assert info.distinct_addresses <= cfg.routes * 40 and info.rows_addressed == info.distinct_addresses
    rows, key = mem.addresses(mem.norm(h), real)
    assert int(rows.min()) >= 0 and int(rows.max()) < 40 and int(key.max()) < cfg.window_keys


def test_memory_counts_equal_unique_over_the_real_tokens():
    """The counts are made without reading the device (scatter, sort); the reference is torch.unique over the real
    positions, here with padded rows so that the mask matters."""
    cfg = memory_cfg(memory_radius=3, memory_table_size=40)
    mem = LatentNgramMemory(cfg).train()
    h = torch.randn(3, 30, cfg.d_model)
    real = torch.arange(30)[None] < torch.tensor([[30], [17], [4]])
    _, info = mem(h, real, real)
    rows, key = mem.addresses(mem.norm(h), real)
    flat = rows + torch.arange(cfg.routes) * cfg.table_rows
    route = torch.arange(cfg.routes).expand_as(key)
    assert int(info.distinct_addresses) == torch.unique(flat[real]).numel()
    assert int(info.distinct_keys) == torch.unique(torch.stack([route[real], key[real]], -1).reshape(-1, 2),
                                                   dim=0).shape[0]
    assert int(info.tokens) == int(real.sum()) and int(info.rows_addressed) == torch.unique(flat[real]).numel()


def test_memory_is_zero_at_init_and_follows_eq_8_to_12():
    cfg = memory_cfg()
    mem = LatentNgramMemory(cfg)
    torch.manual_seed(1)
    h = torch.randn(2, 6, cfg.d_model)
    real = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    residue = real.clone()
    residue[:, 0] = False
    out, info = mem(h, residue, real)
    assert torch.equal(out, h) and float(info.gate_sum) == pytest.approx(0.5 * 10)  # delta = 0, g = sigmoid(0)
    with torch.no_grad():  # non-zero tables, convolution and alpha, then Eq. 8-12 by hand
        mem.tables.normal_()
        mem.conv.weight.normal_()
        mem.conv.bias.normal_()
        mem.alpha.fill_(0.7)
        for n in (mem.norm, mem.k_norm, mem.v_norm):
            n.weight.uniform_(0.5, 1.5)
    out, _ = mem(h, residue, real)
    rms = lambda t, w: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_eps) * w  # noqa: E731
    h_bar = rms(h, mem.norm.weight)
    rows, _ = mem.addresses(h_bar, residue)
    m = torch.stack([mem.tables[r][rows[..., r]] for r in range(cfg.routes)], 2).reshape(2, 6, -1)  # Eq. 6-7
    z = m @ mem.W_m.weight.T  # Eq. 8
    k, v = rms(z @ mem.W_k.weight.T, mem.k_norm.weight), rms(z @ mem.W_v.weight.T, mem.v_norm.weight)  # Eq. 9
    g = torch.sigmoid((h_bar * k).sum(-1, keepdim=True) / math.sqrt(cfg.d_model))  # Eq. 10
    u = g * v
    w = mem.conv.weight[:, 0]  # [d, 3]: taps i-2, i-1, i
    conv = torch.zeros_like(u)
    for i in range(6):
        for tap, j in enumerate((i - 2, i - 1, i)):
            if j >= 0:
                conv[:, i] += u[:, j] * w[:, tap]
    conv += mem.conv.bias
    delta = (u + F.silu(conv)) * real[..., None]  # Eq. 11
    assert torch.allclose(out, h + 0.7 * delta, atol=1e-5)  # Eq. 12


# ---- configs and accounting ----------------------------------------------------------------------------------------
def test_config_counts_equal_the_built_model():
    for cfg in (tiny_cfg(), memory_cfg(), tiny_cfg(moe_layers=[0, 1], memory_layers=[1], memory_radius=2,
                                                    memory_table_size=10)):
        model = ProtLingo(cfg)
        assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_protlingo_150m_config_lands_near_the_papers_active_count():
    cfg = load_config(REPO / "launchers" / "configs" / "protlingo_150m.yaml").model
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.num_experts) == (30, 640, 2560, 4)
    assert len(cfg.moe_layers) == 27 and cfg.routes == 320 and cfg.memory_dim == 8 and cfg.memory_latent == 256
    with torch.device("meta"):
        built = sum(p.numel() for p in ProtLingo(cfg).parameters())
    assert built == cfg.num_params()
    assert abs(cfg.num_active_params() - 153e6) < 1e6, cfg.num_active_params()  # paper: 153M active


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"model.moe_layers: distinct block indices in \[0, 2\)"):
        tiny_cfg(moe_layers=[0, 2])
    with pytest.raises(ValueError, match=r"model.moe_shared_hidden: must be in \[1, d_ff=24\)"):
        tiny_cfg(moe_shared_hidden=24)
    with pytest.raises(ValueError, match=r"model.memory_bits: d_model 8 is not divisible by 3"):
        memory_cfg(memory_bits=3)
    with pytest.raises(ValueError, match=r"model.moe_backend: must be one of"):
        tiny_cfg(moe_backend="fast")


def test_memory_tables_get_their_own_lr_and_no_decay():
    from pipeline.train import param_groups

    model = ProtLingo(tiny_cfg(memory_layers=[0, 1], memory_radius=1))
    optim = load_config(None, ["family=protlingo", "optim.lr=0.002", "optim.weight_decay=0.1",
                               "optim.lr_scale={memory_tables: 10}"]).optim
    groups = {g["name"]: g for g in param_groups(model, optim)}
    assert sorted(groups) == ["decay", "memory_tables_no_decay", "no_decay"]
    tables = groups["memory_tables_no_decay"]
    assert {id(p) for p in tables["params"]} == {id(m.tables) for m in model.memory.values()}
    assert tables["lr"] == pytest.approx(0.02) and tables["weight_decay"] == 0.0
    assert groups["decay"]["lr"] == 0.002 and groups["decay"]["weight_decay"] == 0.1


def test_protlingo_650m_config_counts():
    """ESM2-650M upcycled the 150M way (launchers/configs/protlingo_650m.yaml): the counts its header states, equal
    to the built model's (on the meta device)."""
    cfg = load_config(REPO / "launchers" / "configs" / "protlingo_650m.yaml").model
    assert (cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.num_experts, len(cfg.moe_layers)) == (33, 1280, 5120, 4, 30)
    with torch.device("meta"):
        model = ProtLingo(cfg)
        built = sum(p.numel() for p in model.parameters())
    assert built == cfg.num_params() == 1_305_989_156
    assert cfg.num_active_params() == 667_950_116 and cfg.num_buffer_values() == 6_000_000
