"""A skipped update (no supervised token in the whole step) leaves the weights and the learning-rate schedule alone:
the lr of step s is the schedule at s, whatever was skipped before."""
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
    assert out["changed"] == [False, True, True]
    assert out["lrs"] == out["want"]
