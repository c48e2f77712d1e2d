"""launchers/evaluate.py --task proteingym: the masked-LM adapter on a tiny random HF EsmForMaskedLM, and the whole
CLI on checkpoints the launcher loads (a tiny fixed-depth masked LM exported with a 33-token vocabulary, and an
upcycled ProtLingo export), one assay or a folder, JSON + per-mutant CSVs + MLflow, and one-line errors with a
non-zero exit."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, SHARED_DATA
from launchers import evaluate
from pipeline.checkpoint import load_trained_model
from pipeline.config import dump_yaml, load_config
from pipeline.eval import proteingym as pg
from pipeline.families import get_family

PG = SHARED_DATA / "eval" / "proteingym"
BLAT = PG / "BLAT_ECOLX_Jacquier_2013.csv"
REF = PG / "DMS_substitutions.csv"
needs_data = pytest.mark.skipif(not PG.exists(), reason="needs ../shared/data/eval/proteingym")
WT_A = "MSIQHFRVALIPFFAAFCLPVFAHPETLVKVKDAEDQLGARVGYIELDLNSGK"  # 53 aa
WT_B = "MKTAYIAKQRQISFVKSHFSRQ"  # 22 aa
TINY_MLM = ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=32", "model.n_prelude=1",
            "model.n_core=1", "model.n_coda=0"]


def write_assay(path: Path, wt: str, mutants, seed=0):
    """An assay on ``wt`` with random DMS scores (the binarisation at 0); every mutant checked against ``wt``."""
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["mutant", "mutated_sequence", "DMS_score", "DMS_score_bin"])
        for m in mutants:
            s = list(wt)
            for sub in m.split(":"):
                assert s[int(sub[1:-1]) - 1] == sub[0], (wt, m)
                s[int(sub[1:-1]) - 1] = sub[-1]
            score = float(rng.normal())
            w.writerow([m, "".join(s), score, int(score > 0)])
    return path


def write_reference(path: Path, entries):
    with open(path, "w", newline="") as fh:  # CRLF, like the official file
        w = csv.writer(fh, lineterminator="\r\n")
        w.writerow(["DMS_index", "DMS_id", "DMS_filename", "target_seq", "seq_len"])
        for k, (dms_id, wt) in enumerate(entries):
            w.writerow([f"DMS_sub_{k}", dms_id, f"{dms_id}.csv", wt, len(wt)])
    return path


MUT_A = ["M1A", "H5Y", "F17W", "P20G", "K53D", "S2C:K53R", "A16P:L19G:T27Q", "L38K", "E26D", "S51A"]
MUT_B = ["M1L", "K2R", "T3S", "Y5F", "I6V:K8R", "Q22E", "S13T", "F14L"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("pg")
    write_assay(d / "AAAA_TEST_2024.csv", WT_A, MUT_A, 1)
    write_assay(d / "BBBB_TEST_2024.csv", WT_B, MUT_B, 2)
    write_assay(d / "UNLISTED.csv", WT_B, MUT_B[:3], 3)
    ref = write_reference(d / "DMS_substitutions.csv", [("AAAA_TEST_2024", WT_A), ("BBBB_TEST_2024", WT_B),
                                                        ("CCCC_ELSEWHERE", WT_B)])
    return d, ref


def export_mlm(tmp: Path, vocab: int) -> Path:
    """A tiny eco_rna_control (fixed-depth masked LM, forward(tokens, mask).logits) exported as model.safetensors +
    config.yaml, with ``vocab`` output tokens."""
    from safetensors.torch import save_file

    cfg = load_config(REPO / "launchers/configs/eco_rna_control_stage_a.yaml",
                      [f"model.vocab_size={vocab}", *TINY_MLM, f"run_dir={tmp / 'run'}"])
    torch.manual_seed(0)
    model = get_family(cfg.family).build_model(cfg.model)
    export = tmp / f"export{vocab}"
    export.mkdir()
    save_file(model.state_dict(), str(export / "model.safetensors"))
    (export / "config.yaml").write_text(dump_yaml(cfg))
    return export


@pytest.fixture(scope="module")
def export33(tmp_path_factory):
    return export_mlm(tmp_path_factory.mktemp("mlm"), 33)


def tiny_esm(seed=0):
    from transformers import EsmConfig, EsmForMaskedLM

    cfg = EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=1026, position_embedding_type="rotary", token_dropout=True,
                    emb_layer_norm_before=False, mask_token_id=32, pad_token_id=1)
    torch.manual_seed(seed)
    return EsmForMaskedLM(cfg).eval()


def library_scores(assay_path, wt_entry, logits_fn, **kw):
    a = pg.load_assay(assay_path, wt_entry)
    return pg.evaluate_assays([a], logits_fn, **kw)["scores"][a.dms_id]


def main(*args):
    return evaluate.main(list(map(str, args)))


# ----------------------------------------------------------------------------------- the adapter, direct

def test_adapter_on_hf_esm_matches_library(folder):
    d, ref = folder
    model = tiny_esm(3)
    res = evaluate.run_proteingym(model, d / "AAAA_TEST_2024.csv", ref, window=1024, batch_size=4)
    direct = library_scores(d / "AAAA_TEST_2024.csv", pg.load_reference(ref)["AAAA_TEST_2024.csv"],
                            lambda t, m: model(t, m.long()).logits)
    assert res["scores"]["AAAA_TEST_2024"]["score"] == pytest.approx(direct.tolist(), abs=1e-6)
    assert res["assays"] == ["AAAA_TEST_2024"] and res["per_assay"]["AAAA_TEST_2024"]["wt_source"] == "reference"
    assert np.ptp(direct) > 0.01
    # the window reaches the scorer: a 32-token window on the 55-token framed wild type changes the scores
    small = evaluate.run_proteingym(model, d / "AAAA_TEST_2024.csv", ref, window=32, batch_size=4)
    assert small["per_assay"]["AAAA_TEST_2024"]["windows"] > 1
    assert not np.allclose(small["scores"]["AAAA_TEST_2024"]["score"], direct, atol=1e-4)


def test_adapter_refuses_a_model_without_logits(folder):
    d, ref = folder

    class NoLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def forward(self, tokens, mask):
            return torch.zeros(*tokens.shape, 33)

    with pytest.raises(ValueError, match=r"NoLogits\(input_ids, attention_mask\) returned Tensor without \.logits"):
        evaluate.run_proteingym(NoLogits(), d / "BBBB_TEST_2024.csv", ref, 1024, 8)


# ------------------------------------------------------------------------------------------ the whole CLI

def test_cli_folder(folder, export33, tmp_path, capsys):
    d, ref = folder
    out = tmp_path / "pg.json"
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", d, "--reference", ref,
                "--output", out, "--no-mlflow", "--batch-size", 5) == 0
    cap = capsys.readouterr()
    assert "not scored: UNLISTED.csv" in cap.err
    # a hand-made reference without ProteinGym's grouping columns: per-assay scores and their mean, no leaderboard
    assert "has no UniProt_ID and no coarse_selection_type column: the leaderboard's average" in cap.err
    lines = cap.out.splitlines()
    assert lines[0].split("|")[0].strip() == "assay" and lines[1].startswith("AAAA_TEST_2024")
    assert lines[3].startswith("mean of 2")
    res = json.loads(out.read_text())
    assert res["task"] == "proteingym" and res["depths"] is None and res["skipped"] == ["UNLISTED.csv"]
    assert res["assays"] == ["AAAA_TEST_2024", "BBBB_TEST_2024"] and "scores" not in res
    assert res["leaderboard"] is None
    agg, per = res["aggregate"], res["per_assay"]
    assert agg["n"] == 2 and agg["n_mutants"] == len(MUT_A) + len(MUT_B)
    for k in pg.METRICS:
        assert agg[k] == pytest.approx(np.mean([per["AAAA_TEST_2024"][k], per["BBBB_TEST_2024"][k]]))
    # per-mutant scores beside the JSON = the library on the loaded model
    model = load_trained_model(export33).model
    refd = pg.load_reference(ref)
    for name, muts in (("AAAA_TEST_2024", MUT_A), ("BBBB_TEST_2024", MUT_B)):
        rows = list(csv.DictReader(open(tmp_path / "pg-scores" / f"{name}.csv", newline="")))
        assert [r["mutant"] for r in rows] == muts
        direct = library_scores(d / f"{name}.csv", refd[f"{name}.csv"], lambda t, m: model(t, m).logits)
        assert [float(r["score"]) for r in rows] == pytest.approx(direct.tolist(), abs=1e-6)


def test_cli_logs_to_mlflow(folder, export33, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    d, ref = folder
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("pg"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    out = tmp_path / "pg.json"
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", d, "--reference", ref,
                "--output", out) == 0
    captured = capsys.readouterr()
    (ev,) = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
    assert f"logged to MLflow run {ev.info.run_id} (nested in training run {run.info.run_id})" in captured.out
    assert ev.data.tags["eval.task"] == "proteingym" and ev.data.tags["eval.data"] == str(d.resolve())
    assert "proteingym AAAA_TEST_2024: 100%" in captured.err  # a progress bar per assay, on stderr
    res = json.loads(out.read_text())
    for key, val in (("eval/proteingym/spearman", res["aggregate"]["spearman"]),
                     ("eval/proteingym/BBBB_TEST_2024/mcc", res["per_assay"]["BBBB_TEST_2024"]["mcc"])):
        (h,) = client.get_metric_history(ev.info.run_id, key)
        assert h.step == 0 and h.value == pytest.approx(val)  # an export has no training step: 0
        assert client.get_metric_history(run.info.run_id, key) == []  # the training run itself is not written
    assert [a.path for a in client.list_artifacts(ev.info.run_id, "eval")] == ["eval/pg.json"]
    # another data set on the same run: a second nested run, the first one's metrics untouched
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", d / "AAAA_TEST_2024.csv", "--reference",
                ref, "--output", tmp_path / "pg2.json") == 0
    runs = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
    assert sorted(r.data.tags["eval.data"] for r in runs) == sorted([str(d.resolve()),
                                                                    str((d / "AAAA_TEST_2024.csv").resolve())])
    (h,) = client.get_metric_history(ev.info.run_id, "eval/proteingym/spearman")
    assert h.value == pytest.approx(res["aggregate"]["spearman"])


@needs_data
def test_cli_blat_ecolx(export33, tmp_path, capsys):
    """The shared assay end to end; the wild type from the reference and rebuilt from the assay give one result."""
    out, out2 = tmp_path / "blat.json", tmp_path / "blat2.json"
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", BLAT, "--reference", REF,
                "--output", out, "--no-mlflow", "--batch-size", 64) == 0
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", BLAT, "--output", out2,
                "--no-mlflow", "--batch-size", 64) == 0
    capsys.readouterr()
    a, b = json.loads(out.read_text()), json.loads(out2.read_text())
    m = a["per_assay"]["BLAT_ECOLX_Jacquier_2013"]
    assert m["n"] == 989 and m["wt_source"] == "reference" and m["seq_len"] == 286
    assert all(np.isfinite(m[k]) for k in pg.METRICS) and abs(m["spearman"]) < 0.2
    mb = b["per_assay"]["BLAT_ECOLX_Jacquier_2013"]
    assert mb["wt_source"] == "assay" and all(mb[k] == m[k] for k in pg.METRICS)
    rows = list(csv.DictReader(open(tmp_path / "blat-scores" / "BLAT_ECOLX_Jacquier_2013.csv", newline="")))
    assert len(rows) == 989 and all(np.isfinite(float(r["score"])) for r in rows)


# --------------------------------------------------------------------------------------------- errors

def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_cli_wt_mismatch(folder, export33, tmp_path, capsys):
    d, ref = folder
    bad = tmp_path / "AAAA_TEST_2024.csv"
    bad.write_text((d / "AAAA_TEST_2024.csv").read_text().replace("H5Y,", "Q5Y,", 1))
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", bad, "--reference", ref,
                "--no-mlflow", "--output", tmp_path / "x.json") == 2
    assert "AAAA_TEST_2024.csv:3: mutant 'Q5Y': the wild type has 'H' at position 5" in one_error(capsys)
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("extra,msg", [
    (["--depths", "1-3"], "--depths does not apply to --task proteingym"),
    (["--window", "1"], "window: need at least 2 tokens"),
])
def test_cli_refusals(folder, export33, tmp_path, capsys, extra, msg):
    d, ref = folder
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", d, "--reference", ref, "--no-mlflow",
                "--output", tmp_path / "x.json", *extra) == 2
    assert msg in one_error(capsys)


def test_cli_folder_needs_reference_and_listed_assay(folder, export33, tmp_path, capsys):
    d, ref = folder
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", d, "--no-mlflow") == 2
    assert "a folder of assays needs --reference DMS_substitutions.csv" in one_error(capsys)
    assert main("--checkpoint", export33, "--task", "proteingym", "--data", d / "UNLISTED.csv", "--reference", ref,
                "--no-mlflow") == 2
    assert "UNLISTED.csv: not listed in" in one_error(capsys)


def test_cli_refuses_a_non_protein_vocabulary(folder, tmp_path, capsys):
    d, ref = folder
    export23 = export_mlm(tmp_path, 23)  # the nucleotide vocabulary of the Eco-RNA families
    assert main("--checkpoint", export23, "--task", "proteingym", "--data", d, "--reference", ref,
                "--no-mlflow") == 2
    assert "needs a masked LM over the 33-token ESM-2 alphabet; eco_rna_control has model.vocab_size 23" in \
        one_error(capsys)


def test_cli_process_exit_status(folder, export33, tmp_path):
    """The real process: a mutant with an impossible position exits non-zero with one line naming it."""
    d, ref = folder
    bad = tmp_path / "BBBB_TEST_2024.csv"
    bad.write_text((d / "BBBB_TEST_2024.csv").read_text().replace("Q22E,", "Q23E,", 1))
    proc = subprocess.run([sys.executable, str(REPO / "launchers/evaluate.py"), "--checkpoint", str(export33),
                           "--task", "proteingym", "--data", str(bad), "--reference", str(ref), "--no-mlflow"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "mutant 'Q23E': position 23 is outside the wild type (1..22)")


def test_cli_on_an_upcycled_protlingo_export_scores_as_its_esm2(folder, tmp_path, capsys):
    """End to end with the ProtLingo family: a tiny random HF ESM2 upcycled (MoE at every block, memory) by
    tools/upcycle_esm2.py computes the dense ESM2 exactly, so the CLI's scores equal the library's on the HF model."""
    d, ref = folder
    hf = tiny_esm(seed=3)
    hf.save_pretrained(str(tmp_path / "esm"))
    up = subprocess.run([sys.executable, str(REPO / "tools" / "upcycle_esm2.py"), "--esm", str(tmp_path / "esm"),
                         "--out", str(tmp_path / "up"), "--moe-layers", "all", "--num-experts", "3",
                         "--memory-layers", "1"], cwd=REPO, capture_output=True, text=True)
    assert up.returncode == 0, up.stderr
    assert load_trained_model(tmp_path / "up").cfg.family == "protlingo"
    out = tmp_path / "pg.json"
    assert main("--checkpoint", tmp_path / "up", "--task", "proteingym", "--data", d / "AAAA_TEST_2024.csv",
                "--reference", ref, "--output", out, "--no-mlflow") == 0
    capsys.readouterr()
    rows = list(csv.DictReader(open(tmp_path / "pg-scores" / "AAAA_TEST_2024.csv", newline="")))
    with torch.no_grad():
        direct = library_scores(d / "AAAA_TEST_2024.csv", pg.load_reference(ref)["AAAA_TEST_2024.csv"],
                                lambda t, m: hf(t, attention_mask=m.long()).logits)
    assert [float(r["score"]) for r in rows] == pytest.approx(direct.tolist(), abs=1e-5)
    assert np.ptp(direct) > 1e-3  # the scores differ between mutants: the comparison is not of constants
