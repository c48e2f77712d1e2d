"""Crash-resume (acceptance 2, second half): a job SIGKILLed mid-run is rerun and ends byte-identical to an
uninterrupted run, without duplicate or partial shards. Input: the real 134 phiX genomes as OpenGenome2 JSONL."""
import gzip
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.data.shards import load_manifest

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
PHIX = SHARED / "genome" / "phiX174_variants_134_genomes.fna"


# `python -m data_prep` that pauses 0.05 s after each finished shard (WorkDir.record), so that the test can SIGKILL
# the run at a known point: the pause is patched into the child process only, production code has no hook for it.
SLOW_SHARDS = """
import sys, time
from data_prep import workdir
from data_prep.__main__ import main
record = workdir.WorkDir.record
def slow_record(self, info, split=""):
    record(self, info, split)
    time.sleep(0.05)
workdir.WorkDir.record = slow_record
sys.exit(main(sys.argv[1:]))
"""


def args(src, out):
    return ["opengenome2", "--input", str(src), "--output", str(out), "--shard-size", "4"]


def cmd(src, out):
    return [sys.executable, "-m", "data_prep", *args(src, out)]


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")
def test_sigkill_then_rerun_equals_uninterrupted(tmp_path):
    src = tmp_path / "data_phix_train_chunk1.jsonl.gz"
    blocks = PHIX.read_text().split(">")[1:]
    with gzip.open(src, "wt") as f:
        for b in blocks:
            head, *lines = b.split("\n")
            f.write(json.dumps({"record": head.split()[0], "text": "".join(lines)}) + "\n")
    ref = subprocess.run(cmd(src, tmp_path / "ref"), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SHARDS, *args(src, out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    progress = tmp_path / "out.partial" / "progress.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline:
        if progress.is_file() and len(progress.read_text().splitlines()) >= 6:  # fingerprint + 5 shards
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL and not out.exists()
    partial = sorted(p.name for p in (tmp_path / "out.partial").glob("*.tar"))
    assert 5 <= len(partial) < 34
    # a damaged finished shard is caught by verification and regenerated with everything after it
    victim = tmp_path / "out.partial" / partial[3]
    victim.write_bytes(victim.read_bytes()[:-1024])

    rerun = subprocess.run(cmd(src, out), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming" in rerun.stderr and "3 complete shards verified" in rerun.stderr
    a, b = load_manifest(out), load_manifest(tmp_path / "ref")
    assert [(s.path, s.samples, s.sha256) for s in a.shards] == [(s.path, s.samples, s.sha256) for s in b.shards]
    assert a.stats == b.stats and a.inputs[0]["records"] == 134
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert not (tmp_path / "out.partial").exists()
