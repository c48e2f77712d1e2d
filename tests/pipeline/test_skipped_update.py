"""A skipped update (no supervised token in the whole step) still advances the learning-rate schedule."""
import json
import subprocess
import sys

from conftest import REPO, launch_env


def test_skipped_update_keeps_the_schedule(sample_shards):
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "pipeline" / "skip_step_worker.py"),
                           str(sample_shards)], cwd=REPO, env=launch_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["skipped"] == [1, 0, 0]
    # Without the fix the schedule lags one step behind the step counter after the skip: lrs = [w0, w0, w1].
    assert out["lrs"] == out["want"] and out["last_epoch"] == 3
