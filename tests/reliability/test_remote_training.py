"""Training from a shard set on a real S3 server on loopback (tests/conftest.py), written there by
``data_prep rnacentral --output s3://...``: the losses of the same training on the local output, bit for bit, with
503s on the way; a run killed mid-epoch continues on 1 rank as the same run continued from the local data, bit for
bit; a store that goes away
for good stops the run after a checkpoint, in one line naming the URL."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import (REPO, SAMPLE_FASTA, TINY, S3Server, forget_s3_clients, launch_and_kill, losses, pretrain_cmd,
                      read_jsonl, run_launch, run_torchrun, running_until, torchrun_pretrain)

pytestmark = pytest.mark.slow  # DeepSpeed training launches

STEPS = 8
RUN = TINY + [f"train.max_steps={STEPS}", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
              "tracking.enabled=false", "data.fetch_backoff_s=0.05"]


def prep(output, env=None, *extra):
    r = subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                        str(output), "--shard-size", "150", "--progress", "off", *extra], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def sets(s3_server, tmp_path_factory):
    """(the local output, its twin written to the bucket by data_prep --output s3://, the local run's losses)."""
    local = tmp_path_factory.mktemp("remote_train") / "rfam"
    prep(local)
    s3_server.bucket("train-sets")
    url = "s3://train-sets/rfam"
    prep(url, s3_server.env)
    run = local.parent / "run_local"
    r = run_torchrun(2, "ds_configs/zero2.json", RUN + [f"data.train_shards={local}", f"run_dir={run}"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return local, url, losses(run)


def test_two_ranks_from_s3_equal_the_local_run_and_resume_on_one_rank(s3, sets, tmp_path):
    server, _ = s3
    local, url, want = sets
    sizes = sorted(p.stat().st_size for p in local.glob("*.tar"))
    cache = [f"data.cache_bytes={3 * sizes[-1]}", f"data.cache_dir={tmp_path / 'cache'}"]
    server.faults.fail(3, 503, match="/rfam/rnacentral-")  # the first shard requests throttled: retried
    run = tmp_path / "s3"
    r = run_torchrun(2, "ds_configs/zero2.json", RUN + cache + [f"data.train_shards={url}", f"run_dir={run}"],
                     timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(run) == want  # bit for bit
    steps = read_jsonl(run / "metrics.jsonl")
    assert sum(m["fetch/retries"] for m in steps) == 3 and sum(m["fetch/fetches"] for m in steps) >= 10
    assert "data fetched: " in r.stdout and "3 retries" in r.stdout

    # killed mid-epoch (an epoch is 131 steps) after step 5, continued on 1 rank from the checkpoint of step 4 (the
    # schedule's horizon is the reference's: the killed run only has room to be killed in)
    killed = tmp_path / "killed"
    cmd = torchrun_pretrain(2, "ds_configs/zero2.json", RUN + cache + [f"data.train_shards={url}",
                                                                       f"run_dir={killed}", "train.max_steps=200",
                                                                       f"optim.schedule_steps={STEPS}"])
    launch_and_kill(cmd, killed / "metrics.jsonl", 5)
    twin = tmp_path / "killed_local"  # the same killed run, continued on 1 rank from the local copy of the data
    shutil.copytree(killed, twin)
    resume = RUN + ["train.grad_accum_steps=4", f"optim.schedule_steps={STEPS}"]
    r = run_launch(pretrain_cmd("ds_configs/zero2.json", resume + cache + [f"data.train_shards={url}",
                                                                          f"run_dir={killed}"]), 300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_launch(pretrain_cmd("ds_configs/zero2.json", resume + [f"data.train_shards={local}", f"run_dir={twin}"],
                                ["--allow-config-change"]), 300)  # the data's path changed, not its manifest
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(killed)
    assert [got[s] for s in range(1, 5)] == [want[s] for s in range(1, 5)]  # before the kill: bit for bit
    # on 1 rank the gradient is reduced in another order than on 2: fp32 round-off against the uninterrupted run
    # (tests/pipeline/test_resume_reshard.py), and bit for bit against the same resume from the local data
    assert all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in range(5, STEPS + 1)), [(got[s], want[s]) for s in range(5, STEPS + 1)]
    assert got == losses(twin)


def test_a_store_gone_for_good_stops_after_a_checkpoint_in_one_line(sets, tmp_path, monkeypatch):
    """The server stops while the run trains: the loader finishes what it holds, the next shard fails after its
    retries, and the run writes a checkpoint of its last step and exits 2 with one line naming the URL."""
    local, _, _ = sets
    server = S3Server()
    try:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        forget_s3_clients()
        server.bucket("gone-for-good")
        url = "s3://gone-for-good/rfam"
        prep(url, server.env, "--shard-size", "40")  # small shards: the run needs a new one every few steps
        run = tmp_path / "run"
        cmd = pretrain_cmd("ds_configs/zero2.json", RUN + [
            f"data.train_shards={url}", f"run_dir={run}", "train.max_steps=2000", "checkpoint.every_steps=1000",
            "data.mix_shards=1", "data.prefetch_shards=1", "data.fetch_retries=2", f"data.cache_dir={tmp_path / 'c'}"])
        with running_until(cmd, r"step 3/") as (proc, lines, reader):
            server.stop()
            assert proc.wait(240) == 2, "".join(lines[-40:])
            reader.join(30)
    finally:
        server.stop()
        monkeypatch.undo()
        forget_s3_clients()
    out = "".join(lines)
    assert "Traceback" not in out, out[-3000:]
    (line,) = [ln for ln in lines if "error:" in ln]
    step = max(m["step"] for m in read_jsonl(run / "metrics.jsonl"))
    assert f"error: {url}/rnacentral-" in line and ": cannot fetch it after 3 tries: " in line, line
    assert line.rstrip().endswith(f"stopped before step {step + 1}, checkpoint step{step:08d} holds step {step}: the "
                                  "same command resumes from it once the store answers"), line
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step{step:08d}"
