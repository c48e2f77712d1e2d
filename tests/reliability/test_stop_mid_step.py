"""Case 4: ``train.grad_accum_steps=1000000000`` was accepted, printed nothing, grew memory ~7 MB/s and ignored
SIGTERM for minutes (the stop flag was read only at the end of a step). Now a step that reads more samples than the
training set holds is refused before training (one line naming the key), a long step prints a heartbeat, and a stop
request that waits STOP_GRACE_S for the step to end abandons it between microbatches: the run exits within seconds
with one line naming the step and the last complete checkpoint, and no half-step is saved."""
import os
import signal
import time

import pytest

from conftest import TINY, deepspeed_cmd, run_single, running_until

pytestmark = pytest.mark.slow  # DeepSpeed training launches


def test_a_step_larger_than_the_training_set_is_refused_at_once(sample_shards, tmp_path):
    t0 = time.monotonic()
    r = run_single("ds_configs/zero2.json", TINY + [f"data.train_shards={sample_shards}", f"run_dir={tmp_path / 'run'}",
                                                   "train.grad_accum_steps=1000000000"], timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert ("error: train.grad_accum_steps: one step reads at least 4,000,000,000 samples (grad_accum_steps "
            "1,000,000,000 x 4 a microbatch x 1 ranks) but the training set holds 2,107; lower "
            "train.grad_accum_steps or train.micro_batch_size") in r.stderr
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_sigterm_inside_a_long_step_stops_within_seconds(sample_shards, tmp_path):
    run_dir = tmp_path / "run"
    cmd = deepspeed_cmd(1, "ds_configs/zero2.json", TINY + [
        f"data.train_shards={sample_shards}", f"run_dir={run_dir}", "train.max_steps=2",
        "train.micro_batch_size=1", "train.grad_accum_steps=2000", "train.heartbeat_seconds=1"])
    # ready: the heartbeat of step 1 while its microbatches are computed
    with running_until(cmd, r"step 1: microbatch .* computed, ") as (proc, lines, reader):
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler's preemption sends to the job
        reader.join(60)  # the output ends when the last process of the launch (the rank) has exited
        took = time.monotonic() - sent
    out = "".join(lines)
    assert took < 10, (took, out[-3000:])
    print(f"stopped {took:.1f} s after SIGTERM")
    stop = [ln for ln in lines if "stopping during step 1 (microbatch " in ln]
    assert len(stop) == 1, out[-3000:]
    assert stop[0].rstrip().endswith("): SIGTERM; the step is not saved, the last complete checkpoint is none; the "
                                     "same command resumes from it"), stop[0]
    assert not list((run_dir / "checkpoints").glob("step*")) if (run_dir / "checkpoints").exists() else True
    assert "Traceback" not in out, out[-3000:]
