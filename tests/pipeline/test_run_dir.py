"""Run-directory rules (pipeline/checkpoint/layout.py): which checkpoint a resume takes, rotation, the lock."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from pipeline.config import ConfigError
from pipeline.checkpoint.layout import (COMPLETE, LATEST, RunDirLock, checkpoint_tags, is_complete, mark_complete, resume_tag,
                              rotate, set_aside_later_checkpoints)


def make_ckpt(ckpt_dir, step, complete=True, milestone=False, legacy=False):
    d = ckpt_dir / f"step{step:08d}"
    d.mkdir(parents=True)
    client = {"step": step, "milestone": milestone}
    if not legacy:
        client["format"] = 2
    (d / "client_state.json").write_text(json.dumps(client))
    if complete and not legacy:
        mark_complete(d)
    return d.name


@pytest.fixture
def ckpts(tmp_path):
    d = tmp_path / "checkpoints"
    for s in (2, 4, 6):
        make_ckpt(d, s)
    (d / LATEST).write_text("step00000006")
    return d


def test_latest_complete_wins(ckpts):
    (ckpts / LATEST).write_text("step00000004\n")  # a rollback: latest need not be the newest
    assert resume_tag(ckpts) == ("step00000004", None)


@pytest.mark.parametrize("damage, why", [
    ("missing", "missing"), ("empty", "empty"), ("dangling", "does not exist"), ("truncated", "incomplete"),
    ("no_marker", "incomplete")])
def test_a_damaged_latest_falls_back_to_the_newest_complete(ckpts, damage, why):
    want = "step00000006"
    if damage == "missing":
        (ckpts / LATEST).unlink()
    elif damage == "empty":
        (ckpts / LATEST).write_text("")
    elif damage == "dangling":
        (ckpts / LATEST).write_text("step00000099")
    elif damage == "truncated":  # a kill while client_state.json was written (before the marker existed)
        state = ckpts / "step00000006" / "client_state.json"
        state.write_text(state.read_text()[:7])
        want = "step00000004"
    else:
        (ckpts / "step00000006" / COMPLETE).unlink()
        want = "step00000004"
    tag, note = resume_tag(ckpts)
    assert tag == want and why in note and want in note


def test_checkpoints_but_none_complete_is_an_error_not_a_fresh_start(tmp_path):
    d = tmp_path / "checkpoints"
    make_ckpt(d, 2, complete=False)
    with pytest.raises(ConfigError, match="none is complete"):
        resume_tag(d)
    assert resume_tag(tmp_path / "nothing") == (None, None)


def test_legacy_checkpoints_without_marker_count_when_their_state_parses(tmp_path):
    d = tmp_path / "checkpoints"
    make_ckpt(d, 2, legacy=True)
    assert is_complete(d / "step00000002") and resume_tag(d)[0] == "step00000002"


def test_rotation_keeps_the_newest_complete_milestones_and_latest(tmp_path):
    d = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        make_ckpt(d, s)
    make_ckpt(d, 4, milestone=True)
    make_ckpt(d, 5, complete=False)  # a save that died
    make_ckpt(d, 6)
    (d / LATEST).write_text("step00000006")
    assert rotate(d, 2, "step00000006") == ["step00000001", "step00000002"]
    assert checkpoint_tags(d) == ["step00000003", "step00000004", "step00000005", "step00000006"]


def test_rotation_after_a_rollback_keeps_the_resume_point_and_leaves_the_abandoned_timeline(tmp_path):
    d = tmp_path / "checkpoints"
    for s in (2, 4, 6, 8):
        make_ckpt(d, s)
    # --resume step4, then the run writes step 5: steps 6 and 8 belong to the abandoned timeline.
    (d / LATEST).write_text("step00000005")
    make_ckpt(d, 5)
    assert rotate(d, 1, "step00000005") == ["step00000002", "step00000004"]
    assert checkpoint_tags(d) == ["step00000005", "step00000006", "step00000008"]
    assert rotate(d, 0, "step00000005") == []  # keep_last 0 keeps everything


def test_lock_refuses_a_second_holder_and_names_it(tmp_path):
    first = RunDirLock(tmp_path)
    first.acquire()
    # flock locks belong to the open file description: a second process is refused, as a second training is.
    code = ("import sys; sys.path.insert(0, '.'); from pipeline.checkpoint.layout import RunDirLock; from pathlib import Path\n"
            f"try:\n    RunDirLock(Path({str(tmp_path)!r})).acquire()\nexcept Exception as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "in use by another training" in out and f"pid {os.getpid()}" in out
    first.release()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == ""  # released: the next training gets it


def test_a_rollback_sets_the_abandoned_timeline_aside(tmp_path):
    d = tmp_path / "checkpoints"
    for s in (2, 4, 6, 8):
        make_ckpt(d, s)
    aside = set_aside_later_checkpoints(d, "step00000004")
    assert checkpoint_tags(d) == ["step00000002", "step00000004"]
    assert sorted(p.name for p in aside.iterdir()) == ["step00000006", "step00000008"] and aside.parent == d
    assert set_aside_later_checkpoints(d, "step00000004") is None


def test_the_run_dir_lock_imports_neither_torch_nor_the_configs():
    """pipeline.checkpoint reads its readers' names lazily: layout (the run directory's files and lock) stays light."""
    code = ("import sys; sys.path.insert(0, '.'); import pipeline.checkpoint.layout\n"
            "print(sorted(m for m in ('torch', 'pipeline.config', 'pipeline.checkpoint.read') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _weights(tag_dir, payload=b"\x01" * 4096):
    (tag_dir / "mp_rank_00_model_states.bin").write_bytes(payload)
    (tag_dir / "sub").mkdir(exist_ok=True)
    (tag_dir / "sub" / "extra.json").write_text("{}")


def test_digests_find_a_changed_byte_a_missing_file_and_leave_older_checkpoints_alone(tmp_path):
    """SHA256SUMS lists every file (subfolders included) but the markers; one inverted byte in a file of the same
    size, a listed file gone, or a damaged digest line each make the checkpoint damaged, named by file; a checkpoint
    from before digests (no SHA256SUMS) is not digest-checked."""
    from pipeline.checkpoint.layout import DIGESTS, damaged_files, file_sha256

    d = tmp_path / "checkpoints"
    make_ckpt(d, 2)
    tag = d / "step00000002"
    for f in tag.iterdir():
        if f.name == COMPLETE:
            f.unlink()
    _weights(tag)
    mark_complete(tag)
    listed = (tag / DIGESTS).read_text().splitlines()
    assert [ln.split("  ")[1] for ln in listed] == ["client_state.json", "mp_rank_00_model_states.bin",
                                                   "sub/extra.json"]
    assert listed[1].split("  ")[0] == file_sha256(tag / "mp_rank_00_model_states.bin")
    assert damaged_files(tag) == []
    w = tag / "mp_rank_00_model_states.bin"
    w.write_bytes(b"\x01" * 2000 + b"\xfe" + b"\x01" * 2095)  # same size, one byte inverted
    (bad, why), = damaged_files(tag)
    assert bad == w and "sha256 differs" in why
    w.unlink()
    (bad, why), = damaged_files(tag)
    assert bad == w and "missing" in why
    _weights(tag)
    (tag / DIGESTS).write_text((tag / DIGESTS).read_text().replace("  sub/", " sub/"))
    (bad, why), = damaged_files(tag)
    assert bad.name == DIGESTS and "line 3" in why
    (tag / DIGESTS).unlink()
    w.write_bytes(b"\x00" * 10)
    assert damaged_files(tag) == []  # written before digests: checked as before (its torch archives only)


def test_a_changed_byte_in_latest_resumes_from_the_previous_checkpoint_with_a_note(ckpts):
    for s in (4, 6):
        tag = ckpts / f"step{s:08d}"
        (tag / COMPLETE).unlink()
        _weights(tag)
        mark_complete(tag)
    w = ckpts / "step00000006" / "mp_rank_00_model_states.bin"
    w.write_bytes(w.read_bytes()[:-1] + b"\x00")
    assert resume_tag(ckpts) == ("step00000006", None)  # without check_files: the markers only
    tag, note = resume_tag(ckpts, check_files=True)
    assert tag == "step00000004"
    assert "latest names step00000006, whose mp_rank_00_model_states.bin is damaged (its sha256 differs" in note
    (ckpts / "step00000004" / "sub" / "extra.json").write_text("{ }")
    tag, note = resume_tag(ckpts, check_files=True)  # step 2 is intact
    assert tag == "step00000002" and "skipped as damaged: step00000004 (sub/extra.json)" in note
    (ckpts / "step00000002" / "client_state.json").write_text('{"step": 2, "format": 2, "milestone": true}')
    with pytest.raises(ConfigError, match=r"step00000006: mp_rank_00_model_states.bin is damaged \(its sha256 "
                                          r"differs.* and no earlier complete checkpoint is intact"):
        resume_tag(ckpts, check_files=True)
