"""RNAGym fitness evaluation (A.6): parsing/validation on the real Tome 2014 GFP-aptamer assay, Eq. A.10 scoring,
Eq. A.11 metrics, Eq. A.12 aggregation, and the long-sequence windowing of wild-type log-probabilities."""
import csv
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy.special import log_softmax
from sklearn.metrics import matthews_corrcoef

from pipeline.data.tokenizer import CLS_ID, EOS_ID, NUM_SPECIAL, VOCAB
from pipeline.eval.rnagym import (RNA_TYPES, aggregate, assay_metrics, canonical_rna_type, describe_types,
                                  evaluate_assays, load_assay, load_assays, load_reference_sheet, score_assays,
                                  score_variants, wildtype_logprobs, window_starts)

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data"
RNAGYM = SHARED / "eval" / "rnagym"
TOME = RNAGYM / "Tome_2014_GFP_aptamer.csv"
SHEET = RNAGYM / "reference_sheet.csv"
needs_data = pytest.mark.skipif(not SHARED.exists(), reason="needs ../shared/data")
V = len(VOCAB)


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _write(path, rows, fields=("mutant", "DMS_score", "sequence")):
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def _mutate(wt, mutant):
    """The variant sequence of ``mutant`` (1-based, comma-joined) on ``wt``, checking each 'from' base."""
    s = list(wt)
    for m in mutant.split(","):
        assert s[int(m[1:-1]) - 1] == m[0], (wt, m)
        s[int(m[1:-1]) - 1] = m[-1]
    return "".join(s)


@pytest.fixture(scope="module")
def sheet():
    return load_reference_sheet(SHEET)


@pytest.fixture(scope="module")
def tome(sheet):
    return load_assay(TOME, sheet)


# ------------------------------------------------------------------------------------------------ parsing

@needs_data
def test_reference_sheet(sheet):
    assert len(sheet) == 31
    e = sheet["Tome_2014_GFP_aptamer"]
    assert e["rna_type"] == "Aptamer" and len(e["wt"]) == 82 and set(e["wt"]) <= set("ACGU")
    # The shared (older) sheet has four of the paper's five types: no mRNA-coding assay, and its two splicing
    # assays are written as bare "mRNA".
    assert Counter(v["rna_type"] for v in sheet.values()) == {"Ribozyme": 19, "Aptamer": 7, "tRNA": 3,
                                                             "mRNA-splicing": 2}
    assert Counter(v["rna_type_sheet"] for v in sheet.values())["mRNA"] == 2
    for dms_id in ("Julien_2016_mRNA", "Ke_2017_mRNA"):
        assert sheet[dms_id]["rna_type"] == "mRNA-splicing" and sheet[dms_id]["rna_type_sheet"] == "mRNA"


def test_rna_type_mapping():
    assert RNA_TYPES == ("mRNA-coding", "Ribozyme", "tRNA", "mRNA-splicing", "Aptamer")
    for t in RNA_TYPES:
        assert canonical_rna_type(t) == t and canonical_rna_type(t.upper()) == t
    assert canonical_rna_type("mRNA") == "mRNA-splicing"  # the older sheet's name for the splicing assays
    assert canonical_rna_type(" mrna_coding ") == canonical_rna_type("mRNA coding") == "mRNA-coding"
    assert canonical_rna_type("ribozyme") == "Ribozyme" and canonical_rna_type("TRNA") == "tRNA"
    for bad in ("lncRNA", "riboswitch", "mRNA-UTR", "rRNA", ""):
        with pytest.raises(ValueError, match="not one of the paper's five types"):
            canonical_rna_type(bad)


def test_reference_sheet_unknown_type_names_file_line_and_value(tmp_path):
    path = _write(tmp_path / "sheet.csv", [
        {"DMS_ID": "a1", "RNA_TYPE": "Aptamer", "RAW_CONSTRUCT_SEQ": "ACGT"},
        {"DMS_ID": "x1", "RNA_TYPE": "Riboswitch", "RAW_CONSTRUCT_SEQ": "ACGU"}],
        fields=("DMS_ID", "RNA_TYPE", "RAW_CONSTRUCT_SEQ"))
    with pytest.raises(ValueError, match=r"sheet\.csv: DMS_ID 'x1' \(line 3\): RNA_TYPE 'Riboswitch' is not one"):
        load_reference_sheet(path)
    rows = _rows(path)
    rows[1]["RNA_TYPE"] = "mRNA"
    ok = load_reference_sheet(_write(tmp_path / "ok.csv", rows, fields=("DMS_ID", "RNA_TYPE", "RAW_CONSTRUCT_SEQ")))
    assert {k: v["rna_type"] for k, v in ok.items()} == {"a1": "Aptamer", "x1": "mRNA-splicing"}
    assert ok["a1"]["wt"] == "ACGU"  # the sheet's T is read as U too


@needs_data
def test_parse_tome(tome, sheet):
    assert tome.n_variants == 417 and tome.dropped == 0
    assert np.bincount(tome.n_mutations).tolist() == [0, 236, 181]  # no WT row, 236 singles, 181 doubles
    # The sheet's RAW_CONSTRUCT_SEQ is the assay's frame (same length, every 'from' base matches), so it is used.
    assert tome.wt_source == "reference" and tome.wt == sheet["Tome_2014_GFP_aptamer"]["wt"] and tome.notes == ()
    assert tome.mutants[0] == "U3C" and tome.dms_score[0] == pytest.approx(-0.050738428)
    raw = _rows(TOME)
    i = next(k for k, r in enumerate(raw) if "," in r["mutant"])  # a CSV-quoted double mutant
    assert tome.mutants[i] == raw[i]["mutant"] and tome.n_mutations[i] == 2
    assert tome.sub_pos.min() == 2 and tome.sub_pos.max() == 81  # 1-based 3..82 on the 82-nt wild type


@needs_data
def test_wt_reconstruction_consistency(tome, tmp_path):
    rec = load_assay(TOME)  # no sheet, no WT row -> reconstructed from the variants
    assert rec.wt_source == "reconstructed" and rec.wt == tome.wt
    for r in _rows(TOME):  # every variant with its mutations reverted is that same wild type
        s = list(r["sequence"])
        for m in r["mutant"].split(","):
            assert s[int(m[1:-1]) - 1] == m[-1]
            s[int(m[1:-1]) - 1] = m[0]
        assert "".join(s) == rec.wt
    # A WT row (empty mutant) gives the wild type when there is no reference, and is not a scored variant.
    rows = [{"mutant": "", "DMS_score": "0.5", "sequence": tome.wt.replace("U", "T")}] + _rows(TOME)
    a = load_assay(_write(tmp_path / "Tome_2014_GFP_aptamer.csv", rows))
    assert a.wt_source == "wt_row" and a.wt == tome.wt and a.n_variants == 417 and a.wt_rows == 1
    assert a.n_mutations.min() >= 1 and any("wild-type row" in n for n in a.notes)


@needs_data
def test_inconsistent_reference_falls_back(tome):
    longer = {"Tome_2014_GFP_aptamer": {"rna_type": "Aptamer", "wt": "GGAAC" + tome.wt + "UU"}}
    a = load_assay(TOME, longer)
    assert a.wt_source == "reconstructed" and a.wt == tome.wt
    assert len(a.notes) == 1 and "offset 5" in a.notes[0] and "reconstructed" in a.notes[0]


@needs_data
def test_mutation_validation_errors(tmp_path):
    rows = _rows(TOME)
    assert rows[0]["mutant"] == "U3C"
    bad_to = [dict(r) for r in rows]
    bad_to[0]["mutant"] = "U3G"  # the sequence carries C at 3
    with pytest.raises(ValueError, match=r"bad_to\.csv: row 1 \(line 2\): mutation U3G: variant sequence has C"):
        load_assay(_write(tmp_path / "bad_to.csv", bad_to))
    bad_from = [dict(r) for r in rows]
    bad_from[5]["mutant"] = "A" + bad_from[5]["mutant"][1:]
    wt_base = rows[5]["mutant"][0]
    with pytest.raises(ValueError, match=rf"bad_from\.csv: row 6 \(line 7\): mutation A.*wild-type base .* is "
                                         rf"{wt_base}"):
        load_assay(_write(tmp_path / "bad_from.csv", bad_from))
    with pytest.raises(ValueError, match=r"nocol\.csv.*'DMS_score'"):
        load_assay(_write(tmp_path / "nocol.csv", rows, fields=("mutant", "sequence")))


@needs_data
def test_missing_scores_are_dropped_and_counted(tmp_path):
    rows = [dict(r) for r in _rows(TOME)]
    rows[3]["DMS_score"], rows[10]["DMS_score"] = "", "NaN"
    a = load_assay(_write(tmp_path / "gaps.csv", rows))
    assert a.n_variants == 415 and a.dropped == 2 and "dropped 2" in a.notes[0]
    assert np.isfinite(a.dms_score).all()


# ------------------------------------------------------------------------------------------------ scoring

@needs_data
def test_score_variants_by_hand(tome):
    lp = log_softmax(np.random.default_rng(1).normal(size=(82, V)), axis=1)  # [L, V]
    f = score_variants(tome, lp)
    idx = {t: i for i, t in enumerate(VOCAB)}
    for i in [0, 1, 100, next(k for k, m in enumerate(tome.mutants) if "," in m), 416]:
        want = sum(lp[int(m[1:-1]) - 1, idx[m[-1]]] - lp[int(m[1:-1]) - 1, idx[m[0]]]
                   for m in tome.mutants[i].split(","))
        assert f[i] == pytest.approx(want, abs=1e-12)


def _oracle_forward(wt: str, target: dict):
    """A fake model whose wild-type log-probs make F(single (p, to)) equal target[(p, to)] (< -1.2).

    Every row is a genuine distribution: log p(wt base) = log 1/2 at every position, log p(to) = log 1/2 + target,
    the remaining mass is spread over the other tokens. Because log p(wt) is the same float everywhere, tied
    targets give bit-identical F (a log_softmax construction would break ties of y by rounding noise).
    """
    ids = {t: i for i, t in enumerate(VOCAB)}
    c = math.log(0.5)

    def forward(framed):
        assert framed[0] == CLS_ID and framed[-1] == EOS_ID and len(framed) == len(wt) + 2
        out = np.full((len(framed), V), -math.log(V))  # [n, V]; the <cls>/<eos> rows are uniform
        for p, b in enumerate(wt):
            row = {ids[b]: c, **{ids[to]: c + t for (q, to), t in target.items() if q == p}}
            others = [j for j in range(V) if j not in row]
            out[p + 1, others] = math.log((1.0 - sum(math.exp(v) for v in row.values())) / len(others))
            out[p + 1, list(row)] = list(row.values())
        assert np.allclose(np.exp(out).sum(axis=1), 1.0)
        return out
    return forward


@needs_data
def test_oracle_forward_gives_perfect_metrics(tome, sheet, tmp_path):
    rows = [r for r in _rows(TOME) if "," not in r["mutant"]]  # singles: one (position, base) per variant
    path = _write(tmp_path / "Tome_2014_GFP_aptamer.csv", rows)
    y = {(int(r["mutant"][1:-1]) - 1, r["mutant"][-1]): float(r["DMS_score"]) for r in rows}
    assert len(y) == len(rows) == 236
    shift = -1.2 - 0.1 * max(abs(v) for v in y.values())
    for sign in (1.0, -1.0):  # the metrics are orientation invariant, so an anti-oracle is perfect too
        # Affine in y, so the median of F is the image of the median of y and the MCC binarisations agree.
        target = {k: sign * 0.1 * v + shift for k, v in y.items()}
        res = evaluate_assays([path], sheet, _oracle_forward(tome.wt, target), context_length=1024)
        m = res["per_assay"]["Tome_2014_GFP_aptamer"]
        assert m["spearman"] == pytest.approx(1.0, abs=1e-12) and m["auc"] == 1.0
        assert m["mcc"] == pytest.approx(1.0, abs=1e-12)
        assert res["aggregate"]["spearman"] == pytest.approx(1.0, abs=1e-12) and res["n_variants"] == 236
        assert np.allclose(res["scores"]["Tome_2014_GFP_aptamer"], list(target.values()), atol=1e-12)
        assert m["score_mean"] == pytest.approx(np.mean(list(target.values())), abs=1e-12)  # keeps the sign


# ------------------------------------------------------------------------------------------------ metrics

def test_metrics_orientation_invariance():
    rng = np.random.default_rng(2)
    y = rng.normal(size=200)
    f = 0.5 * y + rng.normal(size=200)  # even N, continuous: no score sits exactly on a median
    a, b = assay_metrics(f, y), assay_metrics(-f, y)
    for k in ("spearman", "auc", "mcc"):
        assert a[k] == pytest.approx(b[k], abs=1e-12)
    assert 0.0 < a["spearman"] < 1.0 and 0.5 < a["auc"] < 1.0 and 0.0 < a["mcc"] < 1.0


def test_metrics_degenerate_cases():
    y = np.arange(10.0)
    # Constant F: no ranking (Spearman NaN), AUC a genuine 0.5, binarised F one class -> MCC 0 (sklearn's value).
    const = assay_metrics(np.zeros(10), y)
    assert math.isnan(const["spearman"]) and const["auc"] == 0.5 and const["mcc"] == 0.0
    assert matthews_corrcoef(y > np.median(y), np.zeros(10) > 0) == 0.0
    # Constant y: binarised y one class -> AUC undefined (NaN), MCC 0.
    flat_y = assay_metrics(np.arange(10.0), np.ones(10))
    assert math.isnan(flat_y["spearman"]) and math.isnan(flat_y["auc"]) and flat_y["mcc"] == 0.0
    single = assay_metrics([1.0], [2.0])
    assert math.isnan(single["spearman"]) and math.isnan(single["auc"]) and single["mcc"] == 0.0
    with pytest.raises(ValueError, match="at least one"):
        assay_metrics([], [])


def test_mcc_is_zero_when_a_binarisation_has_one_class():
    # y: more than half of the values tie at the maximum, so nothing lies strictly above the median.
    y = np.array([0.1, 0.7, 0.9, 0.9, 0.9, 0.9])
    f = np.array([-3.0, -1.0, -2.0, -0.5, -0.2, -4.0])  # varied and correlated with y: not the reason for 0
    assert not (y > np.median(y)).any()
    m = assay_metrics(f, y)
    assert m["mcc"] == 0.0 == matthews_corrcoef(y > np.median(y), f > np.median(f))
    assert math.isnan(m["auc"]) and 0.0 < m["spearman"] <= 1.0
    # F with one class while y has two: MCC 0 again; AUC is defined and equals 0.5 for tied scores.
    f_tied = np.array([-1.0, -1.0, -1.0, -1.0, -1.0, -2.0])  # median -1: nothing above it
    y2 = np.arange(6.0)
    m2 = assay_metrics(f_tied, y2)
    assert m2["mcc"] == 0.0 == matthews_corrcoef(y2 > np.median(y2), f_tied > np.median(f_tied))
    assert m2["auc"] == pytest.approx(max(2 / 3, 1 / 3))  # one negative (score -2) below three tied positives


def test_one_class_assay_is_kept_in_the_aggregate(tmp_path):
    """An assay whose binarised fitness has one class counts in the MCC means with 0 and is counted as NaN AUC."""
    wt = "GGAUCCGAUU"
    sheet = {"flat": {"rna_type": "Aptamer", "wt": wt}, "good": {"rna_type": "Aptamer", "wt": wt},
             "rib": {"rna_type": "Ribozyme", "wt": wt}}

    def assay(name, scores):
        muts = ["G1A", "U4C", "C5G", "G7U", "U10C", "G2C"]
        rows = [{"mutant": m, "DMS_score": str(y), "sequence": _mutate(wt, m)} for m, y in zip(muts, scores)]
        return _write(tmp_path / f"{name}.csv", rows)

    paths = [assay("flat", [1.0, 1.0, 1.0, 1.0, 0.5, 0.2]), assay("good", [0.1, 0.4, 0.3, 0.9, 0.6, 0.2]),
             assay("rib", [0.3, 0.1, 0.4, 0.8, 0.2, 0.5])]
    table = log_softmax(np.random.default_rng(5).normal(size=(V, V)), axis=1)
    res = evaluate_assays(paths, sheet, lambda framed: table[framed], context_length=64)
    flat = res["per_assay"]["flat"]
    assert flat["mcc"] == 0.0 and math.isnan(flat["auc"]) and flat["one_class"] == ["fitness"]
    assert res["per_assay"]["good"]["one_class"] == [] and res["per_assay"]["good"]["mcc"] > 0
    apt = res["per_type"]["Aptamer"]
    assert apt["n_assays"] == 2 and apt["n_nan"] == {"spearman": 0, "auc": 1, "mcc": 0}
    assert apt["mcc"] == pytest.approx((0.0 + res["per_assay"]["good"]["mcc"]) / 2)  # the 0 is averaged in
    assert apt["auc"] == res["per_assay"]["good"]["auc"]  # the NaN AUC is left out, not averaged as 0
    agg = res["aggregate"]
    assert agg["n_assays"] == 3 and agg["types"] == {"Ribozyme": 1, "Aptamer": 2}
    assert agg["mcc"] == pytest.approx((apt["mcc"] + res["per_assay"]["rib"]["mcc"]) / 2)


def test_mrna_coding_wild_type_in_t_is_read_as_u(tmp_path):
    """RNAGym writes mRNA-coding assays in T; they are scored exactly like the same assay written in U."""
    wt_t = "ATGGCTTTCGAT"  # a coding start, DNA spelling
    muts = (("T2C", "0.1"), ("G4A", "0.5"), ("T7G", "0.2"), ("T7G,C9T", "0.9"))
    rows = [{"mutant": m, "DMS_score": y, "sequence": _mutate(wt_t, m)} for m, y in muts]
    as_t = load_assay(_write(tmp_path / "coding_t.csv", rows))
    rows_u = [{k: v.replace("T", "U") for k, v in r.items()} for r in rows]
    as_u = load_assay(_write(tmp_path / "coding_u.csv", rows_u))
    assert as_t.wt == as_u.wt == wt_t.replace("T", "U") and as_t.mutants == as_u.mutants
    ids = as_t.wt_ids()
    assert np.array_equal(ids, as_u.wt_ids()) and VOCAB.index("U") in ids and VOCAB.index("T") not in ids
    lp = log_softmax(np.random.default_rng(6).normal(size=(len(wt_t), V)), axis=1)
    assert np.array_equal(score_variants(as_t, lp), score_variants(as_u, lp))
    u, c = VOCAB.index("U"), VOCAB.index("C")  # T2C reads log p(C) - log p(U), not log p(T)
    assert score_variants(as_t, lp)[0] == lp[1, c] - lp[1, u]


def test_aggregate_by_hand():
    sheet = {"a1": {"rna_type": "Aptamer"}, "a2": {"rna_type": "Aptamer"}, "r1": {"rna_type": "Ribozyme"},
             "r2": {"rna_type": "Ribozyme"}, "r3": {"rna_type": "Ribozyme"}}
    per = {"a1": {"spearman": 0.2, "auc": 0.6, "mcc": 0.1}, "a2": {"spearman": 0.4, "auc": 0.8, "mcc": math.nan},
           "r1": {"spearman": 0.1, "auc": 0.5, "mcc": 0.3}, "r2": {"spearman": 0.2, "auc": 0.7, "mcc": 0.3},
           "r3": {"spearman": 0.9, "auc": 0.9, "mcc": 0.6}}
    out = aggregate(per, sheet)
    apt, rib = out["per_type"]["Aptamer"], out["per_type"]["Ribozyme"]
    assert apt["spearman"] == pytest.approx(0.3) and apt["auc"] == pytest.approx(0.7)
    assert apt["mcc"] == pytest.approx(0.1) and apt["n_nan"]["mcc"] == 1 and apt["n_assays"] == 2
    assert rib["spearman"] == pytest.approx(0.4) and rib["auc"] == pytest.approx(0.7)
    assert rib["mcc"] == pytest.approx(0.4) and rib["n_nan"]["mcc"] == 0 and rib["n_assays"] == 3
    # Equal weight per type, not per assay: pooling the five assays would give spearman 1.8 / 5 = 0.36.
    assert out["overall"]["spearman"] == pytest.approx((0.3 + 0.4) / 2) and out["overall"]["auc"] == pytest.approx(0.7)
    assert out["overall"]["mcc"] == pytest.approx((0.1 + 0.4) / 2)  # NaN skipped; pooled would be 1.3 / 4
    assert out["overall"]["n_types"] == 2 and out["overall"]["n_assays"] == 5
    # Types in the paper's order (Ribozyme before Aptamer), with their assay counts and the absent ones.
    assert list(out["per_type"]) == ["Ribozyme", "Aptamer"]
    assert out["overall"]["types"] == {"Ribozyme": 3, "Aptamer": 2}
    assert out["overall"]["types_missing"] == ["mRNA-coding", "tRNA", "mRNA-splicing"]
    line = describe_types(out["overall"])
    assert line.startswith("RNA types (assays): Ribozyme 3, Aptamer 2; missing mRNA-coding, tRNA, mRNA-splicing")
    assert "not the paper's five-type mean" in line
    with pytest.raises(ValueError, match="'zz'"):
        aggregate({**per, "zz": per["a1"]}, sheet)
    with pytest.raises(ValueError, match=r"assay 'a1': RNA_TYPE 'snoRNA' is not one"):
        aggregate(per, {**sheet, "a1": {"rna_type": "snoRNA"}})


def test_aggregate_weights_the_five_types_equally():
    types = {"c": "mRNA-coding", "r": "Ribozyme", "t": "tRNA", "s": "mRNA", "a": "Aptamer", "a2": "aptamer"}
    sheet = {k: {"rna_type": v} for k, v in types.items()}
    vals = {"c": 0.1, "r": 0.2, "t": 0.3, "s": 0.4, "a": 0.5, "a2": 0.9}
    per = {k: {"spearman": v, "auc": 0.5 + v / 2, "mcc": v / 2} for k, v in vals.items()}
    out = aggregate(per, sheet)["overall"]
    assert out["types"] == {"mRNA-coding": 1, "Ribozyme": 1, "tRNA": 1, "mRNA-splicing": 1, "Aptamer": 2}
    assert out["types_missing"] == [] and out["n_types"] == 5
    assert out["spearman"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4 + (0.5 + 0.9) / 2) / 5)
    assert describe_types(out) == ("RNA types (assays): mRNA-coding 1, Ribozyme 1, tRNA 1, mRNA-splicing 1, "
                                   "Aptamer 2")


# ------------------------------------------------------------------------------------------------ windowing

def _expected_window(p, starts, body):
    """Independent statement of the rule: the window farthest from p's nearer edge, earliest on ties."""
    best = None
    for k, s in enumerate(starts):
        if s <= p < s + body:
            c = min(p - s, s + body - 1 - p)
            if best is None or c > best[0]:
                best = (c, k)
    return best[1]


@pytest.mark.parametrize("length,context", [(50, 12), (50, 11), (23, 12), (10, 12), (11, 12), (40, 3), (300, 130)])
def test_windowing_reads_each_position_from_its_most_central_window(length, context):
    rng = np.random.default_rng(length * 1000 + context)
    wt = rng.integers(NUM_SPECIAL, NUM_SPECIAL + 4, size=length).astype(np.uint8)
    calls = []

    def forward(framed):
        # Fake: row i says (which call, index within the window body); a real model would give log-probs.
        assert framed.dtype == np.int64 and len(framed) <= context
        assert framed[0] == CLS_ID and framed[-1] == EOS_ID
        calls.append(framed[1:-1].copy())
        out = np.zeros((len(framed), V))
        out[:, 0] = len(calls) - 1
        out[:, 1] = np.arange(len(framed)) - 1
        return out

    out = wildtype_logprobs(wt, forward, context)
    body = context - 2
    assert out.shape == (length, V)
    if length <= body:
        assert len(calls) == 1 and np.array_equal(out[:, 1], np.arange(length))
        return
    starts = window_starts(length, body)
    assert len(calls) == len(starts) and starts[0] == 0 and starts[-1] == length - body
    assert np.all(np.diff(starts) <= max(1, body // 2))  # stride about half the body
    for k, s in enumerate(starts):  # each call saw exactly its window of the wild type
        assert np.array_equal(calls[k], wt[s:s + body])
    for p in range(length):
        k, j = int(out[p, 0]), int(out[p, 1])
        assert starts[k] + j == p  # the row came from position p in that window
        assert k == _expected_window(p, starts, body)


def test_windowing_equals_single_call_for_window_independent_model():
    rng = np.random.default_rng(3)
    table = log_softmax(rng.normal(size=(V, V)), axis=1)  # log p(. | token at this position): no context
    forward = lambda framed: table[framed]  # noqa: E731  [n] -> [n, V]
    for length in (1, 7, 64, 257):
        wt = rng.integers(NUM_SPECIAL, NUM_SPECIAL + 6, size=length).astype(np.uint8)
        single = wildtype_logprobs(wt, forward, length + 2)
        assert np.array_equal(single, table[wt])
        for context in (3, 4, 9, 32, 33):
            assert np.array_equal(wildtype_logprobs(wt, forward, context), single)


def test_windowing_rejects_bad_inputs():
    fwd = lambda framed: np.zeros((len(framed), V))  # noqa: E731
    with pytest.raises(ValueError, match="special"):
        wildtype_logprobs(np.array([CLS_ID, 6, 7], dtype=np.uint8), fwd, 16)
    with pytest.raises(ValueError, match="no room"):
        wildtype_logprobs(np.array([6, 7], dtype=np.uint8), fwd, 2)
    with pytest.raises(ValueError, match="forward returned shape"):
        wildtype_logprobs(np.array([6, 7], dtype=np.uint8), lambda f: np.zeros((len(f) - 1, V)), 16)


@needs_data
def test_evaluate_tome_windowed_matches_single_call(sheet):
    table = log_softmax(np.random.default_rng(4).normal(size=(V, V)), axis=1)
    forward = lambda framed: table[framed]  # noqa: E731
    whole = evaluate_assays([TOME], sheet, forward, context_length=512)
    windowed = evaluate_assays([TOME], sheet, forward, context_length=30)  # 82 nt -> 6 windows of 28
    assert whole["per_assay"] == windowed["per_assay"]
    m = whole["per_assay"]["Tome_2014_GFP_aptamer"]
    assert m["rna_type"] == "Aptamer" and m["n_variants"] == 417 and m["wt_source"] == "reference"
    assert set(whole["per_type"]) == {"Aptamer"} and whole["aggregate"]["n_assays"] == 1
    assert whole["notes"] == {"Tome_2014_GFP_aptamer": []}
    with pytest.raises(ValueError, match="not in the reference sheet"):
        evaluate_assays([TOME], {}, forward, 512)


def test_a_wild_type_row_is_dropped_and_counted_as_rnagym_scores(tmp_path):
    """RNAGym's scorer (fitness/performance_fitness.py) drops the rows without a mutant before its metrics; so do
    these: the metrics equal scipy's Spearman, scikit-learn's AUC and MCC on the variant rows alone, the row is
    counted, and keeping it as a variant scored 0 would give other numbers."""
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(7)
    wt = "GGAUCCGUAAGCUACGGAUCC"
    rows = [{"mutant": "", "DMS_score": "0.9", "sequence": wt}]  # the wild type, measured
    for i in range(40):
        pos = int(rng.integers(len(wt)))
        to = "ACGU".replace(wt[pos], "")[int(rng.integers(3))]
        seq = wt[:pos] + to + wt[pos + 1:]
        rows.append({"mutant": f"{wt[pos]}{pos + 1}{to}", "DMS_score": f"{rng.normal():.4f}", "sequence": seq})
    path = _write(tmp_path / "Toy_2024_assay.csv", rows)
    sheet = {"Toy_2024_assay": {"rna_type": "Aptamer", "wt": None}}
    lp = log_softmax(rng.normal(size=(len(wt) + 2, V)), -1)
    res = score_assays(load_assays([path], sheet), sheet, lambda ids: lp[:len(ids)], 64)
    got = res["per_assay"]["Toy_2024_assay"]
    assert got["n_variants"] == 40 and got["wt_rows"] == 1
    f, y = res["scores"]["Toy_2024_assay"], np.array([float(r["DMS_score"]) for r in rows[1:]])
    yb, fb = y > np.median(y), f > np.median(f)
    auc = roc_auc_score(yb, f)
    want = {"spearman": abs(spearmanr(y, f).statistic), "auc": max(auc, 1 - auc),
            "mcc": abs(matthews_corrcoef(yb, fb))}
    assert {m: got[m] for m in want} == pytest.approx(want, abs=1e-12)
    with_wt = assay_metrics(np.concatenate([[0.0], f]), np.concatenate([[0.9], y]))
    assert with_wt["spearman"] != pytest.approx(want["spearman"], abs=1e-6)
