"""ProtLingo's objective: the ESM-2 crop/frame/mask transform, S + m * A for the engine's token normalization
(Eq. 17-18), and the routing entropy derived from the step's token counts."""
import math

import numpy as np
import pytest
import torch

from pipeline.config import load_config
from pipeline.data.batch import Batch
from pipeline.data.protein_tokenizer import ProteinTokenizer
from pipeline.models.protlingo import ProtLingo
from pipeline.objectives import protlingo as obj
from pipeline.objectives.masking import IGNORE_INDEX

TINY = ["family=protlingo", "model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.d_ff=24",
        "model.moe_layers=[0, 1]", "model.num_experts=3", "model.memory_layers=[1]", "model.memory_radius=1",
        "data.context_length=32", "objective.lambda_aux=0.3", "objective.lambda_z=0.05"]


def test_transform_crops_frames_and_masks_residues_only():
    cfg = load_config(None, TINY)
    transform = obj.make_transform(cfg)
    protein = ProteinTokenizer().encode("MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEK")  # 53 residues
    starts, selected, to_random = set(), 0, 0
    for seed in range(200):
        out = transform(protein, np.random.default_rng(seed))
        ids, labels = out["input_ids"], out["labels"]
        assert len(ids) == 32 and ids[0] == ProteinTokenizer.cls_id and ids[-1] == ProteinTokenizer.eos_id
        body = np.where(labels == IGNORE_INDEX, ids, labels)[1:-1]
        start = bytes(protein).find(bytes(body.astype(np.uint8)))
        assert start >= 0  # a contiguous window of the protein
        starts.add(start)
        sel = labels != IGNORE_INDEX
        assert not sel[0] and not sel[-1] and sel.sum() == 4  # floor(0.15 * 30) residues
        selected += int(sel.sum())
        changed = sel & (ids != ProteinTokenizer.mask_id) & (ids != labels)
        assert np.all((ids[changed] >= 4) & (ids[changed] < 24))  # random draws: the 20 standard amino acids
        to_random += int(changed.sum())
    assert len(starts) > 15  # the window is random
    assert 0.03 < to_random / selected < 0.15  # ~10% random, minus draws equal to the original


def test_loss_is_mlm_sum_plus_token_weighted_moe_losses():
    cfg = load_config(None, TINY)
    torch.manual_seed(0)
    model = ProtLingo(cfg.model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 24, (3, 12), generator=g)
    ids[:, 0], ids[:, -1] = 0, 2
    mask = torch.ones(3, 12, dtype=torch.bool)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 3], labels[0, 5] = ids[:, 3], ids[0, 5]
    batch = Batch(ids, labels, mask, ["a", "b", "c"])
    out = obj.loss(model, batch, cfg, obj.plan(batch, cfg, step=0, stream=0, index=0))
    fwd = model(ids, mask)
    ce = torch.nn.functional.cross_entropy(fwd.logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX,
                                           reduction="sum")
    want = ce + 4 * (0.3 * fwd.moe_aux + 0.05 * fwd.moe_z)
    assert out.num_tokens == 4 and float(out.sum_loss) == pytest.approx(float(want), rel=1e-6)
    assert sum(out.totals[f"moe/L00/tokens/e{e}"] for e in range(3)) == 36
    assert out.stats["memory/L01/gate_mean"][1] == 36


def test_routing_entropy_from_counts():
    rec = {"moe/L03/tokens/e0": 30.0, "moe/L03/tokens/e1": 10.0, "moe/L03/tokens/e2": 0.0, "moe/L03/tokens/e3": 60.0}
    got = obj.derive_metrics(rec)
    h = -(0.3 * math.log(0.3) + 0.1 * math.log(0.1) + 0.6 * math.log(0.6))
    assert got["moe/L03/entropy"] == pytest.approx(h / math.log(4))
    assert got["moe/L03/effective_experts"] == pytest.approx(math.exp(h))
    even = obj.derive_metrics({f"moe/L00/tokens/e{e}": 5.0 for e in range(4)})
    assert even["moe/L00/entropy"] == pytest.approx(1.0) and even["moe/L00/effective_experts"] == pytest.approx(4)


def test_the_moe_loss_reduction_sums_or_averages_the_layers():
    """objective.moe_loss_reduction: 'sum' adds the per-layer L_aux and L_z (Switch, ST-MoE, Megatron), 'mean' (the
    default) averages them; with 2 MoE layers the auxiliary part of the loss doubles exactly."""
    losses = {}
    for how in ("mean", "sum"):
        cfg = load_config(None, TINY + [f"objective.moe_loss_reduction={how}"])
        torch.manual_seed(0)
        model = ProtLingo(cfg.model)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(4, 24, (3, 12), generator=g)
        ids[:, 0], ids[:, -1] = 0, 2
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, 3] = ids[:, 3]
        batch = Batch(ids, labels, torch.ones(3, 12, dtype=torch.bool), ["a", "b", "c"])
        out = obj.loss(model, batch, cfg, obj.plan(batch, cfg, step=0, stream=0, index=0))
        ce = float(out.stats["mlm_loss"][0])  # a device scalar: the step reads statistics once
        losses[how] = float(out.sum_loss) - ce
    assert losses["mean"] > 0 and losses["sum"] == pytest.approx(2 * losses["mean"], rel=1e-5)
    with pytest.raises(Exception, match="objective.moe_loss_reduction: must be one of mean, sum"):
        load_config(None, TINY + ["objective.moe_loss_reduction=max"])
