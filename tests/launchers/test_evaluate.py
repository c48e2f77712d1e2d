"""launchers/evaluate.py on a checkpoint trained here: table, JSON, MLflow metrics + plot in the training run."""
import json
import subprocess
import sys

import pytest

from conftest import HELDOUT_FASTA, REPO, SHARED_DATA, TINY, launch_env, run_launch

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


def test_reconstruction_sweep(trained_run, tmp_path):
    out = tmp_path / "rec.json"
    proc = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                    "--depths", "1-3", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split("|")[0].strip() == "K" and [ln.split("|")[0].strip() for ln in lines[1:4]] == ["1", "2", "3"]
    res = json.loads(out.read_text())
    assert res["sequences"] == 211 and set(res["per_depth"]) == {"1", "2", "3"}
    assert len({v["tokens"] for v in res["per_depth"].values()}) == 1  # the same masks at every depth
    assert "logged to MLflow run" in proc.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{trained_run.resolve()}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    hist = client.get_metric_history(run.info.run_id, "eval/reconstruction/loss")
    assert [h.step for h in hist] == [1, 2, 3]
    assert [h.value for h in hist] == pytest.approx([res["per_depth"][k]["loss"] for k in "123"])
    assert [a.path for a in client.list_artifacts(run.info.run_id, "eval")] == [
        "eval/eval-reconstruction-vs-depth.png"]
    # same seed -> identical numbers (fixed initial-state table and masks)
    again = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                     "--depths", "1-3", "--output", str(tmp_path / "again.json"), "--no-mlflow")
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again.json").read_text())["per_depth"] == res["per_depth"]


@pytest.mark.skipif(not RNAGYM.is_dir(), reason="needs ../shared/data (RNAGym assay and reference sheet)")
def test_rnagym_sweep(trained_run, tmp_path):
    out = tmp_path / "gym.json"
    proc = evaluate("--checkpoint", str(trained_run), "--task", "rnagym", "--data",
                    str(RNAGYM / "Tome_2014_GFP_aptamer.csv"), "--depths", "1,2", "--output", str(out), "--no-mlflow")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    agg = res["per_depth"]["1"]["aggregate"]
    assert res["per_depth"]["1"]["n_variants"] == 417
    assert 0 <= agg["spearman"] <= 1 and 0.5 <= agg["auc"] <= 1


def test_bad_input_is_one_error_line(trained_run, tmp_path):
    proc = evaluate("--checkpoint", str(tmp_path), "--task", "reconstruction", "--data", str(HELDOUT_FASTA))
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and len(proc.stderr.splitlines()) == 1
    proc = evaluate("--checkpoint", str(trained_run), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                    "--depths", "3-1")
    assert proc.returncode == 2 and "--depths '3-1'" in proc.stderr


def test_export_loads_without_deepspeed_and_gives_the_same_numbers(trained_run, tmp_path):
    export = tmp_path / "export"
    proc = subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), "--checkpoint", str(trained_run),
                           "--output", str(export)], cwd=REPO, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in export.iterdir()) == ["config.yaml", "export.json", "model.safetensors"]
    outs = []
    for ckpt in (trained_run, export):
        out = tmp_path / f"{ckpt.name}.json"
        proc = evaluate("--checkpoint", str(ckpt), "--task", "reconstruction", "--data", str(HELDOUT_FASTA),
                        "--depths", "2", "--output", str(out), "--no-mlflow")
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(out.read_text())["per_depth"])
    assert outs[0] == outs[1]
    again = subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), "--checkpoint",
                            str(trained_run), "--output", str(export)], cwd=REPO, env=launch_env(),
                           capture_output=True, text=True)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
