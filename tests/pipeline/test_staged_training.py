"""Staged training (paper 000, A.3: Stage B continues from Stage A's checkpoint): --init-from starts a new run from
another run's checkpoint or export; --resume only ever continues the same run."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY, launch_and_kill, mlflow_runs, read_jsonl, run_torchrun, torchrun_pretrain
from pipeline.config import ConfigError, dump_yaml, load_config
from pipeline.train import RunPlan, lr_lambda


def overrides(shards, run_dir, steps, *more):
    return [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", *TINY, *more]


def tree_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_stage_b_starts_from_stage_a(sample_shards, tmp_path):
    a_dir = tmp_path / "stage_a"
    a = run_torchrun(2, "ds_configs/zero2.json", overrides(
        sample_shards, a_dir, 3, "optim.lr=3e-3", "checkpoint.every_steps=2", "checkpoint.at_steps=[1]",
        "checkpoint.keep_last=1"))
    assert a.returncode == 0, a.stderr[-3000:]
    # keep_last=1 rotated step 2 away; the milestone (at_steps) and the last checkpoint stay.
    assert sorted(p.name for p in (a_dir / "checkpoints").glob("step*")) == ["step00000001", "step00000003"]
    a_ckpt = a_dir / "checkpoints" / "step00000003"
    a_digest = tree_digest(a_dir / "checkpoints")
    (a_run,) = mlflow_runs(a_dir)

    # Stage B: its own lr, warmup and schedule length (schedule_steps fixes the cosine whatever max_steps is).
    b_opts = ["optim.lr=2e-3", "optim.warmup_steps=3", "optim.schedule_steps=6", "checkpoint.every_steps=2"]
    b_ref_dir, b_kill_dir = tmp_path / "b_ref", tmp_path / "b_killed"
    b_ref = run_torchrun(2, "ds_configs/zero2.json", overrides(sample_shards, b_ref_dir, 6, *b_opts),
                         ["--init-from", str(a_ckpt)])
    assert b_ref.returncode == 0, b_ref.stderr[-3000:]
    assert f"initialized from {a_ckpt}" in b_ref.stdout
    ref = read_jsonl(b_ref_dir / "metrics.jsonl")
    cfg_b = load_config(None, overrides(sample_shards, b_ref_dir, 6, *b_opts))
    assert [m["step"] for m in ref] == list(range(1, 7))
    assert [m["lr"] for m in ref] == pytest.approx([2e-3 * lr_lambda(cfg_b)(s) for s in range(6)], rel=1e-12)
    # The weights are Stage A's: a fresh model (Stage A's step 1, same data and seed) scores differently.
    assert ref[0]["loss"] != read_jsonl(a_dir / "metrics.jsonl")[0]["loss"]

    (b_run,) = mlflow_runs(b_ref_dir)
    assert b_run.info.run_id != a_run.info.run_id
    assert b_run.data.tags["parent_run_id"] == a_run.info.run_id
    assert b_run.data.tags["parent_checkpoint"] == str(a_ckpt.resolve())
    assert b_run.data.tags["parent_step"] == "3"
    assert sorted(p.name for p in (b_ref_dir / "checkpoints").glob("step*"))[-1] == "step00000006"

    # Stage B killed between checkpoints and resumed: its own checkpoint wins over init_from, bit-exact losses.
    cmd = torchrun_pretrain(2, "ds_configs/zero2.json", overrides(sample_shards, b_kill_dir, 6, *b_opts),
                            ["--init-from", str(a_ckpt)])
    launch_and_kill(cmd, b_kill_dir / "metrics.jsonl", at_step=5)
    resumed = run_torchrun(2, "ds_configs/zero2.json", overrides(sample_shards, b_kill_dir, 6, *b_opts),
                           ["--init-from", str(a_ckpt)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "initialized from" not in resumed.stdout
    got = read_jsonl(b_kill_dir / "metrics.jsonl")
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref]
    assert len(mlflow_runs(b_kill_dir)) == 1

    # With the optimizer moments: the same first loss (same weights, same batch), this run's lr, another update.
    b_opt_dir = tmp_path / "b_opt"
    b_opt = run_torchrun(2, "ds_configs/zero2.json", overrides(sample_shards, b_opt_dir, 2, *b_opts,
                                                               "train.init_from_optimizer=true"),
                         ["--init-from", str(a_ckpt)])
    assert b_opt.returncode == 0, b_opt.stderr[-3000:]
    opt = read_jsonl(b_opt_dir / "metrics.jsonl")
    assert opt[0]["loss"] == ref[0]["loss"]
    assert [m["lr"] for m in opt] == [m["lr"] for m in ref[:2]]  # not Stage A's restored lr
    assert opt[1]["loss"] != ref[1]["loss"]  # Adam's moments from Stage A changed the first update

    # From an export (tools/convert_checkpoint.py): the same fp32 weights, so the same run as from the checkpoint.
    export = tmp_path / "export_a"
    conv = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "--checkpoint", str(a_ckpt),
                           "--output", str(export), "--trust-checkpoint"], cwd=REPO, capture_output=True, text=True)
    assert conv.returncode == 0, conv.stderr[-3000:]
    b_exp_dir = tmp_path / "b_export"
    b_exp = run_torchrun(2, "ds_configs/zero2.json", overrides(sample_shards, b_exp_dir, 2, *b_opts),
                         ["--init-from", str(export)])
    assert b_exp.returncode == 0, b_exp.stderr[-3000:]
    assert [m["loss"] for m in read_jsonl(b_exp_dir / "metrics.jsonl")] == [m["loss"] for m in ref[:2]]
    (exp_run,) = mlflow_runs(b_exp_dir)
    assert exp_run.data.tags["parent_run_id"] == a_run.info.run_id  # carried by export.json

    assert tree_digest(a_dir / "checkpoints") == a_digest  # Stage A untouched by every Stage-B run
    assert len(mlflow_runs(a_dir)) == 1


# ---- errors before anything starts (no DeepSpeed launch) ------------------------------------------------------------
def fake_checkpoint(tag_dir: Path, cfg, world_size=1, export=False) -> Path:
    """The files a checkpoint is recognized and checked by (config.yaml, client_state.json or model.safetensors)."""
    tag_dir.mkdir(parents=True)
    (tag_dir / "config.yaml").write_text(dump_yaml(cfg))
    if export:
        (tag_dir / "model.safetensors").write_bytes(b"")
    else:
        (tag_dir / "client_state.json").write_text(json.dumps({"world_size": world_size, "zero_stage": 2}))
    return tag_dir


def test_resume_refuses_another_runs_checkpoint(sample_shards, tmp_path):
    cfg = load_config(None, overrides(sample_shards, tmp_path / "b", 3))
    other = fake_checkpoint(tmp_path / "a" / "checkpoints" / "step00000003", cfg)
    with pytest.raises(ConfigError, match=r"not a checkpoint of this run .* --init-from starts a new run"):
        RunPlan(cfg, str(REPO / "ds_configs" / "zero2.json"), resume=str(other))
    with pytest.raises(ConfigError, match=r"--resume .*: not a checkpoint directory"):
        RunPlan(cfg, str(REPO / "ds_configs" / "zero2.json"), resume=str(tmp_path / "nowhere"))


def test_init_from_errors_name_the_key(sample_shards, tmp_path):
    base = overrides(sample_shards, tmp_path / "b", 3)
    ds = str(REPO / "ds_configs" / "zero2.json")
    src = fake_checkpoint(tmp_path / "a" / "step00000003", load_config(None, base), world_size=2)
    export = fake_checkpoint(tmp_path / "export", load_config(None, base), export=True)

    with pytest.raises(ConfigError, match=r"^train.init_from: .*nowhere: not a checkpoint"):
        RunPlan(load_config(None, base + [f"train.init_from={tmp_path / 'nowhere'}"]), ds)
    with pytest.raises(ConfigError, match=r"^model.d_ff: 96 differs from 128 of checkpoint"):
        RunPlan(load_config(None, base + [f"train.init_from={src}", "model.d_ff=96"]), ds)
    with pytest.raises(ConfigError, match=r"^train.init_from_optimizer: .* is an export"):
        RunPlan(load_config(None, base + [f"train.init_from={export}", "train.init_from_optimizer=true"]), ds)
    with pytest.raises(ConfigError, match=r"^train.init_from_optimizer: .* written by 2 ranks, this run has 1"):
        RunPlan(load_config(None, base + [f"train.init_from={src}", "train.init_from_optimizer=true"]), ds)
    # Weights alone load from any world size: no error.
    assert RunPlan(load_config(None, base + [f"train.init_from={src}"]), ds).init_source == src
