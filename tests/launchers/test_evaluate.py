"""launchers/evaluate.py on a checkpoint trained here: table, JSON, MLflow metrics + plot in a run nested under the
training run (one per evaluation), progress on stderr, --trust-checkpoint for DeepSpeed checkpoints."""
import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import HELDOUT_FASTA, REPO, SAMPLE_FASTA, SHARED_DATA, TINY, launch_env, mlflow_store, run_launch

pytestmark = pytest.mark.slow
RNAGYM = SHARED_DATA / "eval" / "rnagym"


@pytest.fixture(scope="module")
def trained_run(sample_shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    cmd = [sys.executable, str(REPO / "launchers/pretrain.py"), "--ds_config", str(REPO / "ds_configs/zero1.json")]
    for o in [f"data.train_shards={sample_shards}", f"run_dir={run_dir}", "train.max_steps=6", *TINY]:
        cmd += ["--set", o]
    proc = run_launch(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def evaluate(*args):
    return run_launch([sys.executable, str(REPO / "launchers/evaluate.py"), *args], timeout=300)


TRUST = "--trust-checkpoint"  # the checkpoints here were trained by this test module


def test_reconstruction_sweep(trained_run, tmp_path):
    out = tmp_path / "rec.json"
    proc = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                    "--depths", "1-3", "--output", str(out), TRUST)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split("|")[0].strip() == "K" and [ln.split("|")[0].strip() for ln in lines[1:4]] == ["1", "2", "3"]
    res = json.loads(out.read_text())
    assert res["sequences"] == 211 and set(res["per_depth"]) == {"1", "2", "3"}
    assert len({v["tokens"] for v in res["per_depth"].values()}) == 1  # the same masks at every depth
    assert "logged to MLflow run" in proc.stdout
    # progress with a time estimate on stderr, one warning line for the trusted pickle; stdout keeps the results
    assert "reconstruction K=1-3: 100%" in proc.stderr and "batch/s]" in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")] == [
        f"warning: {TRUST}: unpickling {res['checkpoint']} with torch.load(weights_only=False), which runs any code "
        "the files hold",
        f"warning: {HELDOUT_FASTA}: 205 of 211 sequences are longer than the model's window of 62 residues "
        "(data.context_length 64); each is evaluated on one seeded random window of 62, not whole (the longest has "
        "543)"]
    assert res["cropped"] == 205 and res["window"] == 62
    assert "%|" not in proc.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store(trained_run))
    exps = [e.experiment_id for e in client.search_experiments()]
    (train,) = client.search_runs(exps, "tags.`mlflow.parentRunId` IS NULL")
    (ev,) = client.search_runs(exps, f"tags.`mlflow.parentRunId` = '{train.info.run_id}'")
    assert f"logged to MLflow run {ev.info.run_id} (nested in training run {train.info.run_id})" in proc.stdout
    assert ev.data.tags["eval.task"] == "reconstruction" and ev.data.tags["eval.step"] == "6"
    assert ev.data.tags["eval.data"] == str(HELDOUT_FASTA.resolve())
    hist = client.get_metric_history(ev.info.run_id, "eval/reconstruction/loss")
    assert [h.step for h in hist] == [1, 2, 3]
    assert [h.value for h in hist] == pytest.approx([res["per_depth"][k]["loss"] for k in "123"])
    assert [a.path for a in client.list_artifacts(ev.info.run_id, "eval")] == ["eval/rec-vs-depth.png",
                                                                              "eval/rec.json"]
    assert client.get_metric_history(train.info.run_id, "eval/reconstruction/loss") == []  # nothing overwritten

    # A second data set on the same training run: its own nested run; the first run's metrics and plot stay.
    out2 = tmp_path / "rec2.json"
    second = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(SAMPLE_FASTA),
                      "--depths", "1,2", "--output", str(out2), TRUST)
    assert second.returncode == 0, second.stderr
    runs = client.search_runs(exps, f"tags.`mlflow.parentRunId` = '{train.info.run_id}'")
    by_data = {r.data.tags["eval.data"]: r.info.run_id for r in runs}
    assert set(by_data) == {str(HELDOUT_FASTA.resolve()), str(SAMPLE_FASTA.resolve())}
    assert [h.step for h in client.get_metric_history(ev.info.run_id, "eval/reconstruction/loss")] == [1, 2, 3]
    hist2 = client.get_metric_history(by_data[str(SAMPLE_FASTA.resolve())], "eval/reconstruction/loss")
    want2 = json.loads(out2.read_text())["per_depth"]
    assert [(h.step, h.value) for h in hist2] == [(1, pytest.approx(want2["1"]["loss"])),
                                                  (2, pytest.approx(want2["2"]["loss"]))]
    assert [a.path for a in client.list_artifacts(ev.info.run_id, "eval")] == ["eval/rec-vs-depth.png",
                                                                              "eval/rec.json"]
    # same seed -> identical numbers (fixed initial-state table and masks)
    again = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                     "--depths", "1-3", "--output", str(tmp_path / "again.json"), "--no-mlflow", TRUST)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again.json").read_text())["per_depth"] == res["per_depth"]


def _mutate(wt: str, mutant: str) -> str:
    s = list(wt)
    for m in filter(None, mutant.split(",")):
        assert s[int(m[1:-1]) - 1] == m[0], (wt, m)
        s[int(m[1:-1]) - 1] = m[-1]
    return "".join(s)


# Tiny assays on two real wild types of the shared reference sheet: the hammerhead ribozyme (45 nt, one window at
# the test model's context of 64) and the Julien 2016 splicing exon (63 nt > 62 residues per window, so two
# windows; the sheet calls its type bare "mRNA"). Each: the wild-type row (F = 0), four singles, one double;
# the Julien mutations sit in both halves, so rows from both windows are used. Scores are made up.
TINY_ASSAYS = {
    "Roberts_2023_hh_ribozyme": [("", 0.35), ("A1G", 0.10), ("G10C", -0.42), ("U24A", 0.71), ("C29U", -0.05),
                                 ("G4A,A37C", -0.88)],
    "Julien_2016_mRNA": [("", 0.20), ("A2G", -0.31), ("U21C", 0.52), ("C42G", -0.74), ("U56A", 0.08),
                         ("G17A,C49U", 0.93)],
}


def _hand_scores(trained, wt: str, mutants, depth: int, seed: int) -> np.ndarray:
    """F(v; w) = sum_j [log p(v_j | w, j) - log p(w_j | w, j)] (A.10) straight from the model, without
    pipeline.eval.rnagym: <cls> wt <eos> unmasked, the seed-fixed position-indexed initial state of the sweep,
    one forward at ``depth``. A wild type longer than the context is read in two windows, each position from the
    one where it is farther from an edge (the first on a tie)."""
    import torch

    from pipeline.data.tokenizer import CLS_ID, EOS_ID, VOCAB
    from pipeline.eval.reconstruction import state_table
    from pipeline.models.eco_rna import initial_state

    cfg = trained.cfg
    table = state_table(cfg.model, cfg.data.context_length, seed)
    body = cfg.data.context_length - 2
    ids = [VOCAB.index(b) for b in wt]

    @torch.no_grad()
    def logprobs(chunk):  # residue ids -> [len(chunk), V] float64
        tokens = torch.tensor([[CLS_ID, *chunk, EOS_ID]])
        mask = torch.ones_like(tokens, dtype=torch.bool)
        out = trained.model(tokens, mask, depth, initial_state(cfg.model, mask, table=table))
        return torch.log_softmax(out.logits[0].float(), -1).double().numpy()[1:-1]

    if len(ids) <= body:
        lp = logprobs(ids)
    else:
        second = len(ids) - body
        assert second <= body // 2, "two windows cover this wild type only if it is at most 1.5 windows long"
        first_lp, second_lp = logprobs(ids[:body]), logprobs(ids[second:])
        lp = np.stack([first_lp[p] if min(p, body - 1 - p) >= min(p - second, len(ids) - 1 - p)
                       else second_lp[p - second] for p in range(len(ids))])
    f = np.zeros(len(mutants))
    for i, mutant in enumerate(mutants):
        for m in filter(None, mutant.split(",")):
            p = int(m[1:-1]) - 1
            f[i] += lp[p, VOCAB.index(m[-1])] - lp[p, VOCAB.index(m[0])]
    return f


def _hand_metrics(f: np.ndarray, y: np.ndarray) -> dict:
    """Eq. A.11 with scipy/sklearn: y above its median for AUC and MCC, F above its median for MCC."""
    from scipy.stats import spearmanr
    from sklearn.metrics import matthews_corrcoef, roc_auc_score

    y_bin, f_bin = y > np.median(y), f > np.median(f)
    auc = roc_auc_score(y_bin, f)
    return {"spearman": abs(spearmanr(f, y).statistic), "auc": max(auc, 1 - auc),
            "mcc": abs(matthews_corrcoef(y_bin, f_bin)), "score_mean": f.mean()}


@pytest.mark.skipif(not RNAGYM.is_dir(), reason="needs ../shared/data (the RNAGym reference sheet)")
def test_rnagym_sweep_matches_a_hand_computed_score(trained_run, tmp_path):
    from pipeline.checkpoint import load_trained_model

    sheet = {r["DMS_ID"]: r for r in csv.DictReader(open(RNAGYM / "reference_sheet.csv", newline=""))}
    gym = tmp_path / "gym"
    gym.mkdir()
    for dms_id, rows in TINY_ASSAYS.items():
        wt = sheet[dms_id]["RAW_CONSTRUCT_SEQ"]
        with open(gym / f"{dms_id}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["mutant", "DMS_score", "sequence"])
            w.writerows([m, y, _mutate(wt, m)] for m, y in rows)
    out = tmp_path / "gym.json"
    proc = evaluate("--checkpoint", str(trained_run), "--task", "rnagym", "--data", str(gym), "--reference-sheet",
                    str(RNAGYM / "reference_sheet.csv"), "--depths", "1,2", "--output", str(out), "--no-mlflow", TRUST)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert "RNA types (assays): Ribozyme 1, mRNA-splicing 1; missing mRNA-coding, tRNA, Aptamer" in proc.stdout

    had_accelerator = "DS_ACCELERATOR" in os.environ
    try:
        trained = load_trained_model(trained_run)
    finally:  # it sets DS_ACCELERATOR=cpu on a CPU host; keep that out of the later launches' environment
        if not had_accelerator:
            os.environ.pop("DS_ACCELERATOR", None)
    types = {"Roberts_2023_hh_ribozyme": "Ribozyme", "Julien_2016_mRNA": "mRNA-splicing"}
    means = {}
    for k in (1, 2):
        got = res["per_depth"][str(k)]
        assert got["n_variants"] == 10  # each assay's wild-type row (empty mutant) is dropped, as RNAGym does
        hand = {}
        for dms_id, rows in TINY_ASSAYS.items():
            rows = [(m, y) for m, y in rows if m]  # the scored variants
            f = _hand_scores(trained, sheet[dms_id]["RAW_CONSTRUCT_SEQ"], [m for m, _ in rows], k, seed=0)
            # Ranks must be clear of float noise, or a 1e-7 difference could move a metric.
            assert np.diff(np.sort(f)).min() > 1e-4, f
            hand[dms_id] = _hand_metrics(f, np.array([y for _, y in rows]))
            a = got["per_assay"][dms_id]
            assert a["rna_type"] == types[dms_id] and a["one_class"] == [] and a["wt_rows"] == 1
            for m, v in hand[dms_id].items():
                assert a[m] == pytest.approx(v, abs=1e-6), (k, dms_id, m)
            means[k, dms_id] = hand[dms_id]["score_mean"]
        agg = got["aggregate"]
        assert agg["types"] == {"Ribozyme": 1, "mRNA-splicing": 1} and agg["n_types"] == 2
        assert agg["types_missing"] == ["mRNA-coding", "tRNA", "Aptamer"]
        for m in ("spearman", "auc", "mcc"):  # one assay per type: the type means are the assays, then 1/2 each
            assert got["per_type"][types["Julien_2016_mRNA"]][m] == pytest.approx(hand["Julien_2016_mRNA"][m],
                                                                                  abs=1e-6)
            want = (hand["Roberts_2023_hh_ribozyme"][m] + hand["Julien_2016_mRNA"][m]) / 2
            assert agg[m] == pytest.approx(want, abs=1e-6), (k, m)
        assert res["table"][k - 1] == pytest.approx([k, agg["spearman"], agg["auc"], agg["mcc"]])
    assert means[1, "Julien_2016_mRNA"] != pytest.approx(means[2, "Julien_2016_mRNA"], abs=1e-4)  # K matters


def test_bad_input_is_one_error_line(trained_run, tmp_path):
    proc = evaluate("--checkpoint", str(tmp_path), "--task", "reconstruction", "--data", str(HELDOUT_FASTA))
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and len(proc.stderr.splitlines()) == 1
    proc = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                    "--depths", "3-1")
    assert proc.returncode == 2 and "--depths '3-1'" in proc.stderr
    # the cap: 4 x the deepest training depth, the demo config's objective.k_cap 8
    proc = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                    "--depths", "1-33", TRUST)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "--depths '1-33': depth 33 is above the maximum 32" in proc.stderr and "config.yaml" in proc.stderr
    # the run's own DeepSpeed checkpoint needs no --trust-checkpoint: its files hold tensors and DeepSpeed's classes
    proc = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                    "--depths", "1", "--output", str(tmp_path / "own.json"), "--no-mlflow")
    assert proc.returncode == 0, proc.stderr
    assert not [ln for ln in proc.stderr.splitlines() if "warning" in ln and "model's window" not in ln], proc.stderr


def test_export_loads_without_deepspeed_and_gives_the_same_numbers(trained_run, tmp_path):
    export = tmp_path / "export"
    proc = subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), "--checkpoint", str(trained_run),
                           "--output", str(export)], cwd=REPO, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr  # the run's own checkpoint: no --trust-checkpoint
    assert sorted(p.name for p in export.iterdir()) == [  # weights, configs, the model's code, the tokenizer
        ".written-by.json", "README.md", "attention_ops.py", "config.json", "config.yaml", "eco_rna.py", "export.json",
        "heads.py", "hf_base.py", "layers.py", "model.safetensors", "modeling_eco_rna.py", "norm_op.py",
        "tokenizer.json", "tokenizer_config.json"]  # heads.py: modeling_eco_rna.py's task classes (docs/adaptation.md)
    assert "convert: 100%" in proc.stderr and proc.stdout.startswith("exported ")  # progress on stderr only
    assert json.loads((export / "export.json").read_text())["tokenizer"]["name"] == "nucleotide"
    outs = []
    for ckpt, trust in ((trained_run, [TRUST]), (export, [])):  # the export needs no trust
        out = tmp_path / f"{ckpt.name}.json"
        proc = evaluate("--checkpoint", str(ckpt), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                        "--depths", "2", "--output", str(out), "--no-mlflow", *trust)
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(out.read_text())["per_depth"])
    assert outs[0] == outs[1]
    again = subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), "--checkpoint",
                            str(trained_run), "--output", str(export), TRUST], cwd=REPO, env=launch_env(),
                           capture_output=True, text=True)
    assert again.returncode == 2 and "already holds an export; pass --force" in again.stderr
    # Campaign case 5: a re-export with --force deleted the results evaluate wrote into the export and a user's
    # notes. Now only what the convert run wrote is replaced; the rest is carried over and named in a note.
    ours = {"NOTES.md": b"which run this is\n", "eval-reconstruction.json": (tmp_path / "run.json").read_bytes()}
    for name, data in ours.items():
        (export / name).write_bytes(data)
    forced = subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), "--checkpoint",
                             str(trained_run), "--output", str(export), TRUST, "--force"], cwd=REPO, env=launch_env(),
                            capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    assert {name: (export / name).read_bytes() for name in ours} == ours
    assert ("note: kept 2 files that convert_checkpoint.py did not write: NOTES.md, eval-reconstruction.json"
            in forced.stderr), forced.stderr
