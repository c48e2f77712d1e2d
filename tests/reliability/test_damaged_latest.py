"""Case 3: a ``latest`` naming a checkpoint whose directory is gone started a fresh run (exit 0) and cut
metrics.jsonl from 6 lines to 3. Case 8: a COMPLETE checkpoint with a truncated mp_rank_00_model_states.pt ended
resume in a 41-line traceback naming neither tag nor file. Now a damaged ``latest`` falls back to the newest intact
checkpoint with a note naming what is wrong (the damaged one is set aside, never deleted), or, when none is left,
refuses with one line and exit 2; the logs are cut only to a checkpoint actually resumed from, and a fresh start
moves earlier logs aside instead of truncating them."""
import shutil

import pytest

from conftest import TINY, copy_trained, read_jsonl, run_single

pytestmark = pytest.mark.slow  # DeepSpeed training launches


def train(shards, run_dir, steps, *extra):
    return run_single("ds_configs/zero2.json", TINY + [
        f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", "checkpoint.every_steps=2",
        "checkpoint.keep_last=0"], list(extra), timeout=300)


@pytest.fixture(scope="module")
def _six_steps(sample_shards, tmp_path_factory):
    """ROOT/base: train(sample_shards, ROOT/base, 6), checkpoints at steps 2, 4 and 6, with its store ROOT/mlflow.db;
    trained once for the two tests below that start from it."""
    root = tmp_path_factory.mktemp("six_steps")
    first = train(sample_shards, root / "base", 6)
    assert first.returncode == 0, first.stderr[-3000:]
    return root


@pytest.fixture
def six_steps(_six_steps, tmp_path):
    """The test's own copy, tmp_path/base (and tmp_path/mlflow.db): free to damage."""
    copy_trained(_six_steps, tmp_path)
    return tmp_path / "base"


def test_a_damaged_latest_never_starts_over(sample_shards, six_steps, tmp_path):
    base = six_steps
    history = (base / "metrics.jsonl").read_bytes()
    assert len(history.splitlines()) == 6

    # Every step directory gone, latest left: refused, the history untouched.
    gone = tmp_path / "gone"
    shutil.copytree(base, gone)
    for d in (gone / "checkpoints").glob("step*"):
        shutil.rmtree(d)
    r = train(sample_shards, gone, 6)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert (f"error: {gone / 'checkpoints'}: latest names step00000006, but no checkpoint is left (the step "
            f"directories are gone); refusing to start {gone} over its history") in r.stderr
    assert (gone / "metrics.jsonl").read_bytes() == history

    # The newest checkpoint's model file cut short after COMPLETE: resume from step 4, saying which file; the
    # damaged checkpoint is set aside, the logs are cut to step 4 and training redoes steps 5-6.
    cut = tmp_path / "cut"
    shutil.copytree(base, cut)
    states = cut / "checkpoints" / "step00000006" / "mp_rank_00_model_states.pt"
    damaged = states.read_bytes()[: states.stat().st_size // 2]
    states.write_bytes(damaged)
    r = train(sample_shards, cut, 6)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("latest names step00000006, whose mp_rank_00_model_states.pt is damaged (not a readable torch archive: "
            "truncated?); resuming from the newest complete checkpoint step00000004") in r.stdout
    assert [m["step"] for m in read_jsonl(cut / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    (aside,) = (cut / "checkpoints").glob("abandoned_after_step00000004_*")
    assert (aside / "step00000006" / "mp_rank_00_model_states.pt").read_bytes() == damaged  # kept, not deleted

    # latest holding a non-UTF-8 byte: the newest complete checkpoint, with a note (the next save rewrites it);
    # latest a directory: one line naming it, exit 2 (no save could replace it).
    odd = tmp_path / "odd"
    shutil.copytree(base, odd)
    (odd / "checkpoints" / "latest").write_bytes(b"step0000\xff0004\n")
    r = train(sample_shards, odd, 6, "--dry-run")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (f"{odd / 'checkpoints'}: latest is empty or not UTF-8 text; resuming from the newest complete checkpoint "
            "step00000006") in r.stdout, r.stdout[-3000:]
    (odd / "checkpoints" / "latest").unlink()
    (odd / "checkpoints" / "latest").mkdir()
    r = train(sample_shards, odd, 6, "--dry-run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        f"error: {odd / 'checkpoints' / 'latest'}: a directory where the latest pointer file belongs (it names the "
        "checkpoint to resume from); move it out of the checkpoint directory"], r.stderr[-3000:]

    # Every checkpoint damaged: one line naming the newest tag and file, exit 2, nothing changed.
    for f in (base / "checkpoints").glob("step*/mp_rank_00_model_states.pt"):
        f.write_bytes(f.read_bytes()[:100])
    r = train(sample_shards, base, 6)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (f"error: {base / 'checkpoints' / 'step00000006'}: mp_rank_00_model_states.pt is damaged (not a "
            "readable torch archive: truncated?) and no earlier complete checkpoint is intact") in r.stderr
    assert (base / "metrics.jsonl").read_bytes() == history


def test_a_fresh_start_sets_earlier_logs_aside(sample_shards, tmp_path):
    """A start that stopped before its first checkpoint left metrics; the next start keeps them, moved aside."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    r = train(sample_shards, run_dir, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"the logs of an earlier start without checkpoints were moved to {run_dir / 'earlier-start-1'}" in r.stdout
    assert (run_dir / "earlier-start-1" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 3.0}\n'
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]


def test_bit_rot_inside_a_complete_checkpoint_is_never_trained_on(sample_shards, six_steps, tmp_path):
    """Campaign case 1: 64 bytes inverted inside a COMPLETE checkpoint's mp_rank_00_model_states.pt (same size, a
    readable archive) resumed silently and trained on the corrupted weights. Now the digest recorded at save time
    finds it: resume takes the previous checkpoint with a note naming the file (the damaged one set aside, byte for
    byte), and convert refuses the damaged checkpoint in one line naming the file."""
    import hashlib
    import subprocess
    import sys

    from conftest import REPO

    run = six_steps
    states = run / "checkpoints" / "step00000006" / "mp_rank_00_model_states.pt"
    data = bytearray(states.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    states.write_bytes(bytes(data))
    rotted = hashlib.sha256(data).hexdigest()

    conv = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--checkpoint", str(states.parent),
                           "--output", str(tmp_path / "export")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert conv.returncode != 0 and "Traceback" not in conv.stderr, conv.stderr[-3000:]
    assert (f"{states}: damaged (its sha256 differs from the one recorded in SHA256SUMS" in conv.stderr), conv.stderr
    assert not (tmp_path / "export").exists()

    r = train(sample_shards, run, 6)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("latest names step00000006, whose mp_rank_00_model_states.pt is damaged (its sha256 differs from the "
            "one recorded in SHA256SUMS") in r.stdout, r.stdout[-3000:]
    assert "resuming from the newest complete checkpoint step00000004" in r.stdout
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    (aside,) = (run / "checkpoints").glob("abandoned_after_step00000004_*")
    kept = aside / "step00000006" / "mp_rank_00_model_states.pt"
    assert hashlib.sha256(kept.read_bytes()).hexdigest() == rotted  # set aside as it was, never deleted
