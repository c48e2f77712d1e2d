"""ProteinGym as the leaderboard aggregates it (pipeline/eval/proteingym.py leaderboard_aggregate): per-assay metrics
rounded to 3 decimals, averaged within each (UniProt_ID, coarse_selection_type), then within each type, then over
types; recomputed by hand and with pandas as performance_DMS_benchmarks.py does it, on a reference file with several
assays per UniProt ID and per type (one protein in two types, one NaN AUC); and through launchers/evaluate.py with
paper 002's Spearman per billion active parameters."""
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from launchers import evaluate
from pipeline.eval import proteingym as pg

sys.path.insert(0, str(Path(__file__).parent))
from protein_models import write_protlingo_export  # noqa: E402

WT = "MKTAYIAKQRQISFVKSHFSRQ"
#            DMS_id, UniProt_ID, type,  spearman, auc,      mcc
ASSAYS = [("A1", "P1_HUMAN", "Stability", 0.12345, 0.61234, 0.1),
          ("A2", "P1_HUMAN", "Stability", 0.56789, 0.7, 0.2),
          ("A3", "P2_ECOLI", "Stability", -0.2, 0.4, -0.05),
          ("A4", "P3_YEAST", "Activity", 0.3, math.nan, 0.3),  # one class of DMS_score_bin: no AUC
          ("A5", "P3_YEAST", "Activity", 0.1, 0.55, 0.0),
          ("A6", "P1_HUMAN", "Binding", 0.9, 0.9, 0.6),  # the same protein in another type
          ("A7", "P4_MOUSE", "Binding", 0.0004, 0.5, 0.0)]


def write_reference(path: Path, rows) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\r\n")
        w.writerow(["DMS_id", "DMS_filename", "UniProt_ID", "target_seq", "seq_len", "coarse_selection_type"])
        for dms_id, uniprot, kind, *_ in rows:
            w.writerow([dms_id, f"{dms_id}.csv", uniprot, WT, len(WT), kind])
    return path


def test_the_leaderboard_average_by_hand_and_by_pandas(tmp_path):
    ref_path = write_reference(tmp_path / "DMS_substitutions.csv", ASSAYS)
    per = {d: {"spearman": s, "auc": a, "mcc": m, "n": 10} for d, _, _, s, a, m in ASSAYS}
    got = pg.leaderboard_aggregate(per, pg.load_reference(ref_path), ref_path)
    # by hand: Stability = mean(P1 = mean(0.123, 0.568), P2 = -0.2); Activity = P3 = mean(0.3, 0.1);
    # Binding = mean(P1 = 0.9, P4 = 0.0 (0.0004 rounds to 0.000)); then the mean of the three types
    stability = ((0.123 + 0.568) / 2 + -0.2) / 2
    activity = (0.3 + 0.1) / 2
    binding = (0.9 + 0.0) / 2
    assert got["spearman"] == pytest.approx((stability + activity + binding) / 3, abs=1e-12)
    assert got["by_type"]["Stability"]["spearman"] == pytest.approx(stability, abs=1e-12)
    assert got["by_type"]["Binding"]["uniprot_ids"] == ["P1_HUMAN", "P4_MOUSE"]
    # the NaN AUC is left out: Activity's AUC is A5's alone
    assert got["by_type"]["Activity"]["auc"] == pytest.approx(0.55)
    assert (got["n_assays"], got["n_uniprot"], got["n_types"]) == (7, 4, 3)
    # performance_DMS_benchmarks.py's own pandas steps on the same table
    df = pd.DataFrame([{"DMS": d, "UniProt_ID": u, "Selection Type": t, "spearman": s, "auc": a, "mcc": m}
                       for d, u, t, s, a, m in ASSAYS]).set_index("DMS")
    for k in ("spearman", "auc", "mcc"):
        df[k] = df[k].astype(float).round(3)
    by_pair = df.groupby(["UniProt_ID", "Selection Type"]).mean(numeric_only=True)
    final = by_pair.groupby("Selection Type").mean(numeric_only=True).reset_index().mean(numeric_only=True)
    for k in ("spearman", "auc", "mcc"):
        assert got[k] == pytest.approx(final[k], abs=1e-12), k
    # not the plain mean over assays
    assert abs(got["spearman"] - np.mean([a[3] for a in ASSAYS])) > 0.01


def test_reference_without_the_columns_is_named(tmp_path):
    ref_path = tmp_path / "ref.csv"
    ref_path.write_text(f"DMS_id,DMS_filename,target_seq\nA1,A1.csv,{WT}\n")
    with pytest.raises(ValueError, match=r"ref.csv:2 \(A1\): no UniProt_ID"):
        pg.leaderboard_aggregate({"A1": {"spearman": 0.1, "auc": 0.5, "mcc": 0.0}}, pg.load_reference(ref_path),
                                 ref_path)


def test_evaluate_reports_the_leaderboard_and_the_efficiency(tmp_path):
    rng = np.random.default_rng(0)
    rows = [("A1", "P1_HUMAN", "Stability"), ("A2", "P1_HUMAN", "Stability"), ("A3", "P2_ECOLI", "Activity")]
    for k, (dms_id, *_rest) in enumerate(rows):
        with open(tmp_path / f"{dms_id}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["mutant", "DMS_score", "DMS_score_bin"])
            for pos in range(1 + k, 21, 2):
                mt = "A" if WT[pos - 1] != "A" else "G"
                score = float(rng.normal())
                w.writerow([f"{WT[pos - 1]}{pos}{mt}", score, int(score > 0)])
    ref = write_reference(tmp_path / "DMS_substitutions.csv", rows)
    export = write_protlingo_export(tmp_path / "pl")
    out = tmp_path / "out" / "pg.json"
    out.parent.mkdir()
    assert evaluate.main(["--checkpoint", str(export), "--task", "proteingym", "--data", str(tmp_path), "--reference",
                          str(ref), "--output", str(out), "--no-mlflow"]) == 0
    res = json.loads(out.read_text())
    per = res["per_assay"]
    r = lambda x: float(np.round(x, 3))  # noqa: E731
    want = ((r(per["A1"]["spearman"]) + r(per["A2"]["spearman"])) / 2 + r(per["A3"]["spearman"])) / 2
    assert res["leaderboard"]["spearman"] == pytest.approx(want, abs=1e-12)
    from pipeline.checkpoint import load_trained_model

    active = load_trained_model(export).cfg.model.num_active_params()
    assert res["efficiency"]["active_params"] == active < sum(
        p.numel() for p in load_trained_model(export).model.parameters())
    assert res["efficiency"]["spearman_per_billion_active"] == pytest.approx(want / (active / 1e9))
    assert res["table"][-1][0] == "leaderboard (2 UniProt, 2 types)"
