"""Held-out masked-LM loss and perplexity of a ProtLingo (or dense ESM2) model: paper 002's ablation metric.

Every sequence is cropped, framed and masked once by the family's own training transform (15% of residues: 80%
<mask>, 10% random, 10% kept), with a generator owned by (seed, index) (``reconstruction.heldout_samples``), so two
evaluations of the same weights see the same positions. The loss is the mean cross-entropy over every masked
position of the set (a sum over batches, not a mean of batch means), the perplexity its exponential; the accuracy
the share of masked positions whose arg-max is the original residue.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pipeline.data.batch import collate
from pipeline.data.tokenizer import IGNORE_INDEX


def mlm_eval(model, cfg, samples: list[dict], pad_id: int, batch_size: int = 16) -> dict:
    """samples: transformed held-out samples (``heldout_samples``) -> {loss, perplexity, accuracy, tokens}."""
    ce_sum, correct, n = 0.0, 0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for i in range(0, len(samples), batch_size):
            b = collate(samples[i:i + batch_size], pad_id=pad_id)
            logits = model(b.input_ids.to(device), b.attention_mask.to(device)).logits.float()
            labels = b.labels.to(device)
            sup = labels != IGNORE_INDEX
            ce_sum += float(F.cross_entropy(logits[sup], labels[sup], reduction="sum"))
            correct += int((logits[sup].argmax(-1) == labels[sup]).sum())
            n += int(sup.sum())
    if not n:
        raise ValueError("no masked position to evaluate (sequences too short?)")
    loss = ce_sum / n
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": correct / n, "tokens": n}
