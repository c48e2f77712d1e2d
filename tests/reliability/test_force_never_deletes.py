"""Every tool that writes a directory replaces only a directory it wrote itself (pipeline/outputs.py): given
``--force`` (data_prep: ``--overwrite``) and a directory it did not write (a training run, a folder of exports),
each refuses with one line naming what is inside, and every file is intact (case 1: ``convert_checkpoint.py
--output exports --force`` deleted the folder). An ``--output`` that is a mount point is refused at the start, not
after the work (case 7: the final rename failed with EBUSY on every rerun)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SAMPLE_FASTA as RNA

sys.path.insert(0, str(REPO / "tests" / "tools"))
from checkpoint_factory import tiny_config, write_deepspeed_like, write_export  # noqa: E402


def digest(root: Path) -> dict:
    """Every file under ``root`` (hidden ones too) -> sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def run_dir(t: Path) -> Path:
    """A training run as the launcher leaves it: checkpoints, latest, metrics, log, lock."""
    cfg = tiny_config(t)
    write_deepspeed_like(t / "run", cfg, step=3)
    (t / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.9}\n')
    (t / "run" / "train.log").write_text("step 1/3 | loss 3.0\n")
    (t / "run" / ".lock").write_text("host 1\n")
    return t / "run"


def exports_folder(t: Path) -> Path:
    """A parent folder of exports and notes (what ``--output exports`` instead of ``exports/NAME`` names)."""
    write_export(t / "exports" / "demo", tiny_config(t))
    (t / "exports" / "demo" / "export.json").write_text("{}")
    (t / "exports" / "notes.md").write_text("what each export is\n")
    return t / "exports"


def tools(t: Path, out: Path) -> dict:
    """Each directory-writing tool, writing to ``out`` with its replace flag -> its argv."""
    ckpt = t / "source"
    write_deepspeed_like(ckpt, tiny_config(t), step=2)
    py = sys.executable
    return {
        "convert_checkpoint": [py, "tools/convert_checkpoint.py", "--checkpoint", ckpt, "--output", out, "--force",
                               "--trust-checkpoint"],
        "upcycle_esm2": [py, "tools/upcycle_esm2.py", "--esm", t / "no_esm", "--out", out, "--force"],
        "make_random_esm2": [py, "tools/make_random_esm2.py", "--out", out, "--force"],
        "data_prep rnacentral": [py, "-m", "data_prep", "rnacentral", "--input", RNA, "--output", out,
                            "--overwrite"],
        "data_prep synthetic-hops": [py, "-m", "data_prep", "synthetic-hops", "--hops", "2", "--records", "10",
                                     "--seed", "0", "--output", out, "--overwrite"],
    }


def named_like_an_export(t: Path) -> Path:
    """Campaign case 6: a user's folder holding files named as the tools' own (export.json, a config.json of model
    type esm, a manifest.json) with the user's notes beside them; a name anyone can create once made the folder "tool-written"."""
    d = t / "mine"
    d.mkdir()
    (d / "export.json").write_text("{}")
    (d / "config.json").write_text('{"model_type": "esm"}')
    (d / "manifest.json").write_text("{}")  # data_prep's output was recognised by this name
    (d / "notes.md").write_text("my notes\n")
    return d


TARGETS = {"run_dir": run_dir, "exports_folder": exports_folder, "named_like_an_export": named_like_an_export}


@pytest.mark.parametrize("target", list(TARGETS))
def test_force_never_replaces_what_the_tool_did_not_write(tmp_path, target):
    out = TARGETS[target](tmp_path)
    before = digest(out)
    inside = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir()))
    for name, argv in tools(tmp_path, out).items():
        r = subprocess.run([str(a) for a in argv], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode in (1, 2), (name, r.stdout, r.stderr)  # data_prep's bad-input exit is 1, the tools' 2
        tool = name.split()[0] + ("" if name.startswith("data_prep") else ".py")
        prefix = "data_prep: error" if tool == "data_prep" else "error"
        assert r.stderr.strip().splitlines() == [
            f"{prefix}: {out} is not empty and was not written by {tool} (it holds {inside}); not replacing it, even "
            f"with {'--overwrite' if tool == 'data_prep' else '--force'}: choose a new directory"], (name, r.stderr)
        assert digest(out) == before, name
        assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == [], name  # no staging


def test_force_replaces_the_tools_own_output(tmp_path):
    """The other half of the rule: what the tool wrote itself is replaced with the flag (and refused without)."""
    out = tmp_path / "esm"
    py = [sys.executable, "tools/make_random_esm2.py", "--out", str(out)]
    assert subprocess.run(py, cwd=REPO, capture_output=True, timeout=120).returncode == 0
    first = digest(out)
    again = subprocess.run(py, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.strip() == (f"error: {out} already holds an ESM2 model; pass "
                                                              "--force to replace it")
    assert subprocess.run(py + ["--seed", "1", "--force"], cwd=REPO, capture_output=True, timeout=120).returncode == 0
    assert digest(out).keys() == first.keys() and digest(out) != first
    assert [p.name for p in tmp_path.iterdir()] == ["esm"]  # nothing left beside it
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # readable by others as any new directory (was 0700)
    # and its files as any new file: safetensors writes model.safetensors 0600, unreadable to colleagues
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == {
        f.name: oct(0o666 & ~umask) for f in out.iterdir()}


def _can_mount() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(shutil.which("unshare") is None or not _can_mount(),
                    reason="needs unshare -rm (a user and mount namespace) to mount a tmpfs without root")
def test_an_output_that_is_a_mount_point_is_refused_before_the_work(tmp_path):
    out = tmp_path / "volume"
    out.mkdir()
    script = (f"mount -t tmpfs none {out} && cd {REPO} && {sys.executable} -m data_prep rnacentral "
              f"--input {RNA} --output {out}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"data_prep: error: {out} is a mount point: the output is built beside it and renamed into place, which cannot replace a "
        f"mount point; give a directory inside it (e.g. {out / 'volume'})"]
    assert [p.name for p in tmp_path.iterdir()] == ["volume"]  # no volume.partial: refused before the work


def test_overwrite_keeps_what_data_prep_did_not_write(tmp_path):
    """data_prep marks its output (.written-by.json listing its files): --overwrite replaces those and keeps a user's
    notes beside them, saying so; a marker of another tool makes the folder not data_prep's."""
    out = tmp_path / "hops"
    argv = [sys.executable, "-m", "data_prep", "synthetic-hops", "--hops", "2", "--records", "10", "--output", str(out)]
    assert subprocess.run(argv + ["--seed", "0"], cwd=REPO, capture_output=True, timeout=120).returncode == 0
    (out / "NOTES.md").write_text("which seed this was\n")
    r = subprocess.run(argv + ["--seed", "1", "--overwrite"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "NOTES.md").read_text() == "which seed this was\n"
    assert "note: kept 1 file that data_prep did not write: NOTES.md" in r.stderr, r.stderr
    (out / ".written-by.json").write_text('{"tool": "convert_checkpoint.py", "files": []}')
    (out / "manifest.json").write_text("{}")
    r = subprocess.run(argv + ["--seed", "2", "--overwrite"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "was not written by data_prep" in r.stderr, r.stderr
