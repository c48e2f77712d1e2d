"""Each adaptation metric equals an independent computation on the same predictions (scikit-learn on the pooled cells,
labels or values), and each breaks when its rule does: a padding cell counted, a threshold of >= instead of >, the
probes weighted unequally."""
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import (accuracy_score, f1_score, mean_absolute_error, precision_score, recall_score,
                             roc_auc_score)

from pipeline.data.batch import collate
from pipeline.tasks import nrc, reactivity, ssp
from pipeline.tasks.base import TaskTransform


class _Cfg:  # what TaskTransform reads of a run config
    def __init__(self, tcfg, context_length=64):
        self.task = tcfg
        self.data = type("D", (), {"context_length": context_length})()


def ssp_batch(structures: list[list[tuple[int, int]]], lengths: list[int]):
    """A collated batch of sequences with the given 0-based pairs, through the task's own transform."""
    tf = TaskTransform(ssp.TASK, _Cfg(ssp.SSPConfig()))
    samples = []
    for i, (pairs, n) in enumerate(zip(structures, lengths)):
        s = tf(np.full(n, 6, dtype=np.uint8), np.random.default_rng(i), {"id": str(i), "pairs": [list(p) for p in pairs]})
        samples.append({**s, "sample_id": str(i)})
    return collate(samples, pad_id=0)


def reference_cells(structures, lengths):
    """Independent of the task's code: each sequence's full n x n reference matrix, flattened and concatenated."""
    out = []
    for pairs, n in zip(structures, lengths):
        m = np.zeros((n, n), dtype=bool)
        for i, j in pairs:
            m[i, j] = m[j, i] = True
        out.append(m.ravel())
    return np.concatenate(out)


@pytest.fixture
def pairs_case():
    """Three sequences of different lengths (so the batch has padding cells) with random logits: some exactly 0
    (probability exactly 0.5), and large positive logits at every padding cell and at <cls>/<eos>."""
    structures = [[(0, 9), (1, 8), (2, 7)], [(0, 5), (2, 11), (3, 10), (4, 13)], [(1, 4)]]
    lengths = [10, 14, 6]
    batch = ssp_batch(structures, lengths)
    B, L = batch.input_ids.shape
    g = torch.Generator().manual_seed(0)
    z = torch.randn(B, L, L, generator=g) * 2
    z = (z + z.transpose(1, 2)) / 2
    z[z.abs() < 0.3] = 0.0  # probability exactly 0.5: not a predicted pair
    for b, n in enumerate(lengths):
        z[b, n + 1:, :] = z[b, :, n + 1:] = 9.0  # padding (and <eos> rows / columns): confidently "paired"
        z[b, 0, :] = z[b, :, 0] = 9.0  # <cls>
    return structures, lengths, batch, z


def test_ssp_pooled_metrics_equal_sklearn_on_the_valid_cells(pairs_case):
    structures, lengths, batch, z = pairs_case
    prob = torch.sigmoid(z.double())
    ref = reference_cells(structures, lengths)
    cells = np.concatenate([prob[b, 1:n + 1, 1:n + 1].numpy().ravel() for b, n in enumerate(lengths)])
    assert (cells == 0.5).sum() > 5  # the threshold's boundary is exercised
    want = {"f1": f1_score(ref, cells > 0.5), "precision": precision_score(ref, cells > 0.5),
            "recall": recall_score(ref, cells > 0.5)}
    # the definition on pooled cells, the validation's sums, and the sweep's per-sequence entries
    assert ssp.pooled_metrics(ref, cells) == pytest.approx(want, abs=1e-15)
    val = ssp.validate(z, batch, ssp.SSPConfig())
    assert val["f1"][0] / val["f1"][1] == pytest.approx(want["f1"], abs=1e-15)
    assert val["precision"][0] / val["precision"][1] == pytest.approx(want["precision"], abs=1e-15)
    assert val["recall"][0] / val["recall"][1] == pytest.approx(want["recall"], abs=1e-15)
    assert int(val["loss"][1]) == sum(n * n for n in lengths) == batch.num_supervised  # units: valid cells
    headline, details = ssp.metrics(ssp.collect(z, batch, ssp.SSPConfig()), None)
    assert headline == pytest.approx(want, abs=1e-15)
    per_seq = [f1_score(reference_cells([p], [n]), prob[b, 1:n + 1, 1:n + 1].numpy().ravel() > 0.5, zero_division=0)
               for b, (p, n) in enumerate(zip(structures, lengths))]
    assert details["per_sequence_f1"] == pytest.approx(per_seq, abs=1e-15)


def test_ssp_breakages_change_the_numbers(pairs_case, monkeypatch):
    """Counting a cell outside a sequence's L x L, or thresholding with >=, gives other numbers than the rule."""
    structures, lengths, batch, z = pairs_case
    right = ssp.validate(z, batch, ssp.SSPConfig())["f1"]
    every_cell = torch.ones_like(batch.attention_mask)[:, :, None] & torch.ones_like(batch.attention_mask)[:, None, :]
    real = ssp.cells
    monkeypatch.setattr(ssp, "cells", lambda logits, b: (*real(logits, b)[:2], every_cell.bool()))
    assert ssp.validate(z, batch, ssp.SSPConfig())["f1"] != right
    monkeypatch.setattr(ssp, "cells", real)
    monkeypatch.setattr(ssp, "predicted", lambda logits: torch.sigmoid(logits.double()) >= ssp.THRESHOLD)
    assert ssp.validate(z, batch, ssp.SSPConfig())["f1"] != right


def test_ssp_labels_encode_the_pairs_and_crop_them():
    """Framed position r + 1 holds residue r's partner's framed position (its own when unpaired); a crop keeps the
    pairs inside it only."""
    out = ssp.encode({"pairs": [[0, 5], [1, 3]]}, 0, 6, ssp.SSPConfig(), "x")
    assert out["labels"].tolist() == [-100, 6, 4, 3, 2, 5, 1, -100] and out["units"] == 36
    out = ssp.encode({"pairs": [[0, 5], [2, 4]]}, 1, 4, ssp.SSPConfig(), "x")  # residues 1..4: (0, 5) is cut
    assert out["labels"].tolist() == [-100, 1, 4, 3, 2, -100] and out["units"] == 16


def test_nrc_accuracy_and_per_class_equal_sklearn():
    rng = np.random.default_rng(1)
    classes = nrc.NRC_CLASSES
    y = rng.integers(0, len(classes), 300)
    y[y == 4] = 5  # one class without sequences: no per-class accuracy
    p = np.where(rng.random(300) < 0.6, y, rng.integers(0, len(classes), 300))
    m = nrc.classification_metrics(y, p, classes)
    assert m["accuracy"] == pytest.approx(accuracy_score(y, p), abs=1e-15)
    recall = recall_score(y, p, labels=range(len(classes)), average=None, zero_division=np.nan)
    got = [m["per_class"][c]["accuracy"] for c in classes]
    assert np.allclose(got, recall, equal_nan=True, atol=1e-15) and math.isnan(got[4])
    # through the head's logits of a batch, the loss's and validation's counts agree
    logits = torch.randn(7, len(classes), generator=torch.Generator().manual_seed(2))
    labels = torch.full((7, 5), -100)
    labels[:, 0] = torch.tensor([0, 3, 3, 12, 7, 0, 1])
    batch = type("B", (), {"labels": labels})()
    val = nrc.validate(logits, batch, nrc.NRCConfig())
    assert val["accuracy"][0].item() / val["accuracy"][1] == accuracy_score(labels[:, 0], logits.argmax(-1))


def test_reactivity_metrics_equal_sklearn_and_weight_the_probes_equally():
    rng = np.random.default_rng(3)
    per_probe, want = {}, {}
    for name, n in zip(reactivity.PROBES, (400, 90)):  # unequal counts: pooling would weight DMS 4x
        y = rng.random(n)
        y[:20] = np.round(y[:20], 1)  # ties in the targets and at the median
        pred = np.clip(y + rng.normal(0, 0.3 if name == "DMS" else 0.1, n), 0, 1)
        pred[:10] = 0.5  # tied scores
        yb = y > np.median(y)
        per_probe[name] = reactivity.probe_metrics(y, pred)
        want[name] = {"auc": roc_auc_score(yb, pred), "f1": f1_score(yb, pred > np.median(pred), average="macro"),
                      "mae": mean_absolute_error(y, pred)}
        for m in ("auc", "f1", "mae"):
            assert per_probe[name][m] == pytest.approx(want[name][m], abs=1e-12), (name, m)
    mean = reactivity.probe_mean(per_probe)
    for m in ("auc", "f1", "mae"):
        assert mean[m] == pytest.approx((want["DMS"][m] + want["2A3"][m]) / 2, abs=1e-12)
    # a count-weighted mean (the two probes pooled) is another number
    pooled = (want["DMS"]["mae"] * 400 + want["2A3"]["mae"] * 90) / 490
    assert abs(mean["mae"] - pooled) > 1e-3


def test_reactivity_breakages_change_the_numbers(monkeypatch):
    """Entries through the task's metrics: weighting the probes by their measured values' counts changes the
    headline numbers (binarizing at >= the median instead: the ties at the median above make sklearn disagree)."""
    rng = np.random.default_rng(4)
    entries = []
    for n in (30, 50, 20):
        y = rng.random((n, 2))
        y[: n // 2, 0] = np.nan  # DMS measured on fewer positions
        entries.append((y, np.clip(np.nan_to_num(y, nan=0.5) + rng.normal(0, 0.2, (n, 2)), 0, 1)))
    right, _ = reactivity.metrics(entries, None)
    monkeypatch.setattr(reactivity, "probe_mean", lambda per: {
        m: sum(per[p][m] * per[p]["n"] for p in reactivity.PROBES) / sum(per[p]["n"] for p in reactivity.PROBES)
        for m in ("auc", "f1", "mae")})
    assert reactivity.metrics(entries, None)[0]["mae"] != right["mae"]


def test_reactivity_targets_are_clipped_framed_and_counted():
    meta = {"reactivity": [[0.5, None, 1.7, -0.2], [0.1, 0.2, None, None]]}
    out = reactivity.encode(meta, 0, 4, reactivity.ReactivityConfig(), "x")
    t = out["targets"]
    assert t.shape == (6, 2) and np.isnan(t[0]).all() and np.isnan(t[-1]).all()
    assert np.allclose(t[1:5, 0], [0.5, np.nan, 1.0, 0.0], equal_nan=True)
    assert out["units"] == 5 and (out["labels"] == -100).all()
