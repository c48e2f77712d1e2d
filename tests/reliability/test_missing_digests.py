"""Issue 49 case 1: a missing SHA256SUMS was taken for a checkpoint from before digests. With the digest file deleted
and a weight rotted, the run resumed on the rotted weights without a word (step-5 loss 3.32 against 2.47 intact) and
convert_checkpoint.py exported them. A checkpoint whose own client state says it was written with digests must have
them: a missing or unreadable SHA256SUMS damages it (resume falls back past it with a note, the tools refuse it in one
line); only a checkpoint whose client state predates digests is read without them, and that is said in one line."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY, losses, read_jsonl, run_single

pytestmark = pytest.mark.slow  # DeepSpeed training launches


def rot(path):
    """64 bytes inverted in the middle of a file: same size, still a readable zip archive (torch's reader checks no
    CRC), so only a digest can tell."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


def convert(tag_dir, out):
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--checkpoint", str(tag_dir), "--output",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_deleted_or_unreadable_digest_file_is_damage_not_age(sample_shards, short_run, tmp_path):
    run = short_run  # 4 steps, checkpoints at 2 and 4 (conftest)
    intact = tmp_path / "intact"
    shutil.copytree(run, intact)
    step4 = run / "checkpoints" / "step00000004"
    (step4 / "SHA256SUMS").unlink()
    rot(step4 / "mp_rank_00_model_states.pt")

    # the tools: one line naming the digest file, nothing exported
    r = convert(step4, tmp_path / "export")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: {step4 / 'SHA256SUMS'}: missing (this checkpoint's client_state.json says it was written with "
        "digests, so its files can no longer be checked); this checkpoint cannot be trusted: use an earlier one (or "
        "restore the file)"], r.stderr[-3000:]
    assert not (tmp_path / "export").exists()

    # resume: falls back to step 2 with a note naming the file, and redoes steps 3-6 as the intact run does
    over = ["data.train_shards=" + str(sample_shards), "train.max_steps=6", "checkpoint.every_steps=2",
            "checkpoint.keep_last=0", *TINY]
    r = run_single("ds_configs/zero2.json", over + [f"run_dir={run}"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"{run / 'checkpoints'}: latest names step00000004, whose SHA256SUMS is missing (this checkpoint's "
            "client_state.json says it was written with digests") in r.stdout, r.stdout[-3000:]
    assert "resuming from the newest complete checkpoint step00000002" in r.stdout
    good = run_single("ds_configs/zero2.json", over + [f"run_dir={intact}"], timeout=300)
    assert good.returncode == 0, good.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert losses(run) == losses(intact)  # the rotted weights were never trained on

    # a SHA256SUMS that cannot be read (a directory in its place) is the same damage
    step6 = run / "checkpoints" / "step00000006"
    (step6 / "SHA256SUMS").unlink()
    (step6 / "SHA256SUMS").mkdir()
    r = convert(step6, tmp_path / "export")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"error: {step6 / 'SHA256SUMS'}: unreadable: Is a directory" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "export").exists()


def test_a_checkpoint_from_before_digests_is_read_and_said_so(short_run, tmp_path):
    """The other half: a checkpoint whose client state predates digests (format 2, no SHA256SUMS, as the golden
    checkpoints) exports, with one note saying its files were checked as archives only."""
    step2 = short_run / "checkpoints" / "step00000002"
    (step2 / "SHA256SUMS").unlink()
    client = json.loads((step2 / "client_state.json").read_text())
    (step2 / "client_state.json").write_text(json.dumps({**client, "format": 2}, indent=1))
    r = convert(step2, tmp_path / "export")
    assert r.returncode == 0, r.stderr[-3000:]
    # (the progress bar redraws its line with carriage returns: the note is one of its segments)
    notes = [seg for ln in r.stderr.splitlines() for seg in ln.split("\r") if seg.startswith("note:")]
    assert notes == [f"note: {step2}: written before checkpoint digests (no SHA256SUMS, client_state.json format 2): "
                     "its files are checked as readable archives only"], r.stderr[-3000:]
