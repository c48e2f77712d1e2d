"""Held-out masked reconstruction across recurrent depths (paper 000, Sec. 3.2 and A.1).

Every depth sees the same crops, the same masks (seeded per sequence) and the same initial state: one seed-fixed,
position-indexed Gaussian table [context_length, d], so the sweep isolates the effect of extra core applications.
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.data.batch import collate
from pipeline.data.tokenizer import PAD_ID
from pipeline.models.eco_rna import initial_state
from pipeline.objectives.eco_rna import (reconstruction_sums, state_table,  # noqa: F401 (state_table re-exported)
                                         supervised_sums)
from pipeline.objectives.masking import IGNORE_INDEX


def heldout_samples(sequences: list, transform, seed: int) -> list[dict]:
    """Crop + frame + corrupt each sequence (uint8 ids) once, with an rng owned by (seed, index). A transform that
    reads each record's meta (a supervised task's, pipeline/tasks) takes (tokens, meta) records."""
    out = []
    for i, item in enumerate(sequences):
        rng = np.random.default_rng([seed, i])
        s = transform(item[0], rng, item[1]) if getattr(transform, "reads_meta", False) else transform(item, rng)
        s["sample_id"] = str(i)
        out.append(s)
    return out


def _batches(samples: list[dict], batch_size: int, desc: str | None):
    """Collated batches of ``batch_size`` samples in order; ``desc``: a progress bar over them on stderr."""
    starts = range(0, len(samples), batch_size)
    if desc is not None:
        from pipeline.eval.cli import progress

        starts = progress(starts, desc=desc, unit="batch")
    for i in starts:
        yield collate(samples[i:i + batch_size], pad_id=PAD_ID)


def _summary(acc: list) -> dict:
    ce, correct, n = acc
    return {"loss": ce / n, "accuracy": correct / n, "tokens": n}


@torch.no_grad()
def reconstruction_sweep(model, cfg, samples: list[dict], depths: list[int], batch_size: int = 32,
                         seed: int = 0, desc: str | None = None) -> dict[int, dict]:
    """{K: {"loss": token-mean CE, "accuracy": top-1 on supervised tokens, "tokens": n}} for each K.

    Each batch runs one trajectory read out at every K (``model.logits_at_depths``): max(depths) core calls, not
    sum(depths). ``desc``: a progress bar over the batches on stderr.
    """
    sums = {k: [0.0, 0, 0] for k in depths}  # K -> [CE sum, correct, supervised tokens]
    table = state_table(cfg.model, cfg.data.context_length, seed)
    for batch in _batches(samples, batch_size, desc):
        for k, acc in reconstruction_sums(model, batch, depths, table).items():
            sums[k] = [a + b for a, b in zip(sums[k], acc)]
    return {k: _summary(acc) for k, acc in sums.items()}


@torch.no_grad()
def reconstruction_adaptive(model, cfg, samples: list[dict], tol: float, max_depth: int, batch_size: int = 32,
                            seed: int = 0, desc: str | None = None) -> dict:
    """:func:`reconstruction_sweep`'s loss and accuracy with every sequence at its adaptive depth
    (``EcoRNA.adaptive``: until its relative displacement is < ``tol``, at most ``max_depth``), on the same crops,
    masks and initial states; plus "depths" (per sample, in order) and "row_iterations" (core row-applications)."""
    acc, depths, row_iterations = [0.0, 0, 0], [], 0
    table = state_table(cfg.model, cfg.data.context_length, seed)
    for b in _batches(samples, batch_size, desc):
        sup = b.labels != IGNORE_INDEX
        out = model.adaptive(b.input_ids, b.attention_mask, initial_state(cfg.model, b.attention_mask, table=table),
                             tol, max_depth)
        acc = [x + y for x, y in zip(acc, supervised_sums(out.logits[sup], b.labels[sup]))]
        depths += out.depths.tolist()
        row_iterations += out.row_iterations
    return {**_summary(acc), "depths": depths, "row_iterations": row_iterations}
