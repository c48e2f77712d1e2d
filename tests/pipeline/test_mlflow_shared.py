"""MLflow for a group (docs/tracking.md): two trainings started at once in two run directories, with no store
configured, land in one store beside them (runs/mlflow.db in a checkout); each run holds rank 0's system metrics, the
commit of the code, its command line and its training and validation shards as dataset inputs; a resume continues its
run in that store. Real launches (tiny Eco-RNA, one rank each, the quickstart's shape), each one process (conftest
pretrain_cmd: without the deepspeed runner's two interpreters, which MLflow does not see; the runner's own tests are
conftest deepspeed_cmd's)."""
import hashlib
import json
import subprocess
import sys

import pytest

from conftest import (HELDOUT_FASTA, REPO, TINY, kill_group, launch_env, mlflow_runs, mlflow_store, pretrain_cmd,
                      run_single)

STEPS = 4


def sets(shards, val, run_dir, steps=STEPS):
    return [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", *TINY,
            f"data.val_shards=[{val}]", "eval.every=2", "eval.max_samples=16", "eval.depths=[1,2]",
            "tracking.system_metrics_s=0.5", "tracking.experiment=group"]


@pytest.fixture(scope="module")
def val_shards(tmp_path_factory):
    """The shipped held-out sample as shards, as the quickstart validates on."""
    out = tmp_path_factory.mktemp("val") / "rfam_val"
    subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(HELDOUT_FASTA), "--output",
                    str(out)], cwd=REPO, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def two_runs(sample_shards, val_shards, tmp_path_factory):
    runs = tmp_path_factory.mktemp("checkout") / "runs"
    dirs = [runs / "a", runs / "b"]
    procs = [subprocess.Popen(pretrain_cmd("ds_configs/zero2.json", sets(sample_shards, val_shards, d)), cwd=REPO,
                              env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for d in dirs]  # no MLFLOW_TRACKING_URI: the default store
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    return runs, dirs


def test_two_concurrent_runs_share_the_store_beside_their_run_dirs(two_runs):
    from mlflow.tracking import MlflowClient

    runs, dirs = two_runs
    assert {mlflow_store(d) for d in dirs} == {f"sqlite:///{runs / 'mlflow.db'}"}
    assert not any((d / "mlflow.db").exists() for d in dirs)
    client = MlflowClient(tracking_uri=mlflow_store(dirs[0]))
    (exp,) = [e for e in client.search_experiments() if e.name == "group"]
    found = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in found) == ["a", "b"] and {r.info.status for r in found} == {"FINISHED"}
    for r in found:
        assert [m.step for m in client.get_metric_history(r.info.run_id, "loss")] == list(range(1, STEPS + 1))
        assert [m.step for m in client.get_metric_history(r.info.run_id, "val/loss_K2")] == [2, 4]
        assert r.info.artifact_uri.startswith((runs / "mlartifacts").as_uri())


def test_each_run_has_system_metrics_git_commit_command_and_data(two_runs, sample_shards, val_shards):
    from mlflow.tracking import MlflowClient

    runs, dirs = two_runs
    client = MlflowClient(tracking_uri=mlflow_store(dirs[0]))
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    digest = {d: hashlib.sha256((d / "manifest.json").read_bytes()).hexdigest() for d in (sample_shards, val_shards)}
    for d in dirs:
        (run,) = mlflow_runs(d)
        run = client.get_run(run.info.run_id)
        cpu = client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
        assert cpu and all(0 <= m.value <= 100 for m in cpu)
        tags = run.data.tags
        assert tags["mlflow.source.git.commit"] == head and tags["pipeline.git.dirty"] in ("true", "false")
        assert "launchers/pretrain.py" in tags["pipeline.command"] and f"run_dir={d}" in tags["pipeline.command"]
        inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
        assert set(inputs) == {"training", "validation"}
        for context, shards in (("training", sample_shards), ("validation", val_shards)):
            ds = inputs[context]
            assert (ds.name, ds.digest, ds.source_type) == (shards.name, digest[shards][:16], "local")
            assert json.loads(ds.source)["uri"] == str(shards.resolve())
        # diagnostics after loss, lr and val/ in the UI; metrics.jsonl keeps the engine's names
        assert {"loss", "lr", "train.grad_norm", "train.total.tokens"} <= set(run.data.metrics)
        assert "grad_norm" not in run.data.metrics


def test_a_resumed_run_continues_in_the_shared_store(two_runs, sample_shards, val_shards):
    from mlflow.tracking import MlflowClient

    runs, dirs = two_runs
    (before,) = mlflow_runs(dirs[0])
    more = run_single("ds_configs/zero2.json", sets(sample_shards, val_shards, dirs[0], STEPS + 2))
    assert more.returncode == 0 and "resumed from" in more.stdout, more.stderr[-3000:]
    (after,) = mlflow_runs(dirs[0])
    assert after.info.run_id == before.info.run_id and after.info.status == "FINISHED"
    client = MlflowClient(tracking_uri=mlflow_store(dirs[0]))
    assert [m.step for m in client.get_metric_history(after.info.run_id, "loss")] == list(range(1, STEPS + 3))
    assert f"resumed_at_step_{STEPS}.git.commit" in after.data.tags
    # system metrics continue after the first attempt's steps instead of writing over them
    steps = [m.step for m in client.get_metric_history(after.info.run_id, "system/cpu_utilization_percentage")]
    assert len(steps) == len(set(steps))
    assert len(mlflow_runs(dirs[1])) == 1 and not (dirs[0] / "mlflow.db").exists()
