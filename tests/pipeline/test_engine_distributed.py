"""Real 2-process DeepSpeed trainings on CPU (gloo): ZeRO 1-3, MLflow, checkpoints, exact resume after SIGKILL."""
from pathlib import Path

import pytest
import torch

from conftest import (TINY, launch_and_kill, mlflow_runs, mlflow_store, read_jsonl, run_pretrain, run_torchrun,
                      torchrun_pretrain)

pytestmark = pytest.mark.slow


def overrides(shards, run_dir, steps, *more):
    return [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", *TINY, *more]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_trains_tracks_and_checkpoints(sample_shards, tmp_path, stage):
    run_dir = tmp_path / "run"
    shm_before = set(Path("/dev/shm").glob("deepspeed_*"))
    proc = run_pretrain(2, f"ds_configs/zero{stage}.json",
                        overrides(sample_shards, run_dir, 12, "train.grad_accum_steps=2", "checkpoint.every_steps=6"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # DeepSpeed's CPU all-reduce op would leave a 69 MB segment per rank in RAM-backed /dev/shm (engine.init_distributed)
    assert set(Path("/dev/shm").glob("deepspeed_*")) <= shm_before
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    first, last = sum(m["loss"] for m in metrics[:3]) / 3, sum(m["loss"] for m in metrics[-3:]) / 3
    assert last < first - 0.2, (first, last)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step00000012"
    assert (run_dir / "checkpoints" / "step00000006" / "client_state.json").is_file()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store(run_dir))
    (exp,) = [e for e in client.search_experiments() if e.name == "eco-rna-demo"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.d_model"] == "64" and run.data.params["train.max_steps"] == "12"
    # what ran, resolved on this machine: said once in the first lines and kept as params
    resolved = [line for line in proc.stdout.splitlines() if line.startswith("resolved: ")]
    assert len(resolved) == 1, proc.stdout[-3000:]
    said = dict(kv.split("=", 1) for kv in resolved[0].removeprefix("resolved: ").split())
    assert {k: v for k, v in said.items() if k in ("layout", "attention", "norm", "moe", "compile", "zero_stage",
                                                   "grad_accum_steps")} == {
        "layout": "padded", "attention": "sdpa", "norm": "fused", "moe": "none", "compile": "none",
        "zero_stage": str(stage), "grad_accum_steps": "2"}
    assert float(said["memory_model_gib"]) > 0 and said["microbatch"].endswith("-rows")
    assert {run.data.params[f"resolved.{k}"] for k in said} and all(
        run.data.params[f"resolved.{k}"] == v for k, v in said.items())
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [h.step for h in history] == list(range(1, 13))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "ds_config.json", "data", "metrics.jsonl"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "data")] == ["data/manifest.json"]


def test_sigkill_and_resume_reproduces_uninterrupted_run(sample_shards, tmp_path):
    """With length-aware batching (windows of 20 draws, 512-token microbatches of 2-6 Rfam sequences at context
    128): the checkpoint it resumes from lies inside a window, which the resumed loader draws again and continues.
    Resume in draw order (data.length_window 0): tests/reliability/test_faults.py and the loader tests."""
    import json

    steps = 14
    common = ["train.grad_accum_steps=2", "checkpoint.every_steps=4", "train.log_samples=true",
              "data.context_length=128", "data.length_window=20", "train.max_tokens_per_microbatch=512"]
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    # torchrun: four 2-rank launches, whose launcher is not what this test is about
    ref = run_torchrun(2, "ds_configs/zero2.json", overrides(sample_shards, ref_dir, steps, *common))
    assert ref.returncode == 0, ref.stderr[-3000:]

    # Start the same run, SIGKILL every process of it once it has logged step 10 (last checkpoint: step 8).
    launch_and_kill(torchrun_pretrain(2, "ds_configs/zero2.json", overrides(sample_shards, kill_dir, steps, *common)),
                    kill_dir / "metrics.jsonl", at_step=10)
    latest = (kill_dir / "checkpoints" / "latest").read_text()
    assert latest in ("step00000008", "step00000012")
    loader = json.loads((kill_dir / "checkpoints" / latest / "client_state.json").read_text())["loader"]
    assert any(st["window_batches"] > 0 for rank in loader for st in rank["streams"])  # mid-window

    resumed = run_torchrun(2, "ds_configs/zero2.json", overrides(sample_shards, kill_dir, steps, *common))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    ref_m, got_m = read_jsonl(ref_dir / "metrics.jsonl"), read_jsonl(kill_dir / "metrics.jsonl")
    assert [m["step"] for m in got_m] == list(range(1, steps + 1))
    assert [m["loss"] for m in got_m] == [m["loss"] for m in ref_m]  # bit-identical
    assert [m["grad_norm"] for m in got_m] == [m["grad_norm"] for m in ref_m]
    assert [m["padding_ratio"] for m in got_m] == [m["padding_ratio"] for m in ref_m]
    assert all(m["tokens"] <= m["tokens_computed"] <= 2 * 2 * 512 for m in got_m)  # 2 ranks x 2 microbatches
    for rank in (0, 1):
        ref_s = read_jsonl(ref_dir / f"samples-rank{rank}.jsonl")
        got_s = read_jsonl(kill_dir / f"samples-rank{rank}.jsonl")
        assert got_s == ref_s  # same samples, same steps, same order

    # Running again with more steps continues the same MLflow run.
    more = run_torchrun(2, "ds_configs/zero2.json", overrides(sample_shards, kill_dir, steps + 2, *common))
    assert more.returncode == 0 and "resumed from" in more.stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store(kill_dir))
    runs = mlflow_runs(kill_dir)  # the store beside both run directories also holds the reference run
    assert len(runs) == 1
    assert [h.step for h in client.get_metric_history(runs[0].info.run_id, "loss")][-2:] == [steps + 1, steps + 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
def test_trains_on_cuda_with_nccl(sample_shards, tmp_path):
    """The engine's own collectives (token counts, K_max, statistics, mixture counts) on an NCCL group, which reduces
    only CUDA tensors; bf16 by `train.precision: auto`."""
    run_dir = tmp_path / "run"
    proc = run_pretrain(1, "ds_configs/zero2.json", overrides(sample_shards, run_dir, 4))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
