"""Per-nucleotide chemical reactivity, DMS and 2A3 (paper 000, Sec. 3.5 and A.7; Ribonanza, He et al. 2024): a
four-block convolutional head whose input concatenates the terminal representation and its difference from the
first-iteration representation (zero at K = 1); AUC and macro-F1 after global-median binarization and MAE on the
continuous values, per probe, each averaged over the two probes with equal weight.

Reader: the Ribonanza layout (the Kaggle "Stanford Ribonanza RNA Folding" ``train_data.csv``): one row per sequence
and probe, columns ``sequence_id, sequence, experiment_type`` (``DMS_MaP`` or ``2A3_MaP``), ``reads``,
``signal_to_noise``, ``SN_filter`` and ``reactivity_0001 .. reactivity_NNNN`` (position i of the sequence in column
i; empty or NaN where not measured; ``reactivity_error_*`` and other columns are ignored). Signal-to-noise filtering as
its authors document it: a profile is kept when ``SN_filter`` is 1, their flag for ``signal_to_noise > 1.00`` and
``reads > 100``; a file without the flag is filtered by those two thresholds (``task.min_signal_to_noise``,
``task.min_reads``; ``task.sn_filter: false`` keeps every profile). A sequence measured more than once by a probe keeps
the profile of highest signal-to-noise. The two probes of a sequence join into one record, NaN for a probe it lacks.
A row with a value past its sequence's end, or fewer reactivity columns than its sequence has residues, is one
error naming the file and line.

Targets: [n, 2] (DMS, 2A3), clipped to [0, 1] as the Ribonanza challenge scored them (``task.clip``), NaN where not
measured. Loss: the mean absolute error over the measured values (units: their count), so the step normalizes by
the global count of measured values.

Metric, per probe p over the measured positions of every sequence pooled: y binarized above its global median and
the prediction above its own global median; AUC of the continuous prediction against binarized y (ties ranked by
their average, as the Mann-Whitney statistic), macro-F1 the mean F1 of the two classes of the binarized prediction,
MAE the mean |prediction - y|. Each headline number is the unweighted mean of the two probes' (A.7: "each mean
weights DMS and 2A3 equally"), whatever their counts of measured values.
"""
from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.data.tokenizer import IGNORE_INDEX, NucleotideTokenizer
from pipeline.errors import ConfigError
from pipeline.tasks.base import Record, Task, TaskConfig, register_task

PROBES = ("DMS", "2A3")  # the targets' order
EXPERIMENTS = {"DMS_MaP": 0, "2A3_MaP": 1}  # Ribonanza's experiment_type -> probe index
_COLUMN = re.compile(r"^reactivity_(\d+)$")


@dataclass
class ReactivityConfig(TaskConfig):
    """task: {name: reactivity}. channels, kernel: the convolutional head's width and kernel (four blocks);
    sn_filter, min_signal_to_noise, min_reads: the profile filter (module docstring); clip: targets clipped to
    [0, 1]."""

    name: str = "reactivity"
    channels: int = 64
    kernel: int = 5
    sn_filter: bool = True
    min_signal_to_noise: float = 1.0
    min_reads: int = 100
    clip: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.channels < 1:
            raise ConfigError(f"task.channels: must be >= 1, got {self.channels}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"task.kernel: must be an odd number >= 1, got {self.kernel}")
        if self.min_reads < 0 or not self.min_signal_to_noise >= 0:
            raise ConfigError("task.min_signal_to_noise: the thresholds must be >= 0")

    def head(self, d_model: int) -> dict:
        return {"name": "ReactivityHead", "first": True,
                "kwargs": {"d_model": d_model, "channels": self.channels, "probes": len(PROBES), "blocks": 4,
                           "kernel": self.kernel}}

    def outputs(self) -> list[str]:
        return list(PROBES)


# ---- reader ----------------------------------------------------------------------------------------------------------
def _number(text: str | None, where: str, column: str) -> float:
    text = (text or "").strip()
    if text.lower() in ("", "nan", "na", "null", "none"):
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{where}: {column} {text!r} is not a number") from None


def read(path, tcfg: ReactivityConfig | None = None) -> list[Record]:
    """A Ribonanza CSV -> one Record per sequence (label: float64 [n, 2], NaN where not measured)."""
    tcfg = tcfg or ReactivityConfig()
    path = Path(path)
    tok = NucleotideTokenizer("rna")
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        cols = [c.strip() for c in reader.fieldnames or []]
        reader.fieldnames = cols
        missing = [c for c in ("sequence_id", "sequence", "experiment_type") if c not in cols]
        if missing:
            raise ValueError(f"{path}: the Ribonanza layout needs column {missing[0]!r} (header: {cols[:8]}...)")
        positions = sorted((int(m.group(1)), c) for c in cols if (m := _COLUMN.match(c)))
        if not positions or [p for p, _ in positions] != list(range(1, len(positions) + 1)):
            raise ValueError(f"{path}: reactivity columns must be reactivity_0001 .. reactivity_N, in full")
        flagged = "SN_filter" in cols
        if tcfg.sn_filter and not flagged and not {"signal_to_noise", "reads"} <= set(cols):
            raise ValueError(f"{path}: no SN_filter column and no signal_to_noise and reads to filter by "
                             "(set task.sn_filter: false to keep every profile)")
        best: dict[tuple[str, int], tuple[float, np.ndarray]] = {}
        seqs: dict[str, tuple[str, str]] = {}
        for row in reader:
            where = f"{path}:{reader.line_num}"
            sid, seq = (row["sequence_id"] or "").strip(), (row["sequence"] or "").strip().upper()
            if not sid or not seq:
                raise ValueError(f"{where}: empty sequence_id or sequence")
            kind = (row["experiment_type"] or "").strip()
            if kind not in EXPERIMENTS:
                raise ValueError(f"{where}: experiment_type {kind!r} is not one of {', '.join(EXPERIMENTS)}")
            bad = tok.invalid_positions(seq)
            if bad.size:
                raise ValueError(f"{where}: character {seq[bad[0]]!r} at position {bad[0] + 1} of {sid} is not a "
                                 "nucleotide")
            values = np.array([_number(row[c], where, c) for _, c in positions])
            if len(seq) > len(values):
                raise ValueError(f"{where}: {sid} has {len(seq)} residues but the file has only {len(values)} "
                                 "reactivity columns (a reactivity row of the wrong length)")
            past = np.flatnonzero(~np.isnan(values[len(seq):]))
            if past.size:
                raise ValueError(f"{where}: {sid} has a reactivity at position {len(seq) + past[0] + 1}, past the end "
                                 f"of its {len(seq)} residues (a reactivity row of the wrong length)")
            if sid in seqs and seqs[sid][0] != seq:
                raise ValueError(f"{where}: sequence_id {sid} has another sequence at {seqs[sid][1]}")
            seqs.setdefault(sid, (seq, where))
            sn = _number(row.get("signal_to_noise"), where, "signal_to_noise")
            if tcfg.sn_filter:
                if flagged:
                    keep = _number(row["SN_filter"], where, "SN_filter") == 1
                else:
                    keep = sn > tcfg.min_signal_to_noise and _number(row["reads"], where, "reads") > tcfg.min_reads
                if not keep:
                    continue
            key = (sid, EXPERIMENTS[kind])
            score = sn if not math.isnan(sn) else -math.inf
            if key not in best or score > best[key][0]:
                best[key] = (score, values[:len(seq)])
    out = []
    for sid, (seq, where) in seqs.items():
        profiles = np.full((len(seq), len(PROBES)), np.nan)
        for p in range(len(PROBES)):
            if (sid, p) in best:
                profiles[:, p] = best[(sid, p)][1]
        if np.isnan(profiles).all():
            continue  # every profile of this sequence was filtered out
        out.append(Record(sid, seq, profiles, where))
    if not out:
        raise ValueError(f"{path}: no profile passed the signal-to-noise filter")
    return out


def meta(record: Record) -> dict:
    return {"id": record.id, "reactivity": [[None if math.isnan(v) else float(v) for v in record.label[:, p]]
                                            for p in range(len(PROBES))]}


def encode(meta: dict, start: int, n: int, tcfg: ReactivityConfig, where: str) -> dict:
    values = np.array([[math.nan if v is None else v for v in probe] for probe in meta["reactivity"]],
                      dtype=np.float32).T  # [L, 2]
    kept = values[start:start + n]
    if tcfg.clip:
        kept = np.clip(kept, 0.0, 1.0)  # NaN stays NaN
    targets = np.full((n + 2, len(PROBES)), np.nan, dtype=np.float32)
    targets[1:n + 1] = kept
    return {"labels": np.full(n + 2, IGNORE_INDEX, dtype=np.int64), "targets": targets,
            "units": int(np.isfinite(kept).sum())}


# ---- loss and metric -------------------------------------------------------------------------------------------------
def _measured(pred: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y = batch.targets.to(pred.device)
    ok = torch.isfinite(y)
    return pred.float(), torch.where(ok, y, torch.zeros_like(y)), ok


def loss(pred: torch.Tensor, batch, tcfg) -> tuple:
    p, y, ok = _measured(pred, batch)
    err = (p - y).abs() * ok
    return err.sum(), {f"mae_{name}": (err[..., i].detach().sum(), ok[..., i].sum()) for i, name in enumerate(PROBES)}


def validate(pred: torch.Tensor, batch, tcfg) -> dict:
    p, y, ok = _measured(pred, batch)
    err = (p - y).abs() * ok
    return {"loss": (err.sum(), ok.sum()),
            **{f"mae_{name}": (err[..., i].sum(), ok[..., i].sum()) for i, name in enumerate(PROBES)}}


def collect(pred: torch.Tensor, batch, tcfg) -> list:
    """Per sequence: (targets [n, 2], predictions [n, 2]) at its residues, float64 on the host."""
    p = pred.double().cpu().numpy()
    y = batch.targets.double().cpu().numpy()
    n_res = (batch.attention_mask.sum(1) - 2).tolist()
    return [(y[b, 1:n + 1], p[b, 1:n + 1]) for b, n in enumerate(n_res)]


def auc(y_bin: np.ndarray, score: np.ndarray) -> float:
    """The probability that a positive scores above a negative, ties counted half: the Mann-Whitney U statistic
    from average ranks. NaN with one class."""
    from scipy.stats import rankdata

    y_bin = np.asarray(y_bin, dtype=bool)
    n_pos, n_neg = int(y_bin.sum()), int((~y_bin).sum())
    if not n_pos or not n_neg:
        return math.nan
    ranks = rankdata(np.asarray(score, dtype=np.float64))
    return float((ranks[y_bin].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def macro_f1(y_bin: np.ndarray, pred_bin: np.ndarray) -> float:
    """The mean over the two classes of each class's F1 (a class absent from both scores 0, scikit-learn's
    zero_division 0)."""
    y_bin, pred_bin = np.asarray(y_bin, dtype=bool), np.asarray(pred_bin, dtype=bool)
    out = []
    for cls in (True, False):
        tp = int(((pred_bin == cls) & (y_bin == cls)).sum())
        fp = int(((pred_bin == cls) & (y_bin != cls)).sum())
        fn = int(((pred_bin != cls) & (y_bin == cls)).sum())
        out.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return float(np.mean(out))


def probe_metrics(y: np.ndarray, pred: np.ndarray) -> dict:
    """AUC, macro-F1 and MAE of one probe's measured values pooled over a data set (module docstring)."""
    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    if y.size == 0:
        return {"auc": math.nan, "f1": math.nan, "mae": math.nan, "n": 0}
    y_bin = y > np.median(y)
    return {"auc": auc(y_bin, pred), "f1": macro_f1(y_bin, pred > np.median(pred)),
            "mae": float(np.abs(pred - y).mean()), "n": int(y.size)}


def probe_mean(per_probe: dict) -> dict:
    """Each metric as the unweighted mean over the probes that have values (A.7)."""
    out = {}
    for m in ("auc", "f1", "mae"):
        vals = [per_probe[p][m] for p in PROBES if per_probe[p]["n"] and not math.isnan(per_probe[p][m])]
        out[m] = float(np.mean(vals)) if vals else math.nan
    return out


def metrics(entries: list, tcfg) -> tuple[dict, dict]:
    per_probe = {}
    for i, name in enumerate(PROBES):
        y = np.concatenate([t[:, i] for t, _ in entries])
        p = np.concatenate([q[:, i] for _, q in entries])
        ok = np.isfinite(y)
        per_probe[name] = probe_metrics(y[ok], p[ok])
    return probe_mean(per_probe), {"per_probe": per_probe}


TASK = register_task(Task(
    name="reactivity", config_cls=ReactivityConfig, read=read, formats="the Ribonanza CSV layout (sequence_id, "
    "sequence, experiment_type, reads, signal_to_noise, SN_filter, reactivity_0001..)", meta=meta, encode=encode,
    loss=loss, validate=validate, collect=collect, metrics=metrics, columns=("auc", "f1", "mae"), crop_eval=False,
    figures=("pipeline.eval.task_plots:per_probe",)))
