"""Case 5: SIGKILL of `data_prep --workers 2`'s main process left both workers blocked on their pipe for good,
holding their work directory's lock: every rerun failed with "... is being written by another data_prep run" until
the orphans were killed by hand. Now the pool's workers die with their parent (Linux's parent-death signal) and the
rerun resumes; a lock whose holder is gone is taken over, saying whose it was."""
import gzip
import json
import subprocess
import sys
import time

import psutil

from conftest import REPO, SAMPLE_FASTA


def big_fasta(path, copies=25):
    """The shipped Rfam sample, ``copies`` times with distinct ids (gzipped, level 1, when ``path`` ends in .gz)."""
    text = gzip.decompress(SAMPLE_FASTA.read_bytes()).decode()
    with (gzip.open(path, "wt", compresslevel=1) if str(path).endswith(".gz") else open(path, "w")) as f:
        for c in range(copies):
            f.write(text.replace(">", f">c{c}_"))
    return path


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_die_with_their_parent_and_the_rerun_resumes(tmp_path):
    # The batch reader's --workers: one job in the main process, which writes OUT.partial, and a pool of two
    # processes that parse its chunks. 150 copies: about a second of work, so that the run is still going when both
    # workers and a first shard are seen (25 plain copies took 0.3 s in all).
    fasta = big_fasta(tmp_path / "big.fa.gz", copies=150)
    out = tmp_path / "out"
    def prep(output):
        return [sys.executable, "-m", "data_prep", "rnacentral", "--input", str(fasta), "--output", str(output),
                "--workers", "2", "--shard-size", "500"]
    cmd = prep(out)
    main = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    staging = tmp_path / "out.partial"
    deadline = time.monotonic() + 120
    workers = []
    while time.monotonic() < deadline and main.poll() is None:
        workers = psutil.Process(main.pid).children()
        if len(workers) == 2 and any(staging.glob("*.tar")):
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
    staging = tmp_path / "out.partial"  # the batch reader's --workers: one job, in the main process
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None and not any(staging.glob("*.tar")):
        time.sleep(0.05)
    assert first.poll() is None, "the first run ended before the second could start"
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    running = first.poll() is None
    out1, err1 = first.communicate(timeout=300)
    assert running, "the first run ended before the second was refused: the test proves nothing"
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr
    (line,) = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert (f"{out} is being written by another data_prep run (data_prep rnacentral --workers 2, pid {first.pid} on "
            in line), line
    assert first.returncode == 0, err1
    lone = subprocess.run([*cmd[:7], str(tmp_path / "lone"), *cmd[8:]], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert lone.returncode == 0, lone.stderr
    got, want = (json.loads((d / "manifest.json").read_text()) for d in (out, tmp_path / "lone"))
    assert [s["sha256"] for s in got["shards"]] == [s["sha256"] for s in want["shards"]]
    assert not list(tmp_path.glob(".*.lock"))  # the output's lock (data_prep/common.py lock_path) is gone


def test_workers_that_cannot_run_python_code_die_with_their_parent(tmp_path):
    """Campaign issue 37 case 7: orphans of `--workers 2 --dedup` outlived a SIGKILLed main process by 15-40 s,
    holding their work directory's lock. The parent-death signal was SIGTERM, whose Python handler acts only when the
    worker's main thread next runs Python code: a worker that cannot (here: stopped, as by a debugger or a job-control
    stop; likewise one inside a long C call) outlived its parent for as long. It is SIGKILL now, which the kernel
    carries out whatever the worker is doing; each lock is free once the parent is gone."""
    import fcntl
    import os
    import signal

    fasta = big_fasta(tmp_path / "big.fa")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data_prep", "rnacentral", "--input", str(fasta), "--output", str(out),
           "--workers", "2", "--dedup", "--progress", "off"]
    main = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = tmp_path / "out.workers-partial"
    workers = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and main.poll() is None:
            workers = psutil.Process(main.pid).children()
            # each job's lock file names its worker once the worker took it, after it armed the parent-death signal
            locks = [p.read_text() for p in staging.glob(".job*/.lock")]
            if len(workers) == 2 and all(any(f"pid {w.pid} " in t for t in locks) for w in workers):
                break
            time.sleep(0.005)
        else:
            raise AssertionError("the run ended before its workers could be stopped")
        for w in workers:
            os.kill(w.pid, signal.SIGSTOP)  # neither can run its handlers now
        main.kill()
        main.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5 and not all(gone(w.pid) for w in workers):
            time.sleep(0.05)
        assert all(gone(w.pid) for w in workers), "a worker outlived its parent"
        for path in [tmp_path / ".out.data_prep.lock", *staging.glob(".job*/.lock")]:
            # A zombie worker's lead thread may show before its other threads (the shard writer's) have let go of
            # the files they share: free within the same 5 s, or still held by an orphan (BlockingIOError)
            with open(path) as f:
                while True:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() - t0 > 5:
                            raise
                        time.sleep(0.01)
    finally:
        for w in workers:
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
