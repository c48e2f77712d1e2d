"""torchrun starts each rank in a session of its own and does not make it die with the agent: a SIGKILLed torchrun
(the OOM killer, `kill -9`) used to leave both ranks training on, writing to a run directory nobody watched. The
ranks now watch torchrun as they watch DeepSpeed's launcher: they stop after the step, checkpointed, and exit."""
import subprocess
import time

import psutil
import pytest

from conftest import REPO, TINY, kill_group, launch_env, read_jsonl, torchrun_pretrain

pytestmark = pytest.mark.slow


def test_a_sigkilled_torchrun_stops_its_ranks_after_a_checkpoint(sample_shards, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    sets = [f"data.train_shards={sample_shards}", f"run_dir={run_dir}", "train.max_steps=100000",
            "checkpoint.every_steps=1000", *TINY]
    cmd = torchrun_pretrain(2, "ds_configs/zero2.json", sets)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    ranks = []
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.time() + 240
        while not (metrics.is_file() and any(m["step"] >= 3 for m in read_jsonl(metrics))):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2
        proc.kill()  # the agent alone: its ranks are in sessions of their own
        proc.wait()
        _, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, "ranks still training 60 s after torchrun was killed"
    finally:
        for p in ranks:
            try:
                p.kill()
            except psutil.Error:
                pass
        kill_group(proc)
    text = log.read_text()
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]
    tag = f"step{last:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text() == tag, text[-3000:]
    assert (run_dir / "checkpoints" / tag / "COMPLETE").is_file()
    assert f"stopping at step {last}: " in text, text[-3000:]
    assert f"the launcher (pid {proc.pid}) exited" in text or "another rank" in text
