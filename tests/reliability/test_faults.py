"""Faults a weeks-long run meets, injected into real DeepSpeed launches on CPU: divergence, preemption (SIGTERM to
the launcher, a deadline), an error on one rank, a second training on the same run_dir, damaged checkpoints, a
rollback, a full disk."""
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, TINY, deepspeed_cmd, launch_env, read_jsonl, run_pretrain, run_single
from pipeline.commands import shown
from pipeline.tracking.store import default_store

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def overrides(shards, run_dir, steps, *more):
    return [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", *TINY, *more]


def mlflow_status(run_dir: Path) -> list[str]:
    """The statuses of the runs in the store beside ``run_dir`` (each test here has one run directory)."""
    with sqlite3.connect(default_store(run_dir)) as db:
        return [row[0] for row in db.execute("select status from runs")]


def files_digest(tag_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(tag_dir.iterdir())}


def test_divergence_stops_nonzero_and_keeps_the_last_good_checkpoint(sample_shards, short_run):
    run_dir = short_run  # 4 good steps, checkpoints at steps 2 and 4 (conftest)
    kept = files_digest(run_dir / "checkpoints" / "step00000004")

    # The same run continued at a learning rate that blows the weights up: the gradient norm is inf from then on and
    # DeepSpeed skips every update. Which step overflows first depends on the kernels (the fused RMSNorm's backward
    # works on the normalized input and overflows later than the plain formula's, which multiplies raw values), so
    # the steps are read from the run.
    bad = run_single("ds_configs/zero2.json", overrides(
        sample_shards, run_dir, 40, "checkpoint.every_steps=2", "optim.lr=1.0e4", "train.max_nonfinite_steps=3"),
        ["--allow-config-change"])  # a resume with another optim.lr
    out = bad.stdout + bad.stderr
    assert bad.returncode == 3, out[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    flagged = [m["step"] for m in metrics if m["nonfinite"]]
    assert len(flagged) == 3 and flagged == list(range(flagged[0], flagged[0] + 3)) and flagged[0] > 4, flagged
    first = flagged[0]
    last_good = f"step{(first - 1) // 2 * 2:08d}"  # the last even step before the streak
    assert "training diverged: 3 consecutive non-finite steps" in out and last_good in out
    assert f"warning: step {first}: non-finite" in out  # each one named as it happens
    assert all(m["skipped"] for m in metrics if m["nonfinite"])
    assert metrics[-1]["total/nonfinite"] == 3 and metrics[-1]["total/skipped"] >= 3
    # No checkpoint of the dead model: latest is the last good one, and the earlier ones are untouched.
    assert (run_dir / "checkpoints" / "latest").read_text() == last_good
    assert all(int(p.name[4:]) < first for p in (run_dir / "checkpoints").glob("step*"))
    if (run_dir / "checkpoints" / "step00000004").is_dir():
        assert files_digest(run_dir / "checkpoints" / "step00000004") == kept
    assert mlflow_status(run_dir) == ["FAILED"]


def wait_for_step(metrics: Path, step: int, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.is_file() and any(m["step"] >= step for m in read_jsonl(metrics)):
            return
        assert proc.poll() is None, "training ended early"
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout} s")


def wait_group_gone(pgid: int, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError("ranks still running after the launcher's SIGTERM")


def test_sigterm_to_the_launcher_checkpoints_and_exits_0_on_every_rank(sample_shards, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    cmd = deepspeed_cmd(2, "ds_configs/zero2.json", overrides(sample_shards, run_dir, 100000, "checkpoint.every_steps=1000"))
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for_step(run_dir / "metrics.jsonl", 3, proc)
        # A second training on the same run_dir is refused, naming the holder, and leaves the first alone.
        second = run_single("ds_configs/zero2.json", overrides(sample_shards, run_dir, 5))
        assert second.returncode == 2
        assert "in use by another training (host" in second.stderr and "pid" in second.stderr
        proc.send_signal(signal.SIGTERM)  # what a scheduler sends: the runner dies, launch.py and the ranks stay
        assert proc.wait(timeout=30) == -signal.SIGTERM
        wait_group_gone(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
    tag = f"step{last:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text() == tag, text[-3000:]
    assert (run_dir / "checkpoints" / tag / "COMPLETE").is_file()
    # Rank 0 names the launcher's exit, or (when rank 1's watch saw it first) the stop request of another rank.
    assert f"stopping at step {last}: " in text and ("the launcher (pid" in text or "another rank" in text)
    assert text.count("exits successfully") == 2, text[-3000:]  # launch.py: both ranks exited 0
    assert mlflow_status(run_dir) == ["KILLED"]
    train_log = (run_dir / "train.log").read_text()
    assert "[rank 0] step 3/100000" in train_log and "[rank 1] " in train_log


def test_max_hours_deadline_checkpoints_and_exits_0(sample_shards, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    proc = run_single("ds_configs/zero2.json", overrides(sample_shards, run_dir, 100000, "train.max_hours=0.0004"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step{last:08d}"
    assert "train.max_hours (0.0004 h) reached" in proc.stdout
    monkeypatch.chdir(REPO)  # the launch's directory: the summary shows the interpreter as seen from there
    assert "==== run" in proc.stdout and f"export: {shown(sys.executable)} tools/convert_checkpoint.py" in proc.stdout


def test_an_error_on_rank_1_is_printed_with_its_rank_and_last(sample_shards, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(sample_shards, shards)
    names = [s["path"] for s in json.loads((shards / "manifest.json").read_text())["shards"]]
    # The shards rank 1 of 2 reads first (pipeline/data/streams.py: SourceStream.stream_shards, seed 1234, epoch 0).
    rank1 = [names[i] for i in np.random.default_rng([1234, 0]).permutation(len(names))[1::2]]
    for name in rank1:
        path = shards / name
        data = path.read_bytes()
        # truncated, as by a full disk or a killed copy, yet longer than the manifest's counts (a shorter file is
        # refused at start: its sample and token counts cannot fit, pipeline/data/shards.py)
        path.write_bytes(data[:len(data) * 3 // 4])
    proc = run_pretrain(2, "ds_configs/zero2.json", overrides(shards, tmp_path / "run", 5, "data.verify=false"))
    assert proc.returncode != 0
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "error:" in ln]
    assert any(ln.startswith("[rank 1] error:") and any(n in ln for n in rank1) for ln in errors), errors
    assert any(n in errors[-1] for n in rank1) and "rank 1" in errors[-1], errors  # the cause, not the peer's fallout


def test_damaged_checkpoints_resume_from_the_newest_complete_and_rollback_keeps_latest(sample_shards, short_run):
    run_dir = short_run  # train(4, "checkpoint.keep_last=0") done (conftest): checkpoints at steps 2 and 4
    ckpts = run_dir / "checkpoints"

    def train(steps, *more, extra=()):
        return run_single("ds_configs/zero2.json",
                          overrides(sample_shards, run_dir, steps, "checkpoint.every_steps=2", *more), extra)

    lr4 = read_jsonl(run_dir / "metrics.jsonl")[-1]["lr"]

    # A truncated client_state.json (a kill mid-save before markers existed): resume from step 2, saying so.
    state = ckpts / "step00000004" / "client_state.json"
    state.write_text(state.read_text()[:50])
    resumed = train(6, "checkpoint.keep_last=0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from the newest complete checkpoint step00000002" in resumed.stdout
    assert "resumed from" in resumed.stdout and "step00000002 at step 2" in resumed.stdout
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]  # steps 3-4 of the first attempt were replaced
    # Extending max_steps from 4 to 6 keeps the first horizon: steps 5-6 run at the floor, no jump back up.
    assert metrics[4]["lr"] == metrics[5]["lr"] <= lr4

    # latest missing: the newest complete checkpoint (step 6).
    (ckpts / "latest").unlink()
    again = train(7, "checkpoint.keep_last=0")
    assert again.returncode == 0 and "step00000006 at step 6" in again.stdout, again.stderr[-3000:]

    # A resume that would change the data order is refused before DeepSpeed starts.
    changed = train(8, "seed=7")
    assert changed.returncode == 2 and "(seed: 1234 -> 7)" in changed.stderr, changed.stderr[-2000:]

    # Rollback to step 2 with rotation: later checkpoints are set aside, the new timeline rotates; latest valid.
    back = train(8, "checkpoint.keep_last=2", extra=["--resume", str(ckpts / "step00000002")])
    assert back.returncode == 0, back.stderr[-3000:]
    assert (ckpts / "latest").read_text() == "step00000008"
    assert (ckpts / "step00000008" / "COMPLETE").is_file() and (ckpts / "step00000006" / "COMPLETE").is_file()
    assert json.loads((ckpts / "step00000006" / "client_state.json").read_text())["step"] == 6
    assert not (ckpts / "step00000002").exists() and not (ckpts / "step00000004").exists()
    # Set aside, kept out of the way: the truncated step 4 at the first fallback, then the abandoned timeline.
    truncated, abandoned = sorted(ckpts.glob("abandoned_after_step00000002_*"))
    assert [p.name for p in truncated.iterdir()] == ["step00000004"]
    assert sorted(p.name for p in abandoned.iterdir()) == ["step00000004", "step00000006", "step00000007"]


def test_a_full_disk_names_itself_and_leaves_latest(sample_shards, tmp_path):
    run_dir = tmp_path / "run"
    env = launch_env()
    proc = subprocess.run([sys.executable, str(HERE / "disk_full_worker.py"), "--ds_config",
                           str(REPO / "ds_configs/zero2.json"),
                           # the synchronous save, whose DeepSpeed engine the worker breaks (a background save's full
                           # disk: test_filesystems.py::test_a_full_disk_under_a_training_is_one_line)
                           *sum((["--set", o] for o in overrides(sample_shards, run_dir, 6, "checkpoint.every_steps=2",
                                                                 "checkpoint.background=false")), [])],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last_error = [ln for ln in proc.stderr.splitlines() if "error:" in ln][-1]
    assert "disk full writing checkpoint" in last_error and "step00000004" in last_error
    assert "latest still names step00000002" in last_error
    assert (run_dir / "checkpoints" / "latest").read_text() == "step00000002"
    assert mlflow_status(run_dir) == ["FAILED"]


def test_the_launch_script_picks_a_free_port_when_the_default_is_taken(sample_shards, tmp_path):
    import socket

    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", 29500))  # DeepSpeed's default master port, as another job would hold it
        except OSError:
            pass  # already held by something else: the condition under test
        held.listen()
        env = {k: v for k, v in launch_env().items() if k != "MASTER_PORT"}
        proc = subprocess.run(["bash", "scripts/launch.sh", "launchers/pretrain.py", "--ds_config",
                               "ds_configs/zero2.json", *sum((["--set", o] for o in overrides(
                                   sample_shards, tmp_path / "run", 2, "tracking.enabled=false")), [])],
                              cwd=REPO, env={**env, "NPROC": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step00000002"
