"""nRC non-coding RNA family classification (paper 000, Sec. 3.5 and A.5; Fiannaca et al. 2017): 13 Rfam classes, a
light classifier over the terminal ``<cls>`` representation, accuracy and per-class accuracy.

Reader: FASTA (plain or gzip) whose header is ``>ID CLASS`` (the nRC files: ``>RF00001_AF095839_1_346-228 5S_rRNA``,
DNA alphabet, CRLF). A class outside ``task.classes`` is one error naming the file and line. The published train,
validation and test files are read the same way; ``tools/prepare_task.py --val-fraction`` holds out part of a
training file when the validation file is not at hand.

Labels: the class index at the ``<cls>`` position (IGNORE_INDEX elsewhere); one supervised unit per sequence, so the
step's exact normalization gives the mean cross-entropy over the sequences of the global batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.data.tokenizer import IGNORE_INDEX, NucleotideTokenizer
from pipeline.errors import ConfigError
from pipeline.tasks.base import Record, Task, TaskConfig, register_task

# The 13 classes of the nRC benchmark, in the order the published files first list them.
NRC_CLASSES = ["5S_rRNA", "5_8S_rRNA", "tRNA", "ribozyme", "CD-box", "miRNA", "Intron_gpI", "Intron_gpII",
               "HACA-box", "riboswitch", "IRES", "leader", "scaRNA"]


@dataclass
class NRCConfig(TaskConfig):
    """task: {name: nrc}. classes: the label set, index = class id (a header naming another class is an error);
    hidden: the classifier's hidden width."""

    name: str = "nrc"
    classes: list[str] = field(default_factory=lambda: list(NRC_CLASSES))
    hidden: int = 256

    def __post_init__(self):
        super().__post_init__()
        if len(self.classes) < 2 or len(set(self.classes)) != len(self.classes):
            raise ConfigError(f"task.classes: needs at least two distinct class names, got {self.classes}")
        if self.hidden < 1:
            raise ConfigError(f"task.hidden: must be >= 1, got {self.hidden}")

    def head(self, d_model: int) -> dict:
        return {"name": "SequenceClassifier", "first": False,
                "kwargs": {"d_model": d_model, "n_classes": len(self.classes), "hidden": self.hidden}}

    def outputs(self) -> list[str]:
        return list(self.classes)


def read(path, tcfg: NRCConfig) -> list[Record]:
    """A FASTA of ``>ID CLASS`` records -> Records (label: the class name); ValueError naming file:line."""
    from data_prep.fasta import iter_fasta

    tok = NucleotideTokenizer("rna")
    out = []
    for r in iter_fasta(Path(path), tok.invalid_positions):
        where = f"{path}:{r.line}"
        words = r.description.split()
        if not words:
            raise ValueError(f"{where}: header >{r.id} names no class (nRC headers are '>ID CLASS')")
        label = words[-1]
        if label not in tcfg.classes:
            raise ValueError(f"{where}: class {label!r} of >{r.id} is not in the label set task.classes "
                             f"({', '.join(tcfg.classes)})")
        if not r.seq:
            raise ValueError(f"{where}: >{r.id} has no sequence")
        out.append(Record(r.id, r.seq.decode().upper(), label, where))
    if not out:
        raise ValueError(f"{path}: no FASTA record")
    return out


def meta(record: Record) -> dict:
    return {"id": record.id, "label": record.label}


def encode(meta: dict, start: int, n: int, tcfg: NRCConfig, where: str) -> dict:
    if meta.get("label") not in tcfg.classes:
        raise ValueError(f"{where}: class {meta.get('label')!r} is not in the label set task.classes")
    labels = np.full(n + 2, IGNORE_INDEX, dtype=np.int64)
    labels[0] = tcfg.classes.index(meta["label"])  # at <cls>: what the classifier reads
    return {"labels": labels, "units": 1}


def _rows(pred: torch.Tensor, batch):
    y = batch.labels[:, 0]
    return pred.float(), y


def loss(pred: torch.Tensor, batch, tcfg) -> tuple:
    """Summed cross-entropy over the sequences (the step divides by the global count of sequences)."""
    logits, y = _rows(pred, batch)
    ce = F.cross_entropy(logits, y, reduction="sum")
    correct = (logits.argmax(-1) == y).sum()
    return ce, {"accuracy": (correct, len(y))}


def validate(pred: torch.Tensor, batch, tcfg) -> dict:
    logits, y = _rows(pred, batch)
    return {"loss": (F.cross_entropy(logits, y, reduction="sum").detach(), len(y)),
            "accuracy": ((logits.argmax(-1) == y).sum(), len(y))}


def collect(pred: torch.Tensor, batch, tcfg) -> list:
    """Per sequence: (true class, predicted class, cross-entropy)."""
    logits, y = _rows(pred, batch)
    ce = F.cross_entropy(logits, y, reduction="none")
    return list(zip(y.tolist(), logits.argmax(-1).tolist(), ce.tolist()))


def classification_metrics(y_true, y_pred, classes: list[str]) -> dict:
    """Accuracy over all sequences and per class (the share of a class's sequences predicted as it: its recall);
    a class without sequences has no per-class accuracy (NaN, and said by its count 0)."""
    t, p = np.asarray(y_true), np.asarray(y_pred)
    if t.size == 0:
        raise ValueError("no sequence to score")
    per = {}
    for c, name in enumerate(classes):
        n = int((t == c).sum())
        per[name] = {"accuracy": float((p[t == c] == c).mean()) if n else float("nan"), "n": n}
    return {"accuracy": float((t == p).mean()), "per_class": per, "n": int(t.size)}


def metrics(entries: list, tcfg) -> tuple[dict, dict]:
    y, p, ce = (list(x) for x in zip(*entries))
    m = classification_metrics(y, p, tcfg.classes)
    return {"accuracy": m["accuracy"], "loss": float(np.mean(ce))}, {"per_class": m["per_class"], "n": m["n"]}


def chance(entries: list, tcfg) -> dict:
    """The commonest class's share (accuracy) and the classes' entropy in nats (loss) of the sequences scored."""
    counts = np.bincount([y for y, _, _ in entries], minlength=len(tcfg.classes)).astype(np.float64)
    freq = counts[counts > 0] / counts.sum()
    return {"accuracy": float(freq.max()), "loss": float(-(freq * np.log(freq)).sum())}


TASK = register_task(Task(
    name="nrc", config_cls=NRCConfig, read=read, formats="FASTA with the class as the header's last word "
    "(>ID CLASS)", meta=meta, encode=encode, loss=loss, validate=validate, collect=collect, metrics=metrics,
    columns=("accuracy", "loss"), crop_eval=True, chance=chance,
    figures=("pipeline.eval.task_plots:per_class",)))
