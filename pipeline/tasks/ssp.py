"""RNA secondary-structure prediction (paper 000, Sec. 3.5 and A.5; bpRNA TR0 / VL0 / TS0, Singh et al. 2019): a
pairwise head over the terminal coda features, scored by strict global full-matrix micro-F1 with precision and
recall.

The metric (A.5): each sequence of L residues has a complete L x L matrix of cells (i, j), both orders, the
diagonal included; a cell is positive in the reference when i and j pair, and predicted positive when the head's pair
probability sigmoid(z_ij) is above :data:`THRESHOLD` (strictly: ``p > 0.5``). The valid cells of every sequence
(two residues of it: never <cls>, <eos> or a batch's padding) are pooled over the whole data set, and
TP, FP and FN give F1 = 2 TP / (2 TP + FP + FN), precision TP / (TP + FP) and recall TP / (TP + FN) ("micro":
pooled cells, not a mean over sequences; "strict": no shifted pair counts). Per-sequence F1 (the same count on one
sequence's matrix) is reported beside it for the case studies (Figure A1).

Readers (each error names the file and line): bpRNA's CSV splits (``id,sequence,structure,base_pairs,len``; the
dot-bracket and the 1-based pair list must agree), RNAGym's PseudoBase CSV (``sequence,secondary_structure``),
``.bpseq`` files and ``.dbn`` files (bpRNA's ``#Name:`` records or ``>name`` records), or a folder of them.
Pseudoknot brackets are read by pipeline/data/structure.py.

Labels: residue r's framed position is r + 1; its label is its partner's framed position, or its own when unpaired
(a pair with itself is never a pair), IGNORE_INDEX at <cls> and <eos>. One supervised unit per valid cell (L^2 per
sequence): the step's exact normalization gives the mean binary cross-entropy over every valid cell of the global
batch.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.data.structure import pairs_to_partner, parse_bpseq, parse_dbn, parse_dot_bracket, partner_to_pairs
from pipeline.data.tokenizer import IGNORE_INDEX, NucleotideTokenizer
from pipeline.errors import ConfigError
from pipeline.tasks.base import Record, Task, TaskConfig, frame_labels, register_task

THRESHOLD = 0.5  # a cell is predicted paired when its probability is strictly above this (A.5)


@dataclass
class SSPConfig(TaskConfig):
    """task: {name: ssp}. channels, blocks: the pair head's width and residual 3 x 3 convolutions; pos_weight: the
    weight of a paired cell in the binary cross-entropy (pairs are about 1/L of the cells)."""

    name: str = "ssp"
    channels: int = 32
    blocks: int = 2
    pos_weight: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        for key in ("channels", "blocks"):
            if getattr(self, key) < 1:
                raise ConfigError(f"task.{key}: must be >= 1, got {getattr(self, key)}")
        if not self.pos_weight > 0:
            raise ConfigError(f"task.pos_weight: must be > 0, got {self.pos_weight}")

    def head(self, d_model: int) -> dict:
        return {"name": "PairHead", "first": False,
                "kwargs": {"d_model": d_model, "channels": self.channels, "blocks": self.blocks}}


# ---- readers --------------------------------------------------------------------------------------------------------
_TOK = NucleotideTokenizer("rna")


def _record(rid: str, seq: str, partner: np.ndarray, where: str) -> Record:
    seq = seq.strip().upper()
    bad = _TOK.invalid_positions(seq)
    if bad.size:
        raise ValueError(f"{where}: character {seq[bad[0]]!r} at position {bad[0] + 1} of {rid} is not a nucleotide")
    if len(partner) != len(seq):
        raise ValueError(f"{where}: structure of {len(partner)} positions for a sequence of {len(seq)} ({rid})")
    return Record(rid, seq, partner, where)


def _read_csv(path: Path) -> list[Record]:
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        cols = [c.strip() for c in reader.fieldnames or []]
        reader.fieldnames = cols
        struct = next((c for c in ("structure", "secondary_structure", "dot_bracket") if c in cols), None)
        if "sequence" not in cols or (struct is None and "base_pairs" not in cols):
            raise ValueError(f"{path}: a structure CSV needs a 'sequence' column and 'structure' (dot-bracket) or "
                             f"'base_pairs' (header: {cols})")
        id_col = next((c for c in ("id", "psuedobase_ids", "pseudobase_ids", "name") if c in cols), None)
        out = []
        for row in reader:
            where = f"{path}:{reader.line_num}"
            seq = (row["sequence"] or "").strip()
            rid = (row.get(id_col) or "").strip() if id_col else f"row{reader.line_num}"
            if not seq:
                raise ValueError(f"{where}: empty sequence ({rid})")
            partner = None
            if struct is not None:
                s = (row[struct] or "").strip()
                if len(s) != len(seq):
                    raise ValueError(f"{where}: structure of {len(s)} characters for a sequence of {len(seq)} ({rid})")
                partner = parse_dot_bracket(s, where)
            if "base_pairs" in cols and (row["base_pairs"] or "").strip():
                try:
                    pairs = json.loads(row["base_pairs"])
                except ValueError:
                    raise ValueError(f"{where}: base_pairs {row['base_pairs'][:40]!r} is not a JSON list") from None
                listed = pairs_to_partner(pairs, len(seq), where)
                if partner is not None and not np.array_equal(listed, partner):
                    i = int(np.flatnonzero(listed != partner)[0])
                    raise ValueError(f"{where}: base_pairs and the dot-bracket disagree at position {i + 1} ({rid})")
                partner = listed
            if "len" in cols and (row["len"] or "").strip() and int(row["len"]) != len(seq):
                raise ValueError(f"{where}: len {row['len']} but the sequence has {len(seq)} residues ({rid})")
            out.append(_record(rid, seq, partner, where))
    return out


def read(path, tcfg=None) -> list[Record]:
    """A structure file (CSV, .bpseq, .dbn) or a folder of them -> Records (label: the partner vector)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.suffix.lower() in (".csv", ".bpseq", ".dbn", ".db"))
        if not files:
            raise ValueError(f"{path}: no .csv, .bpseq or .dbn file")
        return [r for f in files for r in read(f)]
    suffix = path.suffix.lower()
    if suffix == ".csv":
        out = _read_csv(path)
    elif suffix == ".bpseq":
        seq, partner = parse_bpseq(path.read_text(encoding="utf-8-sig"), str(path))
        out = [_record(path.stem, seq, partner, f"{path}:1")]
    elif suffix in (".dbn", ".db"):
        out = [_record(name, seq, partner, f"{path}:{line}")
               for name, seq, partner, line in parse_dbn(path.read_text(encoding="utf-8-sig"), str(path))]
    else:
        raise ValueError(f"{path}: not a structure file (.csv with id,sequence,structure; .bpseq; .dbn)")
    if not out:
        raise ValueError(f"{path}: no structure record")
    return out


def meta(record: Record) -> dict:
    return {"id": record.id, "pairs": [list(p) for p in partner_to_pairs(record.label)]}


def encode(meta: dict, start: int, n: int, tcfg, where: str) -> dict:
    """The kept residues' partners (pairs with a base outside the crop dropped), framed (module docstring)."""
    own = np.arange(n)
    lab = own.copy()
    for i, j in meta["pairs"]:
        i, j = i - start, j - start
        if 0 <= i < n and 0 <= j < n:
            lab[i], lab[j] = j, i
    return {"labels": frame_labels(lab + 1), "units": n * n}


# ---- loss and metric -------------------------------------------------------------------------------------------------
def cells(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [B, L, L] fp32, reference [B, L, L] bool, valid cells [B, L, L] bool) of a batch (module docstring)."""
    lab = batch.labels
    L = lab.shape[1]
    tok = lab != IGNORE_INDEX  # residues
    ar = torch.arange(L, device=lab.device)
    ref = (lab[:, :, None] == ar) & (lab != ar)[:, :, None] & tok[:, :, None]
    return logits.float(), ref, tok[:, :, None] & tok[:, None, :]


def predicted(logits: torch.Tensor) -> torch.Tensor:
    """Cells whose pair probability is above THRESHOLD (probabilities in float64, so that no probability within
    float32 rounding of 0.5 is decided by the logit's sign instead)."""
    return torch.sigmoid(logits.double()) > THRESHOLD


def counts(pred: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor) -> tuple[int, int, int]:
    """(TP, FP, FN) over the valid cells."""
    return (int((pred & ref & valid).sum()), int((pred & ~ref & valid).sum()), int((~pred & ref & valid).sum()))


def scores(tp: int, fp: int, fn: int) -> dict:
    """F1, precision and recall of pooled counts; 0 where a denominator is 0 (scikit-learn's zero_division 0)."""
    return {"f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0,
            "precision": tp / (tp + fp) if tp + fp else 0.0, "recall": tp / (tp + fn) if tp + fn else 0.0}


def pooled_metrics(reference: np.ndarray, probability: np.ndarray) -> dict:
    """F1, precision and recall of pooled cells (1-D arrays over the valid cells of every matrix): the metric's
    definition, which the sweep computes as sums of :func:`counts` per batch."""
    ref = np.asarray(reference, dtype=bool)
    pred = np.asarray(probability, dtype=np.float64) > THRESHOLD
    return scores(int((pred & ref).sum()), int((pred & ~ref).sum()), int((~pred & ref).sum()))


def loss(pred: torch.Tensor, batch, tcfg: SSPConfig) -> tuple:
    logits, ref, valid = cells(pred, batch)
    bce = F.binary_cross_entropy_with_logits(logits, ref.float(), reduction="none",
                                             pos_weight=torch.tensor(tcfg.pos_weight, device=logits.device))
    total = (bce * valid).sum()
    tp, fp, fn = counts(predicted(logits.detach()), ref, valid)
    return total, {"f1": (2 * tp, 2 * tp + fp + fn)}


def validate(pred: torch.Tensor, batch, tcfg: SSPConfig) -> dict:
    logits, ref, valid = cells(pred, batch)
    bce = F.binary_cross_entropy_with_logits(logits, ref.float(), reduction="none",
                                             pos_weight=torch.tensor(tcfg.pos_weight, device=logits.device))
    tp, fp, fn = counts(predicted(logits), ref, valid)
    return {"loss": ((bce * valid).sum(), int(valid.sum())), "f1": (2 * tp, 2 * tp + fp + fn),
            "precision": (tp, tp + fp), "recall": (tp, tp + fn)}


def collect(pred: torch.Tensor, batch, tcfg) -> list:
    """Per sequence: {"tp", "fp", "fn", "n", "seq", "pred": predicted pairs (i < j, 0-based residues), "ref":
    reference pairs}."""
    logits, ref, valid = cells(pred, batch)
    hit = predicted(logits)
    out = []
    for b in range(len(logits)):
        n = int(valid[b].diagonal().sum())
        p, r = hit[b, 1:n + 1, 1:n + 1], ref[b, 1:n + 1, 1:n + 1]  # residues: framed positions 1..n
        tp, fp, fn = counts(p, r, torch.ones_like(p))
        out.append({"tp": tp, "fp": fp, "fn": fn, "n": n, "seq": _TOK.decode(batch.input_ids[b, 1:n + 1].tolist()),
                    "pred": torch.triu(p, 1).nonzero().tolist(), "ref": torch.triu(r, 1).nonzero().tolist()})
    return out


def metrics(entries: list, tcfg) -> tuple[dict, dict]:
    tp, fp, fn = (sum(e[k] for e in entries) for k in ("tp", "fp", "fn"))
    per_seq = [scores(e["tp"], e["fp"], e["fn"])["f1"] for e in entries]
    return scores(tp, fp, fn), {"tp": tp, "fp": fp, "fn": fn, "per_sequence_f1": per_seq}


TASK = register_task(Task(
    name="ssp", config_cls=SSPConfig, read=read, formats="bpRNA CSV (id,sequence,structure,base_pairs), PseudoBase "
    "CSV, .bpseq, .dbn, or a folder of them", meta=meta, encode=encode, loss=loss, validate=validate,
    collect=collect, metrics=metrics, columns=("f1", "precision", "recall"), crop_eval=False,
    figures=("pipeline.eval.task_plots:structure_metrics", "pipeline.eval.task_plots:structure_cases")))
