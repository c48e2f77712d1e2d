"""The resumable work directory of a job (``DIR.partial`` or ``DIR/.jobIIII-of-NNNN.partial``) and the list of
the records a job did not write (``filtered.tsv``).

Shards are written as ``.tmp`` and renamed when whole; ``progress.jsonl`` lists each finished shard with its sha256
after a fingerprint of everything that fixes the shard bytes. A rerun of the same command verifies those shards,
drops anything else, and continues after the last intact one.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .checks import PrepError
from .common import BLOCK_SAMPLES, FILTERED, FILTERED_HEADER, SHARD_FORMAT, job_filtered_name
from .settings import Settings, settings_doc

if TYPE_CHECKING:
    from . import Source
    from .encode import Encoder


def fingerprint(source: Source, encoder: Encoder, inputs: list[Path], settings: Settings, members: Path | None,
                 clusters: Path | None = None) -> dict:
    """Everything that fixes the shard bytes but the shard prefix, which the caller adds: a partial run is only
    resumed by the same command on the same files."""
    def stat(p: Path):
        st = p.stat()
        return [str(p), st.st_size, st.st_mtime_ns]
    # shard_format: a work directory left with shards of another format restarts rather than mix the two
    doc = {"source": source.name, "tokenizer": encoder.entry, "settings": settings_doc(settings),
           "shard_format": SHARD_FORMAT,
           "inputs": [stat(p) for p in inputs], "members": stat(members) if members else None}
    if clusters is not None:  # only then: fingerprints of sequence runs stay as they were
        doc["clusters"] = stat(clusters)
    return json.loads(json.dumps(doc))


class WorkDir:
    """``DIR.partial`` (or a job's hidden folder): finished shards + ``progress.jsonl`` (fingerprint, then one line
    per shard renamed into place). Locked while a run writes it, so two runs never share one.

    ``splits``: ``("",)`` keeps the shards at the top; ``("train", "val")`` in one subfolder each, the progress lines
    then naming their split. Each split is verified and resumed on its own."""

    PROGRESS = "progress.jsonl"
    LOCK = ".lock"

    def __init__(self, path: Path, fingerprint: dict, prefix: str, splits: tuple = ("",)):
        self.path, self.fingerprint, self.prefix, self.splits = path, fingerprint, prefix, tuple(splits)
        path.mkdir(exist_ok=True)
        # The lock file names its holder. flock is released by the kernel when the holder dies, so a lock that is
        # held belongs to a live process; a free one that names a process left by a killed run is taken over.
        self._lock = open(path / self.LOCK, "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip()
            self._lock.close()
            raise PrepError(f"{path} is being written by another data_prep run"
                            + (f" ({holder})" if holder else "")) from None
        self._lock.seek(0)
        earlier = self._lock.read().strip()
        if earlier:
            print(f"data_prep: {path}: taking over the work left by {earlier}, which is no longer running",
                  file=sys.stderr)
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        self._lock.flush()
        self.done = self._verify()
        self._progress = open(path / self.PROGRESS, "a")

    @property
    def completed(self) -> list:
        """The verified shards of the only split (no --val-fraction)."""
        return self.done[""]

    def directory(self, split: str) -> Path:
        return self.path / split if split else self.path

    def _verify(self) -> dict:
        """Shards of a previous run that are listed, in sequence and intact; everything else is removed."""
        # imported here, not at the top: webdataset (pipeline.data.shards) pulls in torch (~2 s), which a run that
        # fails on its arguments or output directory should not wait for
        from pipeline.data.shards import ShardInfo, sha256_file
        done: dict[str, list] = {s: [] for s in self.splits}
        prog = self.path / self.PROGRESS
        lines = prog.read_text().splitlines() if prog.is_file() else []
        try:
            same = bool(lines) and json.loads(lines[0]).get("fingerprint") == self.fingerprint
        except ValueError:
            same = False
        if same:
            broken: set[str] = set()
            for line in lines[1:]:
                try:
                    doc = json.loads(line)
                    split = doc.pop("split", "")
                    info = ShardInfo(**doc)
                except (ValueError, TypeError, AttributeError):
                    break  # the line being appended when the run was killed
                if split not in done or split in broken:
                    continue
                p = self.directory(split) / info.path
                if info.path != f"{self.prefix}-{len(done[split]):06d}.tar" or not p.is_file() \
                        or sha256_file(p) != info.sha256:
                    broken.add(split)  # this split regenerates from here; the other one keeps its shards
                    continue
                done[split].append(info)
        elif lines:
            print(f"data_prep: {self.path}: left by a run with other inputs or options; starting afresh",
                  file=sys.stderr)
        keep = {self.LOCK} | {s.path for s in done.get("", [])}
        for p in self.path.iterdir():
            if p.name in done and p.name and p.is_dir():
                inner = {s.path for s in done[p.name]}
                for q in p.iterdir():
                    if q.name not in inner:
                        shutil.rmtree(q) if q.is_dir() else q.unlink()
            elif p.name not in keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        for s in self.splits:
            self.directory(s).mkdir(exist_ok=True)
        tmp = prog.with_suffix(".tmp")
        rows = [{"fingerprint": self.fingerprint}]
        for s in self.splits:
            rows += [({"split": s} if s else {}) | asdict(info) for info in done[s]]
        tmp.write_text("".join(json.dumps(x) + "\n" for x in rows))
        os.replace(tmp, prog)
        total = sum(len(v) for v in done.values())
        if total and self.splits == ("",):
            print(f"data_prep: resuming {self.path}: {total} complete shards verified, continuing with "
                  f"shard {total}", file=sys.stderr)
        elif total:
            each = ", ".join(f"{s} {len(done[s])}" for s in self.splits)
            print(f"data_prep: resuming {self.path}: {total} complete shards verified ({each}), continuing after "
                  "them", file=sys.stderr)
        return done

    def record(self, info, split: str = "") -> None:
        """Called once the shard is renamed into place. Flushed, not fsync'd: a killed process loses nothing (the page
        cache keeps it), and after a power loss a line that outlived its shard's data fails the sha256 check of
        ``_verify``, which regenerates from that shard. (An fsync per shard cost ~5 ms each: it made ext4 commit the
        shard's data too, 20% of a run at 2000-record shards.)"""
        doc = ({"split": split} if split else {}) | asdict(info)
        self._progress.write(json.dumps(doc) + "\n")
        self._progress.flush()

    def finish(self) -> None:
        self._progress.close()
        (self.path / self.PROGRESS).unlink()
        (self.path / self.LOCK).unlink()
        self._lock.close()

    def release(self) -> None:
        self._progress.close()
        if self._lock.closed:  # finished already (a failure after finish: its own error is the one to report)
            return
        self._lock.truncate(0)  # a clean exit: nobody to take over from
        self._lock.close()


class FilteredList:
    """``filtered.tsv`` being written: one row per record not written (``FILTERED_HEADER``), streamed to a
    temporary file in the work directory and renamed at the end (a rerun after a crash writes it afresh)."""

    def __init__(self, directory: Path, name: str = FILTERED):
        self.path = directory / name
        self._tmp = directory / f".{name}.tmp"
        self._f = None
        self.rows = 0

    @staticmethod
    def _clean(value) -> str:
        return str(value).replace("\t", " ").replace("\r", " ").replace("\n", " ")

    def add(self, record_id: str, reason: str, path, line, detail: str = "") -> None:
        if self._f is None:
            self._f = open(self._tmp, "w", encoding="utf-8", errors="backslashreplace")
            self._f.write("\t".join(FILTERED_HEADER) + "\n")
        self._f.write("\t".join(map(self._clean, (record_id, reason, path, line, detail))) + "\n")
        self.rows += 1

    def finish(self) -> Path | None:
        """The list's final path, or None when nothing was filtered (no file then)."""
        if self._f is None:
            return None
        self._f.close()
        self._f = None
        os.replace(self._tmp, self.path)
        return self.path

    def discard(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._tmp.unlink(missing_ok=True)


class ShardSet:
    """One output shard set being written: ``""`` (the only one) or train / val."""

    def __init__(self, name: str, work: WorkDir, settings: Settings, encoder: Encoder, filtered_name: str,
                 layout: str = "sequences"):
        self.name, self.work, self.settings, self.encoder, self.layout = name, work, settings, encoder, layout
        self.directory = work.directory(name)
        self.completed = work.done[name]
        self.skip = sum(x.samples for x in self.completed)  # samples already in verified shards: not rewritten
        self.written = 0
        self.writer = None
        self.dropped = FilteredList(self.directory, filtered_name)
        self._thread: ThreadPoolExecutor | None = None  # where the writer's calls run (``_send``)
        self._pending: deque = deque()
        self._failed = False  # a writer call failed: the others are skipped
        self.threaded = settings.num_jobs == 1  # whether ``_send`` uses a thread

    def open_writer(self):
        """The writer, created at the first sample, so that a malformed first record fails without loading torch."""
        if self.writer is None:
            from pipeline.data.shards import ShardWriter  # torch's import time: see WorkDir._verify
            work, name = self.work, self.name
            on_close = work.record if not name else (lambda info: work.record(info, name))
            self.writer = ShardWriter(self.directory, work.prefix, self.settings.shard_size,
                                      vocab_size=self.encoder.vocab_size, completed=self.completed,
                                      on_close=on_close, layout=self.layout, block_samples=BLOCK_SAMPLES)
        return self.writer

    def _send(self, call, *args) -> None:
        """``call(*args)`` of the writer on a thread of its own, in order: a shard's npy, tar and sha256 work goes on
        beside the job's (at most 2 calls waiting; a failed call raises here, at a later call, or at ``close``).
        Unless ``threaded`` is off (then in this thread): in a job of an array (``--num-jobs``, the jobs of
        ``--workers``), whose siblings take the other cores, and beside a pool that parses the job's chunks
        (data_prep/build.py): a thread more there made two jobs on two cores, and a job with a pool of two, slower."""
        if not self.threaded:
            call(*args)
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, "data_prep-shards")
        while len(self._pending) >= 2 or (self._pending and self._pending[0].done()):
            self._pending.popleft().result()
        self._pending.append(self._thread.submit(self._call, call, args))

    def _call(self, call, args) -> None:
        """One writer call on the thread; none after a failed one (the writer's shard is then half-made: the calls
        waiting behind it would finish and record it)."""
        if self._failed:
            return
        try:
            call(*args)
        except BaseException:
            self._failed = True
            raise

    def _drain(self, errors: bool = True) -> None:
        """Wait for the writer's calls; their first error raised (``errors``) or dropped. The thread ends either way
        (after a failed call the others are skipped)."""
        try:
            while self._pending:
                future = self._pending.popleft()
                if errors:
                    future.result()
                else:
                    future.exception()
        finally:
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None

    def write(self, key: str, tokens, meta: dict, offsets=None) -> None:
        self.written += 1
        if self.written <= self.skip:
            return  # already in a verified shard of the interrupted run
        self._send(self.open_writer().write, key, tokens, meta, *(() if offsets is None else (offsets,)))

    def extend(self, keys: list, tokens: np.ndarray, bounds: np.ndarray, metas: list,
               members: np.ndarray | None = None) -> None:
        """Several samples (ShardWriter.extend), those already in verified shards skipped as in ``write``."""
        n = len(keys)
        skip = min(n, max(0, self.skip - self.written))
        self.written += n
        if skip == n:
            return
        if skip:
            if members is not None:  # the skipped samples' members: those that end by bounds[skip]
                members = members[np.searchsorted(np.cumsum(members), bounds[skip], "right"):]
            keys, metas, tokens, bounds = keys[skip:], metas[skip:], tokens[bounds[skip]:], bounds[skip:] - bounds[skip]
        self._send(self.open_writer().extend, keys, tokens, bounds, metas, members)

    def abort(self) -> None:
        self._drain(errors=False)
        if self.writer is not None:
            self.writer.abort()
        self.dropped.discard()

    def close(self) -> list:
        self._drain()
        if self.written < self.skip:
            raise PrepError(f"{self.directory}: the verified shards hold {self.skip} samples but this run produced "
                            f"{self.written}; remove the work directory and rerun")
        if self.writer is None and self.completed:
            self.open_writer()
        return self.writer.close() if self.writer is not None else []


def open_splits(work: WorkDir, settings: Settings, encoder: Encoder, layout: str = "sequences") -> dict:
    """name -> ShardSet for the run's shard sets."""
    name = FILTERED if settings.num_jobs == 1 else job_filtered_name(settings.job_index, settings.num_jobs)
    return {s: ShardSet(s, work, settings, encoder, name, layout) for s in work.splits}
