"""Issue 49 case 3: two data_prep runs on one output, one plain and one ``--workers 2``, both exited 0 and both
reported writing it; the later one silently replaced the other, even on a new output without --overwrite (with
--min-length 50 against 100 the folder held the other run's records, not those the --workers run reported). Every
mode now takes the same lock on the output (data_prep/common.py output_lock): a plain run, a --workers run, merge
and synthetic-hops exclusively, the jobs of one --num-jobs array shared; a second run is refused in one line naming
the first, and touches nothing.

Each first run is frozen (SIGSTOP) while it writes, so the second one surely meets it, then let go."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, SAMPLE_FASTA, launch_env


@pytest.fixture(scope="module")
def fasta(tmp_path_factory):
    """The shipped Rfam sample 10 times over (gzip members laid end to end): a run of a few seconds."""
    path = tmp_path_factory.mktemp("input") / "rfam_x10.fasta.gz"
    with open(path, "wb") as f:
        for _ in range(10):
            f.write(SAMPLE_FASTA.read_bytes())
    return path


def prep(fasta, out, *extra):
    return [sys.executable, "-m", "data_prep", "rnacentral", "--input", str(fasta), "--output", str(out),
            "--progress", "off", *extra]


def start_frozen(cmd, sign, timeout=120):
    """Start ``cmd`` in a process group of its own and freeze the group once the path ``sign`` exists (the run is
    writing)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + timeout
    while not sign.exists():
        assert proc.poll() is None, f"ended before it was frozen: {proc.communicate()}"
        assert time.time() < deadline, f"{sign} never appeared"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGSTOP)
    return proc


def let_go(proc):
    os.killpg(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def run(cmd):
    return subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)


def refused(r, out, holder):
    """The second run's one line: exit 1, the output and the first run named, nothing else said."""
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"data_prep: error: {out} is being written by another data_prep "
                                                   f"run ({holder}"), r.stderr
    assert lines[0].endswith("; wait for it to end, or write to another --output"), r.stderr
    assert r.stdout == ""


def records(out):
    m = json.loads((out / "manifest.json").read_text())
    return m["total_samples"], m["filtered"]


def test_a_plain_and_a_workers_run_never_share_an_output(fasta, tmp_path):
    out = tmp_path / "shards"
    first = start_frozen(prep(fasta, out, "--min-length", "100"), tmp_path / "shards.partial")
    try:
        r = run(prep(fasta, out, "--min-length", "50", "--workers", "2"))
        refused(r, out, f"data_prep rnacentral, pid {first.pid} on ")
        assert not (tmp_path / "shards.workers-partial").exists() and not out.exists()
    finally:
        rc, stdout, stderr = let_go(first)
    assert rc == 0, stderr
    alone = tmp_path / "alone"
    assert run(prep(fasta, alone, "--min-length", "100")).returncode == 0
    assert records(out) == records(alone)  # the first run's records, as it reported them
    assert f"written {records(out)[0]}," in stdout

    out = tmp_path / "other"
    # the batch reader's --workers: one job writing OTHER.partial in the main process, its chunks parsed by a pool
    staging = tmp_path / "other.partial"
    first = start_frozen(prep(fasta, out, "--min-length", "50", "--workers", "2"), staging)
    try:
        before = sorted((p.name, p.stat().st_mtime_ns) for p in staging.iterdir())
        r = run(prep(fasta, out, "--min-length", "100"))
        refused(r, out, f"data_prep rnacentral --workers 2, pid {first.pid} on ")
        assert sorted((p.name, p.stat().st_mtime_ns) for p in staging.iterdir()) == before  # the first run's
    finally:
        rc, stdout, stderr = let_go(first)
    assert rc == 0, stderr
    assert records(out)[0] > records(alone)[0] and f"written {records(out)[0]}," in stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no lock file left


def test_the_jobs_of_an_array_share_the_output_and_nothing_else_does(fasta, tmp_path):
    out = tmp_path / "array"
    job = ["--num-jobs", "2", "--job-index"]
    first = start_frozen(prep(fasta, out, *job, "0"), out / ".job0000-of-0002.partial")
    try:
        assert run(prep(fasta, out, *job, "1")).returncode == 0  # its sibling writes beside it
        r = run(prep(fasta, out))
        refused(r, out, f"data_prep rnacentral job 0 of 2, pid {first.pid} on ")
        r = run([sys.executable, "-m", "data_prep", "merge", "--output", str(out)])
        refused(r, out, f"data_prep rnacentral job 0 of 2, pid {first.pid} on ")
        assert not (out / "manifest.json").exists()
    finally:
        rc, _, stderr = let_go(first)
    assert rc == 0, stderr
    merged = run([sys.executable, "-m", "data_prep", "merge", "--output", str(out)])
    assert merged.returncode == 0, merged.stderr
    alone = tmp_path / "alone"
    assert run(prep(fasta, alone)).returncode == 0
    assert records(out) == records(alone)
    shutil.rmtree(out)
