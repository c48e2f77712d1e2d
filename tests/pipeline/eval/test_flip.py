"""FLIP (pipeline/eval/flip.py, launchers/evaluate.py --task flip) on real GB1 split rows (tests/fixtures/flip/gb1,
rows of FLIP's one_vs_rest and three_vs_rest copied byte for byte) and on AAV / Meltome files in their published
format: the reader and its one-line errors, the probe's validation rows never entering the fit, and both protocols
through the launcher on a tiny random ESM2 written by transformers (read as it is) and a tiny random ProtLingo,
each number recomputed independently (transformers' EsmForMaskedLM by hand, scikit-learn's Ridge, scipy's
Spearman)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from sklearn.linear_model import Ridge

from launchers import evaluate
from pipeline.eval import flip

sys.path.insert(0, str(Path(__file__).parent))
from protein_models import FIXTURES, hf_esm, write_hf_esm, write_protlingo_export  # noqa: E402

GB1 = FIXTURES / "flip" / "gb1"
WT = flip.read_wild_type(GB1 / "5LDE_1.fasta")


def main(*args):
    return evaluate.main(list(map(str, args)))


def test_reader_on_real_gb1_rows():
    s = flip.read_split(GB1 / "one_vs_rest.csv")
    assert len(s.sequences) == 72 and int((~s.is_test).sum()) == 28 and int(s.validation.sum()) == 3
    assert s.sequences[0] == WT and s.target[0] == 1.0 and len(WT) == 265  # the wild type is FLIP's first row
    assert int(s.fit_rows.sum()) == 25 and not (s.validation & s.is_test).any()
    t = flip.read_split(GB1 / "three_vs_rest.csv")
    # every GB1 variant differs from the wild type only at V39, D40, G41, V54
    sites = {p for seq in s.sequences + t.sequences for p, _, _ in flip.substitutions(seq, WT)}
    assert sites == {39, 40, 41, 54}
    m = flip.read_split(FIXTURES / "flip" / "meltome" / "mixed_split.csv")  # Meltome writes False, not empty
    assert int(m.validation.sum()) == 2 and int(m.fit_rows.sum()) == 9


@pytest.mark.parametrize("row, message", [
    ("AKV,1.0,train,", None),
    ("AKV,1.0,valid,", r"bad.csv:3: set 'valid' is neither train nor test"),
    ("AKV,1.0,train,yes", r"bad.csv:3: validation 'yes' is neither True, False nor empty"),
    ("AKV,1.0,test,True", r"bad.csv:3: a validation row must be a train row \(set is 'test'\)"),
    ("AKJV,1.0,train,", r"bad.csv:3: sequence has 'J', not an amino-acid token"),
    ("AKV,nan,train,", r"bad.csv:3: target 'nan' is not a finite number"),
])
def test_reader_errors_name_file_and_line(tmp_path, row, message):
    path = tmp_path / "bad.csv"
    path.write_text(f"sequence,target,set,validation\nAKV,0.5,test,\n{row}\n")
    if message is None:
        assert len(flip.read_split(path).sequences) == 2
    else:
        with pytest.raises(ValueError, match=message):
            flip.read_split(path)
    path.write_text("sequence,score,set\nAKV,1,test\n")
    with pytest.raises(ValueError, match=r"bad.csv: required column 'target' is missing"):
        flip.read_split(path)


def test_validation_rows_never_enter_the_fit():
    """The probe fitted on the split equals scikit-learn's Ridge on exactly the train rows outside validation, and
    rewriting the validation rows' features and targets changes the chosen alpha at most, never the fit."""
    split = flip.read_split(GB1 / "three_vs_rest.csv")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(len(split.sequences), 6)) + split.target[:, None] * rng.normal(size=6)
    rep = flip.fit_probe(x, split, alphas=(1.0,))
    fit = (~split.is_test) & (~split.validation)
    want = Ridge(alpha=1.0).fit(x[fit], split.target[fit]).predict(x)
    np.testing.assert_allclose(rep["predictions"], want, rtol=0, atol=1e-10)
    assert rep["n_fit"] == int(fit.sum()) == 114 - 42 - 12 and rep["n_validation"] == 12
    assert rep["spearman_test"] == pytest.approx(spearmanr(split.target[split.is_test], want[split.is_test])[0])
    poisoned = x.copy()
    poisoned[split.validation] = 1e3
    split.target[split.validation] = -1e3
    again = flip.fit_probe(poisoned, split, alphas=(1.0,))
    np.testing.assert_allclose(np.array(again["predictions"])[~split.validation],
                               np.array(rep["predictions"])[~split.validation], rtol=0, atol=1e-10)
    # the alpha is the one with the best validation Spearman, each fitted on the fit rows alone
    alphas = (0.01, 10.0, 1e4)
    clean = flip.read_split(GB1 / "three_vs_rest.csv")
    sel = flip.fit_probe(x, clean, alphas=alphas)
    val = clean.validation
    by_hand = {a: spearmanr(clean.target[val], Ridge(alpha=a).fit(x[fit], clean.target[fit]).predict(x[val]))[0]
               for a in alphas}
    assert sel["alpha"] == max(alphas, key=lambda a: by_hand[a])
    assert sel["validation_spearman_by_alpha"] == pytest.approx({str(a): v for a, v in by_hand.items()})


def zero_shot_by_hand(model, seqs):
    """Masked marginals from transformers' EsmForMaskedLM, one forward per substituted position."""
    ids = torch.tensor([[0, *(flip._TOKEN[c] for c in WT), 2]])
    lp = {}
    out = []
    for s in seqs:
        total = 0.0
        for i, (a, b) in enumerate(zip(WT, s)):
            if a != b:
                if i not in lp:
                    masked = ids.clone()
                    masked[0, i + 1] = 32
                    with torch.no_grad():
                        lp[i] = torch.log_softmax(model(masked, attention_mask=torch.ones_like(masked)).logits[0, i + 1]
                                                  .double(), -1)
                total += float(lp[i][flip._TOKEN[b]] - lp[i][flip._TOKEN[a]])
        out.append(total)
    return np.array(out)


def test_gb1_both_protocols_on_a_random_esm2_directory_equal_transformers(tmp_path):
    esm_dir = write_hf_esm(tmp_path / "esm", seed=1)
    out = tmp_path / "flip.json"
    assert main("--checkpoint", esm_dir, "--task", "flip", "--data", GB1, "--output", out, "--no-mlflow") == 0
    res = json.loads(out.read_text())
    assert res["splits"] == ["one_vs_rest", "three_vs_rest"] and res["wild_type_length"] == 265
    assert out.with_suffix(".png").stat().st_size > 10_000
    model = hf_esm(esm_dir)
    for name in res["splits"]:
        split = flip.read_split(GB1 / f"{name}.csv")
        rep = res["per_split"][name]
        test = split.is_test
        # zero-shot: the masked marginals of transformers' model, Spearman on the test rows as scipy computes it
        scores = zero_shot_by_hand(model, split.sequences)
        np.testing.assert_allclose(rep["zeroshot"]["scores"], scores, rtol=0, atol=2e-5)
        assert rep["zeroshot"]["spearman_test"] == pytest.approx(spearmanr(split.target[test], scores[test])[0],
                                                                  abs=1e-6)
        # probe: features = transformers' last hidden state averaged over the residues; the ridge = scikit-learn's
        ids = torch.tensor([[0, *(flip._TOKEN[c] for c in s), 2] for s in split.sequences])  # all 265 residues
        with torch.no_grad():
            x = model.esm(ids, attention_mask=torch.ones_like(ids)).last_hidden_state[:, 1:-1].double().mean(1).numpy()
        fit = split.fit_rows
        pred = Ridge(alpha=rep["probe"]["alpha"]).fit(x[fit], split.target[fit]).predict(x)
        np.testing.assert_allclose(rep["probe"]["predictions"], pred, rtol=0, atol=1e-4)
        assert rep["probe"]["spearman_test"] == pytest.approx(spearmanr(split.target[test], pred[test])[0], abs=1e-6)
        assert rep["probe"]["n_validation"] == int(split.validation.sum()) > 0


def test_gb1_on_a_protlingo_export_and_the_other_landscapes(tmp_path, capsys):
    export = write_protlingo_export(tmp_path / "pl")
    out = tmp_path / "f.json"
    assert main("--checkpoint", export, "--task", "flip", "--data", GB1 / "one_vs_rest.csv", "--output", out,
                "--no-mlflow", "--flip-protocol", "zeroshot") == 0
    res = json.loads(out.read_text())
    from pipeline.checkpoint import load_trained_model
    from pipeline.eval.proteingym import masked_marginals

    model = load_trained_model(export).model
    split = flip.read_split(GB1 / "one_vs_rest.csv")
    lp, _ = masked_marginals(WT, {39, 40, 41, 54}, lambda t, m: model(t, m).logits)
    want = [sum(lp[p][flip._TOKEN[b]] - lp[p][flip._TOKEN[a]] for p, a, b in flip.substitutions(s, WT))
            for s in split.sequences]
    np.testing.assert_allclose(res["per_split"]["one_vs_rest"]["zeroshot"]["scores"], want, rtol=0, atol=1e-9)
    assert "probe" not in res["per_split"]["one_vs_rest"]
    # AAV: insertions and deletions are counted, not scored by masked marginals; the probe takes every row
    assert main("--checkpoint", export, "--task", "flip", "--data", FIXTURES / "flip" / "aav", "--output",
                tmp_path / "a.json", "--no-mlflow") == 0
    aav = json.loads((tmp_path / "a.json").read_text())["per_split"]["des_mut"]
    assert aav["zeroshot"]["n_indel"] == 2 and aav["zeroshot"]["n_scored"] == 10
    assert aav["zeroshot"]["scores"][-2:] == [None, None] and len(aav["probe"]["predictions"]) == 12
    assert "des_mut: 2 variants of another length" in capsys.readouterr().err
    # Meltome: no wild type, the probe only (and zeroshot alone is refused in one line)
    melt = FIXTURES / "flip" / "meltome"
    assert main("--checkpoint", export, "--task", "flip", "--data", melt, "--output", tmp_path / "m.json",
                "--no-mlflow", "--window", "40") == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert "zeroshot" not in m["per_split"]["mixed_split"] and any("cut to their first 38" in c for c in m["caveats"])
    capsys.readouterr()
    assert main("--checkpoint", export, "--task", "flip", "--data", melt, "--output", tmp_path / "z.json",
                "--no-mlflow", "--flip-protocol", "zeroshot") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {melt}: --flip-protocol zeroshot needs the wild type")
    assert main("--checkpoint", export, "--task", "flip", "--data", melt, "--depths", "1-2") == 2
    assert "--depths does not apply to --task flip" in capsys.readouterr().err
