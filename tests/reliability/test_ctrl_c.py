"""Campaign case: Ctrl-C during a training printed 4 tracebacks, though the checkpoint was intact. Ctrl-C sends SIGINT
to the whole foreground process group: DeepSpeed's runner, its launch.py and every rank. Now each rank takes it as
a stop request (as SIGTERM): the ranks finish the step, write one checkpoint and say so in one line. DeepSpeed's
runner installs no handler for a local launch, so its own KeyboardInterrupt traceback is the one left (its code,
not this project's: docs/checkpoints.md, "Preemption")."""
import os
import re
import signal

import pytest

from conftest import TINY, deepspeed_cmd, running_until
from pipeline.checkpoint.layout import damaged_files

pytestmark = pytest.mark.slow  # DeepSpeed training launches


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_no_traceback_of_ours(sample_shards, tmp_path):
    run_dir = tmp_path / "run"
    cmd = deepspeed_cmd(2, "ds_configs/zero2.json", TINY + [
        f"data.train_shards={sample_shards}", f"run_dir={run_dir}", "train.max_steps=500",
        "checkpoint.every_steps=1000", "tracking.enabled=false"])
    with running_until(cmd, r"(\[rank 0\] )?step 3\b") as (proc, lines, reader):
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends: every process of the launch
        reader.join(90)
        proc.wait(30)
    out = "".join(lines)
    (stop,) = [ln for ln in lines if "stopping at step " in ln]
    step = int(re.search(r"stopping at step (\d+): SIGINT \(Ctrl-C\); checkpoint (step\d+); the same command "
                         r"resumes", stop)[1])
    tag = f"step{step:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text() == tag
    assert not damaged_files(run_dir / "checkpoints" / tag)
    # Every traceback left is DeepSpeed's runner's (its local launch has no SIGINT handler); none of a rank.
    tracebacks = out.split("Traceback (most recent call last):")[1:]
    assert all("deepspeed/launcher/runner.py" in t.split("KeyboardInterrupt")[0] for t in tracebacks), out[-4000:]
    assert "launchers/pretrain.py" not in "".join(t.split("KeyboardInterrupt")[0] for t in tracebacks)
