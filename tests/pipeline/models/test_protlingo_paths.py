"""ProtLingo's paper paths that a loss value alone cannot see (paper 002): the MoE's L_aux and L_z reach the router
(Eq. 16 trains it), the memory sits before its block once it is no longer zero (Eq. 12), and hashed addresses spread
over the table like a uniform hash on real proteins. Each test fails for one deliberate breakage: the aux losses
detached, the memory applied after its block, every address hashed to one row."""
import gzip
import math

import pytest
import torch

from conftest import REPO
from pipeline.config import load_config
from pipeline.data.protein_tokenizer import ProteinTokenizer
from pipeline.models.protlingo import ProtLingo

TINY = ["family=protlingo", "model.d_model=32", "model.n_layers=3", "model.n_heads=4", "model.d_ff=64",
        "model.moe_shared_hidden=32", "model.moe_layers=[0,1]", "model.num_experts=4", "model.memory_layers=[1]",
        "data.context_length=96"]
SAMPLE = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"


def proteins(n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` real UniRef90 members of the shipped sample, cropped to ``length`` residues, tokenized with
    <cls> and <eos> and right-padded -> (tokens [n, length + 2], attention mask)."""
    seqs = [r.split("\n", 1)[1].replace("\n", "") for r in gzip.decompress(SAMPLE.read_bytes()).decode().split(">")[1:]]
    tok = ProteinTokenizer()
    rows = [tok.encode(s[:length]) for s in seqs[:n]]
    width = max(len(r) for r in rows) + 2
    ids = torch.full((n, width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r) + 2] = torch.tensor([tok.cls_id, *r.tolist(), tok.eos_id])
        mask[i, :len(r) + 2] = True
    return ids, mask


def model_of(overrides=()):
    cfg = load_config(None, TINY + list(overrides))
    torch.manual_seed(0)
    return ProtLingo(cfg.model), cfg


@pytest.mark.parametrize("term", ["moe_aux", "moe_z"])
def test_the_aux_losses_reach_every_router(term):
    model, _ = model_of()
    ids, mask = proteins(6, 60)
    out = model(ids, mask)
    routers = [layer.ffn.router.weight for layer in model.layers if hasattr(layer.ffn, "router")]
    grads = torch.autograd.grad(getattr(out, term), routers, allow_unused=True)
    for i, g in enumerate(grads):
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, (term, i)


def reference_logits(model: ProtLingo, ids, mask):
    """The forward the paper states, written out from the model's parts: the memory of block i applied to the
    hidden state before block i (Eq. 12), then the block."""
    from pipeline.models.layers import rope_cache

    cfg = model.cfg
    real = mask.bool()
    residue = real & (ids != cfg.cls_token_id) & (ids != cfg.eos_token_id)
    h = model.embed(ids, real)
    rope = rope_cache(ids.shape[1], cfg.head_dim, cfg.rope_theta, h.device, torch.float32)
    for i, layer in enumerate(model.layers):
        if str(i) in model.memory:
            h, _ = model.memory[str(i)](h, residue, real)
        h, _ = layer(h, rope, real)
    return model.head(model.final_norm(h), model.embed.weight)


def test_the_memory_acts_before_its_block_once_it_is_trained():
    """At initialization the memory adds zero (tables and convolution are zero), so where it sits cannot be seen;
    after one optimizer step on real proteins it adds a delta, and the model must equal the paper's order."""
    model, _ = model_of()
    ids, mask = proteins(6, 60)
    labels = ids.clone()
    with torch.no_grad():
        assert torch.equal(model(ids, mask).logits, reference_logits(model, ids, mask))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = torch.nn.functional.cross_entropy(model(ids, mask).logits.transpose(1, 2), labels)
    loss.backward()
    opt.step()
    with torch.no_grad():
        memory = model.memory["1"]
        delta_free = model(ids, mask).logits
        assert memory.tables.abs().max() > 0  # the lookup now returns non-zero rows: delta != 0
        torch.testing.assert_close(delta_free, reference_logits(model, ids, mask), rtol=0, atol=1e-6)
        # ... and the memory matters now: without it the logits differ
        alpha = memory.alpha.clone()
        memory.alpha.zero_()
        assert (model(ids, mask).logits - delta_free).abs().max() > 1e-4
        memory.alpha.copy_(alpha)


def test_hashed_addresses_spread_like_a_uniform_hash_on_real_proteins():
    """bits 2, radius 2: (2^2 + 1)^5 = 3,125 window keys hashed into 1,009 rows. For K distinct (route, key) pairs
    of one route thrown uniformly into M rows, the expected number of distinct rows is M (1 - (1 - 1/M)^K); on every
    route, over real UniRef90 sequences, the hash must reach at least 90% of it (it does better: consecutive keys
    land on distinct rows), i.e. collide no more than a random function would."""
    model, cfg = model_of(["model.memory_bits=2", "model.memory_radius=2", "model.memory_table_size=1009"])
    assert not cfg.model.exact_addresses and cfg.model.table_rows == 1009
    ids, mask = proteins(40, 90)
    memory = model.memory["1"]
    real = mask.bool()
    residue = real & (ids != cfg.model.cls_token_id) & (ids != cfg.model.eos_token_id)
    with torch.no_grad():
        h = model.embed(ids, real)
        rows, keys = memory.addresses(memory.norm(h), residue)  # [B, L, R] each
    M = cfg.model.table_rows
    for r in range(cfg.model.routes):
        k, a = keys[..., r][real], rows[..., r][real]
        distinct_keys = torch.unique(k).numel()
        expected = M * (1 - (1 - 1 / M) ** distinct_keys)
        got = torch.unique(a).numel()
        assert distinct_keys > 200, distinct_keys  # enough keys for the comparison to mean something
        assert 0.9 * expected <= got <= min(distinct_keys, M), (r, distinct_keys, got, round(expected))
        # same key -> same row (an address is a function of the window)
        pairs = torch.unique(torch.stack([k, a], 1), dim=0)
        assert pairs.shape[0] == distinct_keys
    assert math.isfinite(expected)
