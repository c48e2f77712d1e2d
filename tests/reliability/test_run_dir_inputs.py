"""A run_dir that is an existing file (or under one) is one line and exit 2 before anything starts, and the file is
left as it was (it was a FileExistsError traceback)."""
import subprocess
import sys

import pytest

from conftest import REPO, run_pretrain


@pytest.mark.parametrize("below", [False, True])
def test_dry_run_refuses_a_file_where_the_run_dir_belongs(tmp_path, below):
    f = tmp_path / "notes.txt"
    f.write_text("keep")
    run_dir = f / "run" if below else f
    r = subprocess.run([sys.executable, "launchers/pretrain.py", "--ds_config", "ds_configs/zero2.json", "--set",
                        f"run_dir={run_dir}", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [f"error: run_dir: {f} exists and is not a directory; choose another "
                                             "run_dir"]
    assert f.read_text() == "keep"


def test_a_training_launch_refuses_it_too(tmp_path, sample_shards):
    f = tmp_path / "run"
    f.write_text("keep")
    r = run_pretrain(1, "ds_configs/zero2.json", [f"run_dir={f}", f"data.train_shards={sample_shards}",
                                                   "train.max_steps=1"], timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"error: run_dir: {f} exists and is not a directory" in r.stderr
    assert f.read_text() == "keep"
