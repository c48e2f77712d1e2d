"""Case 5: SIGKILL of `data_prep --workers 2`'s main process left both workers blocked on their pipe for good,
holding their work directory's lock: every rerun failed with "... is being written by another data_prep run" until
the orphans were killed by hand. Now the workers die with their parent (Linux's parent-death signal) and the rerun
resumes; a lock whose holder is gone is taken over, saying whose it was."""
import gzip
import json
import subprocess
import sys
import time

import psutil

from conftest import REPO, SAMPLE_FASTA


def big_fasta(path, copies=25):
    """The shipped Rfam sample, ``copies`` times with distinct ids: enough records that two workers take seconds."""
    text = gzip.decompress(SAMPLE_FASTA.read_bytes()).decode()
    with open(path, "w") as f:
        for c in range(copies):
            f.write(text.replace(">", f">c{c}_"))
    return path


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_die_with_their_parent_and_the_rerun_resumes(tmp_path):
    fasta = big_fasta(tmp_path / "big.fa")
    out = tmp_path / "out"
    def prep(output):
        return [sys.executable, "-m", "data_prep", "rnacentral", "--input", str(fasta), "--output", str(output),
                "--workers", "2", "--shard-size", "500"]
    cmd = prep(out)
    main = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    staging = tmp_path / "out.workers-partial"
    deadline = time.monotonic() + 120
    workers = []
    while time.monotonic() < deadline and main.poll() is None:
        workers = psutil.Process(main.pid).children()
        if len(workers) == 2 and any(staging.glob(".job*/*.tar")):
            break
        time.sleep(0.05)
    assert main.poll() is None and len(workers) == 2, "the run ended before its main process could be killed"
    main.kill()
    main.wait()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10 and not all(gone(w.pid) for w in workers):
        time.sleep(0.1)
    assert all(gone(w.pid) for w in workers), [w.pid for w in workers]

    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "being written by another data_prep run" not in rerun.stderr
    clean = subprocess.run(prep(tmp_path / "clean"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr
    resumed, fresh = (json.loads((d / "manifest.json").read_text()) for d in (out, tmp_path / "clean"))
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in fresh["shards"]]


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_note(tmp_path):
    """A job's work directory whose lock file names a process that died without releasing it (SIGKILL of the whole
    group): the rerun takes it over and says whose it was; a live holder is named in the refusal."""
    fasta = SAMPLE_FASTA
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / ".lock").write_text("pid 999999 on some-host")
    r = subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(fasta), "--output", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (f"data_prep: {partial}: taking over the work left by pid 999999 on some-host, which is no longer "
            "running") in r.stderr
