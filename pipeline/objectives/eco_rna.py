"""Eco-RNA training objective: terminal masked reconstruction at a fixed depth.

Returns the *summed* token cross-entropy and the supervised-token count of one microbatch; the engine divides by the
supervised-token count of the whole optimizer step (all ranks, all microbatches), so that the update is the exact
global token mean however the tokens fall across microbatches (paper A.7).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.data.tokenizer import NucleotideTokenizer
from pipeline.models.eco_rna import initial_state
from pipeline.objectives.masking import IGNORE_INDEX, bert_mask


@dataclass
class LossOutput:
    sum_loss: torch.Tensor  # scalar: sum of per-token cross-entropy over supervised tokens
    num_tokens: int  # supervised tokens in this microbatch
    metrics: dict = field(default_factory=dict)  # extra scalars to log (already means, not sums)


def step_generator(seed: int, step: int, micro: int, rank: int) -> torch.Generator:
    """A generator owned by (seed, step, microbatch, rank): nothing random depends on global state or history."""
    state = np.random.SeedSequence([seed, step, micro, rank]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def make_transform(cfg):
    """Crop to the context, frame with <cls>/<eos>, corrupt. One sequence, all randomness from ``rng``."""
    tok = NucleotideTokenizer
    m = cfg.data.masking
    pool = NucleotideTokenizer.residue_ids(cfg.data.molecule)
    body = cfg.data.context_length - 2

    def transform(tokens: np.ndarray, rng: np.random.Generator) -> dict:
        if len(tokens) > body:
            start = int(rng.integers(0, len(tokens) - body + 1))
            tokens = tokens[start:start + body]
        framed = np.concatenate([[tok.cls_id], tokens, [tok.eos_id]])
        inputs, labels = bert_mask(framed, rng, select_prob=m.select_prob, mask_prob=m.mask_prob,
                                   random_prob=m.random_prob, mask_id=tok.mask_id, num_special=tok.num_special,
                                   random_pool=pool)
        return {"input_ids": inputs, "labels": labels}

    return transform


def mlm_loss(model, batch, cfg, *, step: int, micro: int, rank: int) -> LossOutput:
    """batch: pipeline.data.loader.Batch on the model's device; model: the DeepSpeed engine (or a bare EcoRNA)."""
    gen = step_generator(cfg.seed, step, micro, rank)
    s0 = initial_state(cfg.model, batch.attention_mask, generator=gen)
    logits = model(batch.input_ids, batch.attention_mask, cfg.objective.train_depth, s0)  # [B, L, V]
    sum_loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return LossOutput(sum_loss, int((batch.labels != IGNORE_INDEX).sum()))
