"""What the loader hands to training: a microbatch (:class:`Batch`), padded from samples (:func:`collate`) or packed
from whole documents (:func:`pack_rows`; pipeline/data/loader.py, "Batching"). Evaluation and validation collate
their held-out samples with the same function."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.data.tokenizer import IGNORE_INDEX


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64
    labels: torch.Tensor  # [B, L] int64, IGNORE_INDEX where unsupervised
    attention_mask: torch.Tensor  # [B, L] bool, True at real tokens
    sample_ids: list  # "[source:]shard/key@epoch" (clusters: "...@epoch#member"), one per sample (packed: several)
    sources: list | None = None  # source name per sample, aligned with sample_ids
    document_ids: torch.Tensor | None = None  # [B, L] int64 packed rows: document index in its row, -1 at padding
    position_ids: torch.Tensor | None = None  # [B, L] int64 packed rows: position within its document, 0 at padding
    stream: int = 0  # this rank's loader stream that produced it
    state: dict | None = None  # that stream's position after this batch (see the module docstring)
    # (global stream, its microbatch index): who made it, whatever rank reads the stream; seeds per-batch draws
    origin: tuple[int, int] = (0, 0)
    fetch: dict | None = None  # remote shard sets: the fetch counters since the previous batch (data/remote.py)
    # Supervised tasks (pipeline/tasks): per-position targets beyond one class id a token, [B, L, ...] (a reactivity
    # task's two probes: float, NaN where unmeasured or at padding); None for the language-model objectives
    targets: torch.Tensor | None = None
    # The batch's supervised units when they are not its labelled tokens (a task's sequences, valid pair cells or
    # measured values, summed from its samples' "units"): what the step's exact normalization counts
    units: int | None = None

    def pin_memory(self) -> "Batch":
        """Page-locked copies of the tensors (DataLoader(pin_memory=True) calls this in its pinning thread), so that
        the copy to the GPU runs asynchronously."""
        pin = lambda t: t.pin_memory() if t is not None else None  # noqa: E731
        return Batch(pin(self.input_ids), pin(self.labels), pin(self.attention_mask), self.sample_ids, self.sources,
                     pin(self.document_ids), pin(self.position_ids), self.stream, self.state, self.origin,
                     self.fetch, targets=pin(self.targets), units=self.units)

    @property
    def num_supervised(self) -> int:
        """What the loss is normalized by (summed over a step's microbatches and ranks, pipeline/train/step.py): the
        tokens with a label, or the task's own units when its samples say (``units``)."""
        if self.units is not None:
            return self.units
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device, non_blocking: bool = False):
        """The tensors on ``device``; ``non_blocking`` copies from pinned memory without waiting (pin_memory)."""
        move = lambda t: t.to(device, non_blocking=non_blocking) if t is not None else None  # noqa: E731
        opt = [move(t) for t in (self.document_ids, self.position_ids)]
        return Batch(move(self.input_ids), move(self.labels), move(self.attention_mask),
                     self.sample_ids, self.sources, *opt, self.stream, self.state, self.origin, self.fetch,
                     targets=move(self.targets), units=self.units)


def collate(samples: list[dict], pad_id: int) -> Batch:
    """Samples ({"input_ids", "labels"} [n], and a task's "targets" [n, ...] and "units") -> a Batch padded to the
    longest: pad_id, IGNORE_INDEX, False; targets with NaN (float) or IGNORE_INDEX (integer)."""
    L = max(len(s["input_ids"]) for s in samples)
    ids = np.full((len(samples), L), pad_id, dtype=np.int64)
    labels = np.full((len(samples), L), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(samples), L), dtype=bool)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], True
    targets = None
    if "targets" in samples[0]:
        first = np.asarray(samples[0]["targets"])
        fill = np.nan if first.dtype.kind == "f" else IGNORE_INDEX
        targets = np.full((len(samples), L, *first.shape[1:]), fill, dtype=first.dtype)
        for i, s in enumerate(samples):
            targets[i, :len(s["targets"])] = s["targets"]
        targets = torch.from_numpy(targets)
    units = sum(int(s["units"]) for s in samples) if "units" in samples[0] else None
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(mask),
                 [s["sample_id"] for s in samples], [s.get("source") for s in samples], targets=targets, units=units)


def pack_rows(rows: list[list[dict]], row_length: int, pad_id: int, separator: int | None = None) -> Batch:
    """rows: per row, whole documents ({"input_ids", "labels"} [n]) -> Batch [B, row_length], padded at the end.

    ``separator`` (e.g. <eos>) is appended after each document as input and label, so the model learns to end
    documents; ``document_ids`` (document index within the row, -1 at padding) lets an attention mask keep documents
    apart and ``position_ids`` restarts at 0 for each document.
    """
    B = len(rows)
    ids = np.full((B, row_length), pad_id, dtype=np.int64)
    labels = np.full((B, row_length), IGNORE_INDEX, dtype=np.int64)
    doc = np.full((B, row_length), -1, dtype=np.int64)
    pos = np.zeros((B, row_length), dtype=np.int64)
    sample_ids, sources = [], []
    extra = int(separator is not None)
    for r, docs in enumerate(rows):
        at = 0
        for d, s in enumerate(docs):
            n = len(s["input_ids"])
            if at + n + extra > row_length:
                raise ValueError(f"row {r}: documents need more than row_length {row_length} tokens")
            ids[r, at:at + n], labels[r, at:at + n] = s["input_ids"], s["labels"]
            if extra:
                ids[r, at + n] = labels[r, at + n] = separator
            doc[r, at:at + n + extra], pos[r, at:at + n + extra] = d, np.arange(n + extra)
            at += n + extra
            sample_ids.append(s["sample_id"])
            sources.append(s.get("source"))
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(doc >= 0), sample_ids, sources,
                 torch.from_numpy(doc), torch.from_numpy(pos))
