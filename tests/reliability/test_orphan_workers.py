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


def test_a_refused_second_run_touches_nothing_of_the_first(tmp_path):
    """Campaign case 4: the same ``--workers 2`` command started while the first still ran was refused by the work
    directory's lock, but that refusal was handled as bad input and removed OUT.workers-partial: the first run died
    with its work lost. Now the second is refused before it creates or removes anything, in one line, and the first
    finishes with the output a lone run writes."""
    fasta = big_fasta(tmp_path / "big.fa", copies=400)  # seconds: the second run starts well within them
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data_prep", "rnacentral", "--input", str(fasta), "--output", str(out),
           "--workers", "2", "--shard-size", "500", "--progress", "off"]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    staging = tmp_path / "out.workers-partial"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None and not any(staging.glob(".job*/*.tar")):
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before the second could start"
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    running = first.poll() is None
    out1, err1 = first.communicate(timeout=300)
    assert running, "the first run ended before the second was refused: the test proves nothing"
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr
    (line,) = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert f"{out} is being written by another data_prep --workers run (pid {first.pid} on " in line, line
    assert first.returncode == 0, err1
    lone = subprocess.run([*cmd[:7], str(tmp_path / "lone"), *cmd[8:]], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert lone.returncode == 0, lone.stderr
    got, want = (json.loads((d / "manifest.json").read_text()) for d in (out, tmp_path / "lone"))
    assert [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in want["shards"]]
    assert not list(tmp_path.glob(".*.workers.lock"))
