"""Campaign cases: optim.warmup_steps above train.max_steps, and data.val_shards naming the training shards, ran
without a word. The run goes on (exit 0) with one warning line each, in the dry run (here) and in the training's
output (the same RunPlan.warnings, printed by rank 0)."""
import sys

from conftest import REPO, TINY, run_launch


def dry_run(shards, run_dir, *sets):
    cmd = [sys.executable, str(REPO / "launchers/pretrain.py"), "--dry-run", "--ds_config",
           str(REPO / "ds_configs/zero2.json")]
    for o in [f"data.train_shards={shards}", f"run_dir={run_dir}", *TINY, *sets]:
        cmd += ["--set", o]
    return run_launch(cmd, timeout=120)


def test_settings_that_run_but_mislead_are_warned(sample_shards, tmp_path):
    r = dry_run(sample_shards, tmp_path / "run", "optim.warmup_steps=500", "train.max_steps=100",
                f"data.val_shards=[{sample_shards}]", "eval.every=50")
    assert r.returncode == 0, r.stderr
    warned = [ln for ln in r.stdout.splitlines() if ln.startswith("warning: ")]
    assert warned == [
        "warning: optim.warmup_steps (500) exceeds train.max_steps (100): the learning rate never reaches optim.lr",
        f"warning: data.val_shards: {sample_shards} is also data.train_shards: validation would measure training "
        "data, not held-out data"], r.stdout[-2000:]
    quiet = dry_run(sample_shards, tmp_path / "run")
    assert quiet.returncode == 0 and "warning:" not in quiet.stdout
