"""``--workers N``: one data_prep run on N processes of this machine, jobs 0..N-1 of ``--num-jobs N`` forked from
this one, then merged. For the FASTA sources on the batch reader the parent decompresses each input once and feeds
the workers its chunks of whole records (data_prep/feed.py); each worker's Feed is handed to its job explicitly."""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from pipeline.outputs import kept_note, publish_dir

from . import Source, batch
from .build import batch_source
from .checks import PrepError
from .common import TOOL, check_output_replaceable, manifest_files, output_lock
from .fasta import FastaError, input_position
from .feed import FEED_DEPTH, Aborted, Feed
from .jobs import run
from .merge import merge
from .rule import read_bound
from .settings import Result, Settings


def _fed(source: Source, settings: Settings, kwargs: dict, inputs: list[Path]) -> bool:
    """Whether a --workers run is fed by the parent: the jobs would take the batch reader (build.batch_reader) and
    some input is gzip (plain inputs are split into byte ranges that each job reads itself, batch.byte_ranges);
    with --clusters, whenever every input starts with a header (the member FASTA read once, whatever its
    compression; its records then meet in the workers' shared spill)."""
    if not batch_source(source, settings, kwargs.get("members")) or not all(p.is_file() for p in inputs):
        return False
    if kwargs.get("clusters") is not None:
        return False
    return any(batch.is_gzip(p) for p in inputs)


def _release_peers(feeds: list, procs: list, failed) -> None:
    """--clusters, after the last chunk: wait until every worker has read its chunks into the shared spill, then
    let each join them all. Raises Aborted when a worker has failed or ended meanwhile (none ends before "go")."""
    while not all(f.scanned.is_set() for f in feeds):
        if failed.wait(0.01) or any(p.exitcode is not None for p in procs):
            raise Aborted()
    for f in feeds:
        f.queue.put(("go",))


def _feed_inputs(inputs: list[Path], feeds: list, procs: list, failed, bound: int | None = None) -> None:
    """The parent's side of a fed --workers run: every input the batch reader takes is decompressed here, once, and
    cut into chunks of whole records (batch.chunks) dealt round-robin to the workers. Raises Aborted when a worker
    has failed (``failed`` set, or it died; its report says why)."""
    def put(q, msg):
        while True:
            try:
                q.put(msg, timeout=0.05)
                return
            except queue_mod.Full:
                if failed.is_set() or any(p.exitcode not in (None, 0) for p in procs):
                    raise Aborted() from None

    n, number = len(feeds), 0
    for path in inputs:
        if not batch.starts_with_header(path):
            continue  # read by every worker itself, record by record (jobs of N)
        key, first = str(path), 0
        for text, line in batch.chunks(path, batch.CHUNK, bound=bound):  # a record past bound: a LongRecord
            put(feeds[number % n], ("chunk", key, number, text, line, first, input_position(path)))
            first += 1 if isinstance(text, batch.LongRecord) else batch.headers(text)
            number += 1
        for q in feeds:
            put(q, ("end", key, first, number))


def _die_with_parent(parent: int) -> None:
    """Kill this worker when the process that forked it dies (SIGKILL of the main process, an OOM kill): an orphan
    would wait on its feed pipe for good, or run its job to the end, holding its work directory's lock (and the
    inherited --workers lock). Linux: the kernel's parent-death signal; elsewhere a thread that watches the parent
    pid.

    The signal is SIGKILL, not SIGTERM: a SIGTERM only sets a flag that this process's main thread acts on when it
    next runs Python code, and then unwinds through the job's cleanup; a worker stopped (SIGSTOP, a debugger) or
    stuck in a C call when its parent dies outlives it for as long, lock held. An orphan needs no cleanup: the
    kernel drops its flocks, and the rerun drops the unlisted partial shard and takes over the lock file that still
    names it. (A SIGTERM of the parent still unwinds the workers: the parent terminates them itself.)"""
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError
    except (OSError, AttributeError):
        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _worker(queue, index: int, kwargs: dict, feed: Feed | None = None, parent: int = 0) -> None:
    """Job ``index`` of a --workers run, in a forked process: its exit status, first error line and the error's rank
    (Feed.rank; -1 unfed) to the parent. ``feed``: the chunks the parent sends this job (fed runs), handed to
    ``run``."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    _die_with_parent(parent)

    def rank():
        if feed is not None:
            feed.failed.set()  # the parent stops feeding
            return feed.rank
        return -1.0
    try:
        run(**kwargs, feed=feed)
    except (PrepError, FastaError, OSError, ValueError) as e:
        queue.put((index, 1, str(e), rank()))
        return
    except Aborted:
        queue.put((index, 3, "stopped by the parent", float("inf")))
        return
    except KeyboardInterrupt:
        queue.put((index, 130, "interrupted", rank()))
        return
    except BaseException as e:  # noqa: BLE001 -- reported by the parent, which owns the output
        queue.put((index, 2, f"{type(e).__name__}: {e}", rank()))
        return
    queue.put((index, 0, "", 0.0))


def run_workers(workers: int, source: Source, alphabet: str | None, inputs: list[Path], output: Path,
                settings: Settings = Settings(), overwrite: bool = False, **kwargs) -> Result:
    """One data_prep run on ``workers`` processes of this machine: N = workers jobs in forked processes, written
    into ``DIR.workers-partial``, merged (``merge``) and renamed to ``DIR``: the output is the merged shard directory
    of the N jobs (their shards ``SOURCE-jKKKK-*.tar`` and job manifests beside the merged manifest.json).

    Fed (FASTA sources on the batch reader: no --dedup, --window, --uniref90-members; see ``_fed``): this process
    decompresses each input once and deals its chunks of whole records (batch.CHUNK bytes) round-robin to the
    workers (bounded queues, ``Feed``), which parse, filter, tokenize and write them. With --clusters the workers
    parse their chunks into one spill folder made here, wait until all have (``_release_peers``), and each joins
    its clusters' members against all of it (data_prep/join.py). The records (keys = global
    record indices, tokens, meta), filter counts and statistics are those of a 1-process run; the merged manifest
    lists job 0's shards (chunks 0, N, 2N, ...) then job 1's, and so on, so the sample order is fixed by N and
    batch.CHUNK; filtered.tsv holds the same rows, grouped the same way. A bad input is reported as the error a
    single process meets first. Otherwise each job k is exactly ``--num-jobs N --job-index k`` (every process reads
    every input). A bad input stops every job and leaves nothing; an interrupted run resumes each job's work."""
    if settings.num_jobs != 1:
        raise PrepError(f"--workers {workers} runs the jobs of one machine itself: it excludes --num-jobs "
                        f"{settings.num_jobs}")
    output = Path(output).resolve()
    if output.exists() and not output.is_dir():
        raise PrepError(f"output {output} exists and is not a directory")
    check_output_replaceable(output, overwrite)  # refused before anything is made
    made = [p for p in reversed(output.parents) if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        # The output's one lock (common.output_lock), held from before anything is created or removed to the
        # rename: a second run of any mode is refused here and touches nothing of this run's staging directory.
        with output_lock(output, f"data_prep {source.name} --workers {workers}"):
            check_output_replaceable(output, overwrite)  # again, under the lock: what another run left meanwhile
            return _run_workers(workers, source, alphabet, inputs, output, settings, kwargs)
    except PrepError:  # a bad input or a refusal: nothing is kept, the folders made for the output included
        for p in reversed(made):
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _run_workers(workers: int, source: Source, alphabet: str | None, inputs: list[Path], output: Path,
                 settings: Settings, kwargs: dict) -> Result:
    # Imported once here, before the fork, not in every worker: webdataset pulls in torch (~2 s). Not at the top of
    # the module: argument and output-directory mistakes are reported without waiting for it.
    import pipeline.data.shards  # noqa: F401

    staging = output.with_name(f"{output.name}.workers-partial")
    staging.mkdir(exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    progress = kwargs.pop("progress", ("auto", 60.0))
    paths = [Path(p).resolve() for p in inputs]
    paths = source.expand(paths) if source.expand is not None else paths
    fed = _fed(source, settings, kwargs, paths)
    stop = ctx.Event()
    spill = tempfile.mkdtemp(prefix="data_prep-clusters-") if fed and kwargs.get("clusters") is not None else None
    feeds = [Feed(ctx.Queue(FEED_DEPTH), stop, ctx.Event() if spill else None, spill) for _ in range(workers)] \
        if fed else [None] * workers
    procs = []
    for k in range(workers):
        job = dict(kwargs, source=source, alphabet=alphabet, inputs=inputs, output=staging, locked=False,
                   settings=replace(settings, num_jobs=workers, job_index=k), overwrite=True,
                   progress=progress if k == 0 else ("off", progress[1]))  # one progress bar: job 0's
        procs.append(ctx.Process(target=_worker, args=(queue, k, job, feeds[k], os.getpid()), daemon=False))
    reader_error = None  # (rank, message) of a bad input met by this process while feeding
    gc.freeze()  # the parent's objects out of the collector: a worker's collections do not copy their pages
    try:
        for p in procs:
            p.start()
        if fed:
            try:
                _feed_inputs(paths, [f.queue for f in feeds], procs, stop, read_bound(settings))
                if spill is not None:
                    _release_peers(feeds, procs, stop)
            except (Aborted, FastaError, OSError) as e:
                if not isinstance(e, Aborted):
                    reader_error = str(e)
                for f, p in zip(feeds, procs):
                    f.queue.cancel_join_thread()  # a stopped worker may leave chunks unread
                    while p.is_alive():
                        try:
                            f.queue.put(("abort",), timeout=0.05)
                            break
                        except Exception:  # noqa: BLE001 -- queue.Full: the worker is still busy
                            continue
        for p in procs:
            p.join()
    except BaseException:
        for f in feeds:
            if f is not None:
                f.queue.cancel_join_thread()  # chunks left unsent must not block this process's exit
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        raise
    finally:
        gc.unfreeze()
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    reports = []
    while not queue.empty():
        reports.append(queue.get())
    reports.sort()
    status = {k: (rc, msg, rank) for k, rc, msg, rank in reports}
    failed = [(k, status.get(k, (p.exitcode or 1, f"worker {k} exited with status {p.exitcode}", 0.0))[:2])
              for k, p in enumerate(procs) if status.get(k, (1, ""))[0] != 0]
    if reader_error is not None:
        failed.append((workers, (1, reader_error)))
    if failed:
        # the error a single process meets first: the lowest rank (an error while reading ranks after the chunks
        # already dealt)
        ranks = {k: status[k][2] if k in status else 0.0 for k, _ in failed}
        ranks[workers] = float("inf")
        bad = sorted(((ranks[k], k), rc, msg) for k, (rc, msg) in failed if rc == 1)
        bad = [(k, rc, msg) for (_, k), rc, msg in bad]
        if bad:  # bad input: a rerun would fail the same way, so nothing is kept
            shutil.rmtree(staging, ignore_errors=True)
            raise PrepError(bad[0][2])
        if any(rc == 130 for _, (rc, _) in failed):
            raise KeyboardInterrupt
        k, (rc, msg) = min(failed, key=lambda f: f[1][0] == 3)  # not one the parent stopped, if any
        raise PrepError(f"worker {k} of {workers} failed: {msg}")
    result = merge(staging)
    kept = publish_dir(staging, output, TOOL, manifest_files)  # marked as data_prep's; others' files carried over
    if kept:
        print(kept_note(kept, TOOL), file=sys.stderr)

    def moved(path: Path) -> Path:
        return output / path.relative_to(staging)
    located = {k: (m, moved(loc)) for k, (m, loc) in result.splits.items()} if result.splits else None
    return Result(result.manifest, result.records_seen, moved(result.location), located, result.val_fraction)
