"""Issue 49 item 7: saves that do not stall the step (checkpoint.background, pipeline/checkpoint/background.py).

A kill at any moment of a background save leaves either the previous checkpoint as ``latest`` or the new one whole:
the writer of a real checkpoint (the short run's step 4, after its step 2) is killed at every one of its fault points
in turn (each write into a file, each file's end, the ranks' agreement, client_state.json, config.yaml, SHA256SUMS,
COMPLETE, latest, rotation), in a forked process that SIGKILLs itself there; after each kill the run directory is
checked with the resume rules themselves. Then real trainings: background and synchronous saves give the same
losses bit for bit and checkpoints holding the same records; a training killed during a background save resumes to
the uninterrupted run's losses; the process's end waits for the save in flight."""
from __future__ import annotations

import os
import shutil
import signal
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import TINY, losses, pretrain_cmd, run_launch

from pipeline.checkpoint.background import FAULT_ENV, BackgroundWriter, SaveJob
from pipeline.checkpoint.io import Checkpointer, _describe_save_error
from pipeline.checkpoint.layout import (COMPLETE, LATEST, damaged_files, is_complete, read_latest, resume_tag)
from pipeline.checkpoint.read import weights_only_loads
from pipeline.config import load_config

PREVIOUS, NEW = "step00000002", "step00000004"


def records(path: Path) -> dict:
    """A torch file's zip records by name without torch's archive prefix (a file is named after itself when written
    to a path, 'archive' when written to a stream), each with its bytes."""
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


def files(tag_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(tag_dir.iterdir())}


def writer_job(source: Path, run: Path, keep_last: int) -> SaveJob:
    """The background save of step 4 into ``run`` as Checkpointer.save hands it to the writer: the DeepSpeed files
    of ``source``'s step 4 (a real checkpoint) as host state dicts, and rank 0's finish (the real
    Checkpointer._complete: client_state.json, config.yaml, SHA256SUMS, COMPLETE, latest, rotation) with that
    checkpoint's own texts."""
    src, dst = source / "checkpoints" / NEW, run / "checkpoints" / NEW
    with weights_only_loads():
        states = [(str(dst / p.name), torch.load(p, map_location="cpu")) for p in sorted(src.glob("*.pt"))]
    cfg = load_config(src / "config.yaml", [f"checkpoint.keep_last={keep_last}"])
    ck = Checkpointer.__new__(Checkpointer)  # the finish needs the run's place and config only
    ck.cfg, ck.ckpt_dir, ck.universal_dir, ck.rank = cfg, run / "checkpoints", None, 0
    client, config = (src / "client_state.json").read_text(), (src / "config.yaml").read_text()
    return SaveJob(dst, states, True, 0.0, lambda digests, fault: ck._complete(dst, client, config, False, digests,
                                                                             fault))


def before_the_save(run: Path) -> None:
    """The run as the writer finds it: step 2 complete and latest, step 4 made by DeepSpeed's directories only."""
    shutil.rmtree(run / "checkpoints" / NEW)
    (run / "checkpoints" / NEW).mkdir()
    (run / "checkpoints" / LATEST).write_text(PREVIOUS)


def write_in_child(job: SaveJob, kill_at: int | None) -> int:
    """Run the writer in a forked child that SIGKILLs itself at fault point ``kill_at``; the child's wait status."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no return
        try:
            if kill_at is not None:
                os.environ[FAULT_ENV] = f"1:{kill_at}"
            w = BackgroundWriter(0, None, _describe_save_error)
            w.start(job)
            outcome = w.join()
            os._exit(0 if outcome == ("ok", NEW) else 3)
        except BaseException:  # noqa: BLE001
            os._exit(4)
    return os.waitpid(pid, 0)[1]


def test_a_kill_at_any_point_of_a_background_save_leaves_the_previous_checkpoint_or_the_new_one_whole(short_run,
                                                                                                    tmp_path):
    run = short_run  # 4 steps, checkpoints at 2 and 4 (conftest), written in the background
    reference = {t: files(run / "checkpoints" / t) for t in (PREVIOUS, NEW)}
    pristine = run.parent / f"{run.name}-pristine"  # save_points' copy of the run before its save

    # the writer, not killed: every point it passes, and the checkpoint it completes
    points = save_points(run)
    written = files(run / "checkpoints" / NEW)
    assert read_latest(run / "checkpoints") == NEW and not (run / "checkpoints" / PREVIOUS).exists()  # rotated
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        assert records(run / "checkpoints" / NEW / name) == records(pristine / "checkpoints" / NEW / name)
    same = ("client_state.json", "config.yaml", "SHA256SUMS")  # SHA256SUMS too: the records are the same bytes
    assert {k: written[k] for k in same} == {k: reference[NEW][k] for k in same}
    assert not damaged_files(run / "checkpoints" / NEW)
    assert len(points) >= 20 and points[-3:] == [COMPLETE, LATEST, "rotation"], points

    outcomes = {}
    for k in range(1, len(points) + 1):
        shutil.rmtree(run)
        shutil.copytree(pristine, run)
        before_the_save(run)
        status = write_in_child(writer_job(pristine, run, keep_last=1), k)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (k, points[k - 1], status)
        ckpts = run / "checkpoints"
        latest = read_latest(ckpts)
        tag, note = resume_tag(ckpts, check_files=True)  # what a resume would take
        assert tag == latest and note is None, (k, points[k - 1], latest, tag, note)
        if latest == NEW:  # the new one whole: every file as the uninterrupted writer wrote it
            assert files(ckpts / NEW) == {**written, COMPLETE: (ckpts / NEW / COMPLETE).read_bytes()}, points[k - 1]
            assert not damaged_files(ckpts / NEW)
        else:  # the previous one, untouched; the new one never taken for complete
            assert latest == PREVIOUS, (k, points[k - 1], latest)
            assert files(ckpts / PREVIOUS) == reference[PREVIOUS]
            assert not damaged_files(ckpts / PREVIOUS)
            assert not is_complete(ckpts / NEW) or points[k - 1] == COMPLETE, (k, points[k - 1])
        outcomes[points[k - 1]] = latest
    # the kills before COMPLETE's write keep the previous checkpoint, those after latest's write the new one
    assert [outcomes[p] for p in points[:points.index(COMPLETE)]] == [PREVIOUS] * points.index(COMPLETE)
    assert outcomes[LATEST] == outcomes["rotation"] == NEW


def test_a_state_that_went_bad_is_never_written(short_run):
    """A NaN in the host copy (a weight that went bad with a finite loss and gradient norm): the writer finds it
    before writing anything, the save fails with one line naming the file and the tensor, latest stays."""
    pristine = short_run.parent / "pristine"
    shutil.copytree(short_run, pristine)
    before_the_save(short_run)
    job = writer_job(pristine, short_run, keep_last=1)
    next(iter(job.files[0][1]["module"].values())).view(-1)[3] = float("nan")
    w = BackgroundWriter(0, None, _describe_save_error)
    w.start(job)
    status, line = w.join()
    assert status == "failed" and line.startswith(f"{NEW}: mp_rank_00_model_states.pt module['") and line.endswith(
        f"holds non-finite values though the step's loss and gradient norm were finite; {NEW} is not written"), line
    assert list((short_run / "checkpoints" / NEW).iterdir()) == [] and read_latest(short_run / "checkpoints") == PREVIOUS


def save_points(run: Path) -> list[str]:
    """The fault points of a background save of ``run``'s step 4 (a copy of the short run), in order."""
    pristine = run.parent / f"{run.name}-pristine"
    shutil.copytree(run, pristine)
    before_the_save(run)
    job = writer_job(pristine, run, keep_last=1)
    w = BackgroundWriter(0, None, _describe_save_error)
    w.start(job)
    assert w.join() == ("ok", NEW)
    return list(w.points)


def train(shards, run_dir, *extra):
    return run_launch(pretrain_cmd("ds_configs/zero2.json", [
        *TINY, f"data.train_shards={shards}", f"run_dir={run_dir}", "train.max_steps=6", "checkpoint.every_steps=2",
        "checkpoint.keep_last=2", "tracking.enabled=false", *extra]), 300)


@pytest.mark.slow  # six DeepSpeed training launches
def test_background_saves_train_as_synchronous_ones_and_a_kill_mid_save_resumes_to_the_same_losses(
        sample_shards, short_run, tmp_path, monkeypatch):
    # the same run_dir path for both (the first moved away): their checkpoints' client state is the same too
    run = tmp_path / "run"
    r = train(sample_shards, run, "checkpoint.background=false")
    assert r.returncode == 0, r.stderr[-3000:]
    run.rename(tmp_path / "sync")
    r = train(sample_shards, run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(run) == losses(tmp_path / "sync")  # bit for bit
    for tag in ("step00000004", "step00000006"):  # the same records: only torch's archive name differs
        for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            assert records(run / "checkpoints" / tag / f) == records(tmp_path / "sync" / "checkpoints" / tag / f)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("checkpoint step")]
    assert [ln.split(":")[0] for ln in lines] == ["checkpoint step00000002", "checkpoint step00000004",
                                                  "checkpoint step00000006"]
    assert all("the step waited" in ln and "in the background in" in ln for ln in lines), lines
    uninterrupted = losses(run)

    # killed during its second background save (step 4): at its first write, and right after COMPLETE (before
    # latest); the numbers of those points are the short run's (the same model, so the same writes)
    points = save_points(short_run)
    for point in (1, points.index(COMPLETE) + 1):
        killed = tmp_path / f"killed-{point}"
        monkeypatch.setenv(FAULT_ENV, f"2:{point}")
        r = train(sample_shards, killed)
        monkeypatch.delenv(FAULT_ENV)
        assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr[-2000:])
        assert read_latest(killed / "checkpoints") == PREVIOUS, point
        assert is_complete(killed / "checkpoints" / NEW) == (point > 1)
        r = train(sample_shards, killed)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"resumed from {killed / 'checkpoints' / PREVIOUS} at step 2" in r.stdout
        assert losses(killed) == uninterrupted, point
        assert read_latest(killed / "checkpoints") == "step00000006"
