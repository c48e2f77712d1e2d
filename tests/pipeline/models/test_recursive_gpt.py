from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import load_config
from pipeline.data.batch import collate
from pipeline.families import get_family
from pipeline.models.recursive_gpt import RecursiveGPT, RecursiveGPTConfig, StandardGPT, StandardGPTConfig
from pipeline.objectives import causal_lm

REPO = Path(__file__).resolve().parents[3]

CONFIGS = REPO / "launchers" / "configs"

# (config file, overrides, paper figure, tolerance): paper 003, Tables 1-3 (Table 3: the 10M depth-16 ablations).
# The paper rounds to 0.1M (0.01B), so a count that rounds to its figure is within 0.05M (0.005B).
PAPER = [
    ("recursive_gpt_10m.yaml", [], 27.6e6, 0.05e6),
    ("recursive_gpt_100m.yaml", [], 124.0e6, 0.05e6),
    ("recursive_gpt_large.yaml", [], 404.1e6, 0.05e6),
    ("recursive_gpt_10m.yaml", ["model.share_norms=true"], 27.6e6, 0.05e6),  # "Shared norm parameters"
    ("recursive_gpt_10m.yaml", ["model.embed_dim=null"], 56.7e6, 0.05e6),  # "No Factorized Embeddings (H=640)"
    ("recursive_gpt_10m.yaml", ["model.embed_dim=null", "model.d_model=384", "model.n_heads=6"], 30.5e6,
     0.05e6),  # "No Factorized Embeddings (H=384)"
    ("standard_h384.yaml", [], 41.1e6, 0.05e6),
    ("standard_h384_fe192.yaml", [], 28.7e6, 0.05e6),
    ("standard_h3072.yaml", [], 1.22e9, 0.005e9),
]


def n_params(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name,overrides,paper,tol", PAPER, ids=[f"{p[0]}{p[1]}" for p in PAPER])
def test_paper_configs_count_matches_paper_and_built_model(name, overrides, paper, tol):
    cfg = load_config(CONFIGS / name, overrides)
    assert cfg.model.head_dim == 64  # the heads the counts assume
    predicted = cfg.model.num_params()
    assert abs(predicted - paper) <= tol, (predicted, paper)
    with torch.device("meta"):  # no memory: only shapes
        model = get_family(cfg.family).build_model(cfg.model)
    assert n_params(model) == predicted


def test_params_tool_build_matches_config(capsys):
    import tools.params

    assert tools.params.main(["--config", str(CONFIGS / "recursive_gpt_10m.yaml"), "--build"]) == 0
    out = capsys.readouterr().out
    assert "27,624,320" in out and "matches" in out


BABYLM = sorted(p for p in CONFIGS.glob("*.yaml") if p.name.startswith(("recursive_gpt_", "standard_"))
                and "demo" not in p.name)


@pytest.mark.parametrize("path", BABYLM, ids=lambda p: p.name)
def test_babylm_configs_stop_at_ten_epochs(path):
    """BabyLM: at most 10 epochs (10 x the track's words); max_steps only a cap behind the budgets; the cosine spans
    the 10 epochs' lower-bound step count (paper 003: 10M words ~ 13M tokens) at a pinned global batch."""
    cfg = load_config(path)
    assert cfg.family in ("recursive_gpt", "standard_gpt")
    words = {"babylm_10m": 10_000_000, "babylm_100m": 100_000_000}[Path(cfg.data.train_shards).name]
    t = cfg.train
    assert t.max_epochs == 10 and t.max_words == 10 * words
    assert t.global_batch_size == t.micro_batch_size * t.grad_accum_steps  # one device; N devices: micro / N
    ten_epochs = -(-13 * words // (t.global_batch_size * cfg.data.context_length))  # ceil(10 x 1.3 words / step)
    assert cfg.optim.schedule_steps == ten_epochs and t.max_steps >= 2 * ten_epochs


def test_the_paper_configs_are_among_the_babylm_configs():
    assert {"recursive_gpt_10m.yaml", "recursive_gpt_100m.yaml", "recursive_gpt_large.yaml", "standard_h384.yaml",
            "standard_h384_fe192.yaml", "standard_h3072.yaml"} <= {p.name for p in BABYLM}


@pytest.mark.parametrize("kw", [dict(share_norms=True), dict(embed_dim=None), dict(embed_dim=32, recurrence=1)])
def test_small_variants_count(kw):
    cfg = RecursiveGPTConfig(**{**dict(vocab_size=50, d_model=32, embed_dim=16, n_heads=4, recurrence=3,
                                       mlp_ratio=4.0), **kw})
    assert n_params(RecursiveGPT(cfg)) == cfg.num_params()


def test_validation_names_field():
    with pytest.raises(ValueError, match="model.embed_dim"):
        RecursiveGPTConfig(d_model=64, embed_dim=128, n_heads=4)
    with pytest.raises(ValueError, match="model.recurrence"):
        RecursiveGPTConfig(recurrence=0)
    with pytest.raises(ValueError, match="model.n_layers"):
        StandardGPTConfig(n_layers=0)
    with pytest.raises(ValueError, match="model.mlp_ratio"):  # 2.25 * 10 = 22.5 is not a width
        StandardGPTConfig(d_model=10, n_heads=5, mlp_ratio=2.25)


def small_pair(seed=0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=40, d_model=32, embed_dim=None, n_heads=4, mlp_ratio=3.0, attn_backend="sdpa")
    rec = RecursiveGPT(RecursiveGPTConfig(recurrence=1, **kw))
    std = StandardGPT(StandardGPTConfig(n_layers=1, **kw))
    for p in rec.parameters():  # random norms and biases too, so the copy is not checked on ones and zeros
        with torch.no_grad():
            p.add_(0.1 * torch.randn_like(p))
    rename = lambda k: k.replace("block.", "blocks.0.")  # noqa: E731
    state = {rename(k): v for k, v in rec.state_dict().items()}
    assert set(state) == set(std.state_dict())
    std.load_state_dict(state)
    return rec, std


def test_r1_unfactorized_equals_one_layer_standard_decoder():
    rec, std = small_pair()
    tokens = torch.randint(0, 40, (3, 11))
    mask = torch.arange(11)[None] < torch.tensor([[11], [6], [9]])
    torch.testing.assert_close(rec(tokens, mask), std(tokens, mask), atol=0, rtol=0)


def reference_logits(m: RecursiveGPT, tokens: torch.Tensor, gate: bool = True) -> torch.Tensor:
    """RecursiveGPT written out from its weights, one head at a time: per-step norms, per-head q/k RMSNorm, RoPE
    (rotate-half), causal softmax, the head-wise sigmoid gate of the shared block. tokens [B, L] -> logits [B, L, V]."""
    cfg = m.cfg
    B, L = tokens.shape
    nh, hd = cfg.n_heads, cfg.head_dim
    rms = lambda x, g, b=0: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * g + b  # noqa: E731
    angle = torch.arange(L)[:, None] * cfg.rope_theta ** (-torch.arange(0, hd, 2) / hd)  # [L, hd/2]
    cos, sin = angle.cos(), angle.sin()
    rot = lambda x: torch.cat([x[..., :hd // 2] * cos - x[..., hd // 2:] * sin,  # noqa: E731
                               x[..., hd // 2:] * cos + x[..., :hd // 2] * sin], -1)
    future = ~torch.ones(L, L, dtype=torch.bool).tril()  # [L, L]: key j > query i
    att, mlp = m.block.attn, m.block.mlp
    h = m.embed.embed.weight[tokens] @ m.embed.proj.weight.T  # [B, L, H]
    for r in range(cfg.recurrence):
        n = m.norms[r]
        a = rms(h, n.attn_norm.weight, n.attn_norm.bias)
        heads = []
        for j in range(nh):
            rows = slice(j * hd, (j + 1) * hd)
            q = rot(rms(a @ att.q_proj.weight[rows].T, n.q_norm.weight))  # [B, L, hd]
            k = rot(rms(a @ att.k_proj.weight[rows].T, n.k_norm.weight))
            v = a @ att.v_proj.weight[rows].T
            p = (q @ k.transpose(1, 2) / hd ** 0.5).masked_fill(future, float("-inf")).softmax(-1)  # [B, L, L]
            g = torch.sigmoid(a @ att.gate.weight[j]) if gate else torch.ones(B, L)  # [B, L]
            heads.append(g[..., None] * (p @ v))
        h = h + torch.cat(heads, -1) @ att.o_proj.weight.T
        h = h + F.gelu(rms(h, n.mlp_norm.weight, n.mlp_norm.bias) @ mlp.up_proj.weight.T) @ mlp.down_proj.weight.T
    return rms(h, m.final_norm.weight) @ m.head.down.weight.T @ m.head.out.weight.T


def test_recursive_model_matches_hand_written_gated_attention():
    torch.manual_seed(1)
    m = RecursiveGPT(RecursiveGPTConfig(vocab_size=40, d_model=32, embed_dim=16, n_heads=4, recurrence=3,
                                        mlp_ratio=3.0, attn_backend="sdpa"))
    assert not torch.any(m.block.attn.gate.weight)  # the gates start at sigmoid(0) = 0.5
    with torch.no_grad():  # random norms, biases and gates, so that nothing is checked on ones and zeros
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    tokens = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        out, ref = m(tokens), reference_logits(m, tokens)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out, reference_logits(m, tokens, gate=False), atol=1e-3)  # the gate matters here


def test_forward_flops_count_every_matrix():
    """forward_flops against torch's FLOP counter: matrices (the gate's included) counted by torch; the attention
    scores and weighted sum (4 L^2 H per step) added by hand where torch does not count the SDPA kernel (CPU)."""
    from torch.utils.flop_counter import FlopCounterMode

    kw = dict(vocab_size=50, d_model=32, n_heads=4, mlp_ratio=2.5, attn_backend="sdpa")
    L = 12
    for model in (RecursiveGPT(RecursiveGPTConfig(embed_dim=16, recurrence=3, **kw)),
                  StandardGPT(StandardGPTConfig(embed_dim=None, n_layers=2, **kw))):
        steps = getattr(model.cfg, "recurrence", None) or model.cfg.n_layers
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.randint(0, 50, (1, L)))
        counted = counter.get_total_flops()
        assert model.cfg.forward_flops(L) in (counted, counted + steps * 4 * L * L * 32)


@pytest.mark.parametrize("family", ["recursive", "standard"])
def test_causal_mask_later_tokens_do_not_change_earlier_outputs(family):
    torch.manual_seed(0)
    kw = dict(vocab_size=60, d_model=32, embed_dim=16, n_heads=4, mlp_ratio=4.0, attn_backend="sdpa")
    model = RecursiveGPT(RecursiveGPTConfig(recurrence=3, **kw)) if family == "recursive" else \
        StandardGPT(StandardGPTConfig(n_layers=2, **kw))
    tokens = torch.randint(0, 60, (2, 12))
    base = model(tokens)
    for t in (0, 5, 11):
        pert = tokens.clone()
        pert[:, t] = (pert[:, t] + 7) % 60
        out = model(pert)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t])  # position t itself does see its token
    # right padding: a padded row's real positions equal the unpadded row
    mask = torch.arange(12)[None] < torch.tensor([[12], [7]])
    torch.testing.assert_close(model(tokens, mask)[1, :7], model(tokens[1:, :7])[0], atol=1e-5, rtol=1e-5)


def test_depth_extrapolation_reuses_last_norms_and_share_norms():
    torch.manual_seed(0)
    cfg = RecursiveGPTConfig(vocab_size=30, d_model=16, embed_dim=8, n_heads=2, recurrence=2, mlp_ratio=2.0)
    m = RecursiveGPT(cfg)
    assert m.step_norms(0) is m.norms[0] and m.step_norms(5) is m.norms[1]
    tokens = torch.randint(0, 30, (2, 5))
    assert m(tokens, depth=1).shape == m(tokens, depth=4).shape == (2, 5, 30)
    assert not torch.allclose(m(tokens, depth=1), m(tokens, depth=4))
    shared = RecursiveGPT(RecursiveGPTConfig(**{**cfg.__dict__, "share_norms": True}))
    assert len(shared.norms) == 1 and shared.step_norms(1) is shared.norms[0]
    with pytest.raises(ValueError, match="depth"):
        m(tokens, depth=0)


def test_causal_lm_transform_loss_and_backward(tmp_path):
    cfg = load_config(REPO / "launchers" / "configs" / "recursive_gpt_demo.yaml",
                      ["model.vocab_size=100", "data.context_length=10", f"data.train_shards={tmp_path}"])
    tf = causal_lm.make_transform(cfg)
    rng = np.random.default_rng(0)
    s = tf(np.arange(10, 15, dtype=np.uint16), rng)
    assert s["input_ids"].tolist() == [1, 10, 11, 12, 13, 14] and s["labels"].tolist() == [10, 11, 12, 13, 14, 2]
    long = tf(np.arange(10, 40, dtype=np.uint16), rng)
    assert len(long["input_ids"]) == 10 and long["input_ids"][0] == 1 and long["labels"][-1] == 2
    assert np.array_equal(long["labels"][:-1], long["input_ids"][1:])
    batch = collate([dict(s, sample_id="a"), dict(long, sample_id="b")], pad_id=0)
    model = get_family(cfg.family).build_model(cfg.model)
    p = causal_lm.plan(batch, cfg, step=0, stream=0, index=0)
    assert p.sync_max == {}
    out = causal_lm.loss(model, batch, cfg, p)
    assert out.num_tokens == 16 and "words" not in out.totals  # no tokenizer.model beside these "shards"
    ref = F.cross_entropy(model(batch.input_ids, batch.attention_mask).flatten(0, 1), batch.labels.flatten(),
                          reduction="sum")
    torch.testing.assert_close(out.sum_loss, ref)
    out.sum_loss.backward()
    missing = [n for n, q in model.named_parameters() if q.grad is None or not torch.any(q.grad != 0)]
    assert not missing


@pytest.mark.parametrize("family", ["recursive", "standard"])
def test_packed_row_equals_documents_run_alone(family):
    """A packed row [doc A | doc B | pad] gives each document the logits it gets alone (masking and positions)."""
    rec, std = small_pair(3)
    model = rec if family == "recursive" else std
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 40, (7,), generator=g), torch.randint(3, 40, (5,), generator=g)
    row = torch.cat([a, b, torch.zeros(3, dtype=torch.long)])[None]  # [1, 15]
    docs = torch.tensor([[0] * 7 + [1] * 5 + [-1] * 3])
    pos = torch.tensor([list(range(7)) + list(range(5)) + [0] * 3])
    mask = docs >= 0
    with torch.no_grad():
        packed = model(row, mask, document_ids=docs, position_ids=pos)
        alone_a, alone_b = model(a[None]), model(b[None])
    torch.testing.assert_close(packed[0, :7], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[0, 7:12], alone_b[0], atol=1e-5, rtol=1e-5)
