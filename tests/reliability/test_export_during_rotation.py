"""Campaign case: exporting a run while its training saves and rotates checkpoints (checkpoint.keep_last) failed in 3
of 4 tries, calling a complete checkpoint incomplete or not a checkpoint: rotation deleted the one the export had
resolved. Now convert and evaluate hold the run's rotation off while they read (a shared lock rotation must take
exclusively; it rotates at the next save instead), so every export of a rotating run succeeds."""
import re
import subprocess
import sys

import pytest

from conftest import REPO, TINY, pretrain_cmd, running_until

pytestmark = pytest.mark.slow  # DeepSpeed training launches


def test_exports_of_a_rotating_run_all_succeed(sample_shards, tmp_path):
    run_dir = tmp_path / "run"
    cmd = pretrain_cmd("ds_configs/zero2.json", TINY + [
        f"data.train_shards={sample_shards}", f"run_dir={run_dir}", "train.max_steps=5000",
        "checkpoint.every_steps=1", "checkpoint.keep_last=1", "tracking.enabled=false"])
    results = []
    with running_until(cmd, r"step 3/") as (proc, lines, _):
        for i in range(4):  # each while the run writes a checkpoint a step and deletes the one before
            out = tmp_path / f"export{i}"
            results.append(subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--checkpoint",
                                           str(run_dir), "--output", str(out)], cwd=REPO, capture_output=True,
                                          text=True, timeout=300))
        assert proc.poll() is None, "".join(lines[-40:])  # the training ran through every export
    failed = [r.stderr[-1000:] for r in results if r.returncode != 0]
    assert not failed, failed
    steps = [int(re.search(r"step(\d+)", r.stdout)[1]) for r in results]
    assert steps == sorted(steps) and len(set(steps)) > 1, steps  # each export took the run's newest checkpoint
