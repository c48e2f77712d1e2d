"""ProtLingo training objective (paper 002, Eq. 16-18): masked LM on UniRef + the MoE auxiliary losses.

Per microbatch this returns ``S + m * A`` (the engine's exact token normalization, as for Eco-RNA): S the summed
cross-entropy over the masked positions, m their number and A = lambda_aux L_aux + lambda_z L_z the microbatch's
MoE losses (means over real tokens; over the MoE layers the mean, or the sum: objective.moe_loss_reduction). The
update is then (1 / Z) sum (S + m A): Eq. 17 over every masked token of the step plus Eq. 16 weighted by each
microbatch's share of the masked tokens.

Sample transform (ESM-2 / BioNeMo): a sequence longer than ``data.context_length - 2`` residues is cropped to a
uniformly random window of that many residues, then framed as <cls> window <eos> (so a crop keeps both special
tokens, as BioNeMo crops after framing the full protein). 15% of the residues (never <cls>/<eos>) are selected;
80% become <mask>, 10% a random one of the 20 standard amino acids, 10% stay (``data.masking``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError
from pipeline.data.protein_tokenizer import ProteinTokenizer
from pipeline.objectives.causal_lm import Plan
from pipeline.models.layers import host_tensor
from pipeline.objectives.eco_rna import LossOutput
from pipeline.objectives.masking import IGNORE_INDEX, make_mlm_transform


MOE_LOSS_REDUCTIONS = ("mean", "sum")


@dataclass
class ProtLingoObjectiveConfig:
    lambda_aux: float = 0.01  # load-balancing loss weight (Eq. 16); the paper gives none: the project's choice
    lambda_z: float = 0.001  # router z-loss weight (ST-MoE's value); the paper gives none
    # How the per-layer L_aux and L_z combine over the MoE layers; the paper does not say. "mean" (default) keeps
    # the weight of the balancing term independent of the number of MoE layers (27 in the 150M config), so one
    # lambda serves every depth; "sum" is Switch / ST-MoE / Megatron's per-layer sum (27x stronger there at equal
    # lambda: divide lambda by the MoE layer count to match it).
    moe_loss_reduction: str = "mean"

    def __post_init__(self):
        for name in ("lambda_aux", "lambda_z"):
            if getattr(self, name) < 0:
                raise ConfigError(f"objective.{name}: must be >= 0, got {getattr(self, name)}")
        if self.moe_loss_reduction not in MOE_LOSS_REDUCTIONS:
            raise ConfigError(f"objective.moe_loss_reduction: must be one of {', '.join(MOE_LOSS_REDUCTIONS)}, got "
                              f"{self.moe_loss_reduction!r}")


def plan(batch, cfg, *, step: int, stream: int, index: int) -> Plan:
    """Nothing to draw before the forward, nothing to synchronize across ranks: the supervised and the real-token
    counts and the real tokens' positions (which the MoE layers route), read on the host (the loader's batch) so
    that the loss reads nothing back from the device."""
    real = batch.attention_mask.reshape(-1).nonzero().squeeze(1)  # the host batch: no device read
    return Plan(supervised=batch.num_supervised, tokens=len(real), real_index=real)


def make_transform(cfg):
    """Crop (uniform window of context_length - 2 residues), frame <cls> .. <eos>, corrupt. Randomness from ``rng``."""
    tok = ProteinTokenizer
    return make_mlm_transform(cfg.data.context_length, cfg.data.masking, cls_id=tok.cls_id, eos_id=tok.eos_id,
                              mask_id=tok.mask_id, num_special=4,  # ids 0-3 are <cls> <pad> <eos> <unk>
                              random_pool=ProteinTokenizer.residue_ids())


def loss(model, batch, cfg, p: Plan) -> LossOutput:
    """batch: pipeline.data.loader.Batch on the model's device; model: the DeepSpeed engine or a bare ProtLingo."""
    obj = cfg.objective
    real_index = None if p.real_index is None else host_tensor(p.real_index, torch.long, batch.input_ids.device)
    out = model(batch.input_ids, batch.attention_mask, real_index=real_index)
    ce = F.cross_entropy(out.logits.float().transpose(1, 2), batch.labels, ignore_index=IGNORE_INDEX,
                         reduction="sum")
    m = p.supervised if p.supervised is not None else int((batch.labels != IGNORE_INDEX).sum())
    stats = {"mlm_loss": (ce.detach(), m)}
    rows, length = batch.input_ids.shape
    real = p.tokens if p.tokens is not None else int(batch.attention_mask.sum())
    # what the step executes: the routed experts on the real tokens only, W_q without a backward
    totals = {"flops": cfg.model.train_flops(rows, length, real)}
    aux = ce.new_zeros(())
    if out.moe_aux is not None:
        if obj.moe_loss_reduction == "sum":  # per-layer terms added; "mean" is what the model returns
            aux = (obj.lambda_aux * torch.stack([r.aux for r in out.routing.values()]).sum()
                   + obj.lambda_z * torch.stack([r.z for r in out.routing.values()]).sum())
        else:
            aux = obj.lambda_aux * out.moe_aux + obj.lambda_z * out.moe_z
        stats["moe/aux_loss"] = (out.moe_aux.detach(), 1)
        stats["moe/z_loss"] = (out.moe_z.detach(), 1)
    for layer, r in out.routing.items():
        n = r.counts.sum()
        stats[f"moe/L{layer:02d}/router_z"] = (r.z.detach() * n, n)
        for e in range(len(r.counts)):
            totals[f"moe/L{layer:02d}/tokens/e{e}"] = r.counts[e]
    rows = cfg.model.routes * cfg.model.table_rows
    for layer, mem in out.memory.items():
        stats[f"memory/L{layer:02d}/gate_mean"] = (mem.gate_sum, mem.tokens)
        stats[f"memory/L{layer:02d}/rows_addressed"] = (mem.rows_addressed, rows)  # mean over ranks of their own
        stats[f"memory/L{layer:02d}/rows_per_batch"] = (mem.distinct_addresses, rows)  # this microbatch's share
        stats[f"memory/L{layer:02d}/collisions"] = (mem.distinct_keys - mem.distinct_addresses, mem.distinct_keys)
    return LossOutput(sum_loss=ce + m * aux, num_tokens=m, stats=stats, totals=totals)


def derive_metrics(rec: dict) -> dict:
    """Step metrics computed from the all-reduced token counts: per MoE layer the normalized routing entropy
    H(f) / log E of the fraction f_e of the step's tokens routed to each expert, and the effective number of
    experts exp H(f) (the paper reports 0.971 and 3.85 of 4 on Swiss-Prot)."""
    layers: dict = {}
    for k, v in rec.items():
        if k.startswith("moe/L") and "/tokens/e" in k:
            layer = k.split("/")[1]
            layers.setdefault(layer, []).append(v)
    out = {}
    for layer, counts in layers.items():
        c = np.asarray(counts, dtype=np.float64)
        if c.sum() <= 0 or len(c) < 2:
            continue
        f = c / c.sum()
        h = -float(np.sum(f[f > 0] * np.log(f[f > 0])))
        out[f"moe/{layer}/entropy"] = h / math.log(len(c))
        out[f"moe/{layer}/effective_experts"] = math.exp(h)
    return out

